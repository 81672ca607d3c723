"""The broker-outage retry policy: what it repeats, what it does not, and its budget."""

import pytest

from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    MessageTooLargeError,
    TopicNotFoundError,
)
from stream_assets.runtime.outage import ride_out_outage


class Flaky:
    """Fails with ``errors`` in turn, then returns the number of calls."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.calls


def ride(step: Flaky, budget_s: float, log: list[str] | None = None) -> int:
    sink = log if log is not None else []
    return ride_out_outage(step, budget_s=budget_s, what="t", log=sink.append, first_wait_s=0)


def test_transient_errors_are_repeated_until_the_step_succeeds() -> None:
    step = Flaky(
        BrokerUnreachableError("broker", "127.0.0.1:1", "connection refused"),
        TopicNotFoundError("t", "127.0.0.1:1"),
        ConnectionResetError("reset"),
    )
    log: list[str] = []
    assert ride(step, budget_s=30, log=log) == 4
    assert len(log) == 3 and "connection refused" in log[0] and "retry 1" in log[0]


def test_wrong_input_is_not_retried() -> None:
    step = Flaky(MessageTooLargeError("t", 10, 5), TopicNotFoundError("t", "x"))
    with pytest.raises(MessageTooLargeError):
        ride(step, budget_s=30)
    assert step.calls == 1


def test_the_last_error_is_raised_once_the_budget_is_spent() -> None:
    calls = 0

    def always_down() -> int:
        nonlocal calls
        calls += 1
        raise ConnectionRefusedError(f"attempt {calls}")

    with pytest.raises(ConnectionRefusedError) as raised:
        ride_out_outage(always_down, budget_s=0.05, what="t", log=lambda m: None, first_wait_s=0)
    assert calls > 1 and str(raised.value) == f"attempt {calls}"


def test_zero_budget_fails_at_once() -> None:
    step = Flaky(ConnectionRefusedError("down"))
    with pytest.raises(ConnectionRefusedError):
        ride(step, budget_s=0)
    assert step.calls == 1
