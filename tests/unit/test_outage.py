"""The broker-outage retry policy: what it repeats, what it does not, and its budget."""

import re

import pytest

from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    MessageTooLargeError,
    TopicNotFoundError,
)
from stream_assets.runtime.drive.outage import ride_out_outage


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


# -- a topic without a route while its broker is down ---------------------------------


def test_a_missing_route_is_logged_as_a_broker_not_registered_not_a_missing_topic() -> None:
    step = Flaky(TopicNotFoundError("orders", "127.0.0.1:9876"))
    log: list[str] = []
    assert ride(step, budget_s=30, log=log) == 2
    (line,) = log
    assert "no route for topic 'orders'" in line and "127.0.0.1:9876" in line
    assert "restarting or down" in line and "not registered with the name server" in line
    assert "does not exist" not in line and "create" not in line
    assert "retry 1" in line


def test_a_route_still_missing_at_the_end_raises_the_broker_unreachable_error() -> None:
    calls = 0

    def route_gone() -> int:
        nonlocal calls
        calls += 1
        raise TopicNotFoundError("orders", "127.0.0.1:9876")

    log: list[str] = []
    with pytest.raises(TopicNotFoundError) as raised:
        ride_out_outage(route_gone, budget_s=0.05, what="t", log=log.append, first_wait_s=0)
    err = raised.value
    text = str(err)
    # Still a TopicNotFoundError (callers handling that keep working), saying what it is.
    assert err.existed and err.topic == "orders" and err.namesrv == "127.0.0.1:9876"
    assert "unreachable, not registered with the name server" in text
    assert "topic existed" in text and re.search(r"after \d+s of retries", text)
    assert "does not exist" not in text and "create" not in text
    assert isinstance(err.__cause__, TopicNotFoundError) and not err.__cause__.existed
    assert calls > 1 and len(log) == calls - 1
    assert all("does not exist" not in line for line in log)


def test_zero_budget_still_names_the_unregistered_broker() -> None:
    step = Flaky(TopicNotFoundError("t", "127.0.0.1:1"))
    with pytest.raises(TopicNotFoundError, match="unreachable, not registered") as raised:
        ride(step, budget_s=0)
    assert raised.value.existed and step.calls == 1


def test_a_topic_not_found_subclass_keeps_its_own_message() -> None:
    class Definite(TopicNotFoundError):
        def __init__(self) -> None:
            super().__init__("src", "127.0.0.1:1")
            self.args = ("source topic 'src' does not exist; create it first",)

    with pytest.raises(Definite, match="create it first"):
        ride(Flaky(Definite()), budget_s=0)


def test_other_errors_are_still_logged_with_their_own_text() -> None:
    step = Flaky(BrokerUnreachableError("broker broker-a", "127.0.0.1:1", "connection refused"))
    log: list[str] = []
    ride(step, budget_s=30, log=log)
    assert log[0].startswith("t: broker unavailable (cannot reach RocketMQ broker broker-a")


def test_the_default_message_names_both_causes() -> None:
    text = str(TopicNotFoundError("t", "127.0.0.1:1"))
    assert "no route for topic 't'" in text
    assert "does not exist" in text and "create it" in text
    assert "registered with the name server" in text and "broker status" in text
