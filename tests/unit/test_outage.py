"""The broker-outage retry policy: what it repeats, what it does not, and its budget."""

import time

import pytest

from stream_assets.rocketmq.errors import (
    BrokerOutageError,
    BrokerUnreachableError,
    MessageTooLargeError,
    TopicNotFoundError,
)
from stream_assets.runtime.drive.outage import OutagePolicy, ride_out_outage


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


def ride(step: Flaky, budget_s: float | None, log: list[str] | None = None) -> int:
    sink = log if log is not None else []
    policy = OutagePolicy(budget_s=budget_s, status_command="stream-assets cluster status")
    return ride_out_outage(step, policy=policy, what="t", log=sink.append, first_wait_s=0)


def test_transient_errors_are_repeated_until_the_step_succeeds() -> None:
    step = Flaky(
        BrokerUnreachableError("broker", "127.0.0.1:1", "connection refused"),
        TopicNotFoundError("t", "127.0.0.1:1"),
        ConnectionResetError("reset"),
    )
    log: list[str] = []
    assert ride(step, budget_s=30, log=log) == 4
    # The first retry says what it waits for; the end says the broker is back.
    assert len(log) == 2 and "connection refused" in log[0] and "0 s so far" in log[0]
    assert log[1] == "t: the broker is back after 0 s"


def test_without_a_budget_it_waits_as_long_as_the_outage_lasts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A clock that moves 7 s per retry (tenacity and the policy read the same
    # time module): an hour of outage without waiting an hour.
    now = [0.0]

    def sleep(seconds: float) -> None:
        assert seconds <= 5.0  # backoff_max_s
        now[0] += 7.0

    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(time, "sleep", sleep)
    step = Flaky(*[ConnectionRefusedError("down")] * 600)
    log: list[str] = []
    policy = OutagePolicy(budget_s=None)
    assert ride_out_outage(step, policy=policy, what="t", log=log.append) == 601
    assert now[0] >= 4_000
    # One line every 30 s of outage, each saying there is no budget, and the end.
    assert 100 < len(log) < 160
    assert all("no budget: it waits as long as the outage lasts" in m for m in log[:-1])
    assert log[-1].startswith("t: the broker is back after 42")


def test_wrong_input_is_not_retried() -> None:
    step = Flaky(MessageTooLargeError("t", 10, 5), TopicNotFoundError("t", "x"))
    with pytest.raises(MessageTooLargeError):
        ride(step, budget_s=None)
    assert step.calls == 1


def test_past_a_set_budget_one_sentence_says_how_long_the_budget_and_the_setting() -> None:
    calls = 0

    def always_down() -> int:
        nonlocal calls
        calls += 1
        raise ConnectionRefusedError(f"attempt {calls}")

    policy = OutagePolicy(budget_s=0.05, status_command="stream-assets deploy status")
    with pytest.raises(BrokerOutageError) as raised:
        ride_out_outage(
            always_down, policy=policy, what="stage 0 queue 3", log=lambda m: None, first_wait_s=0
        )
    text = str(raised.value)
    assert calls > 1 and text.startswith("stage 0 queue 3: the broker was unavailable for 0 s")
    assert "past the outage budget of 0 s" in text
    assert "STREAM_ASSETS_ENGINE_BROKER_OUTAGE_S" in text and "unset it" in text
    assert "`stream-assets deploy status`" in text and text.endswith(f"(attempt {calls})")
    assert "\n" not in text
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)


def test_zero_budget_fails_at_once() -> None:
    step = Flaky(ConnectionRefusedError("down"))
    with pytest.raises(BrokerOutageError):
        ride(step, budget_s=0)
    assert step.calls == 1


# -- a topic without a route while its broker is down ---------------------------------


def test_a_missing_route_is_logged_as_a_broker_not_registered_not_a_missing_topic() -> None:
    step = Flaky(TopicNotFoundError("orders", "127.0.0.1:9876"))
    log: list[str] = []
    assert ride(step, budget_s=30, log=log) == 2
    line = log[0]
    assert "no route for topic 'orders'" in line and "127.0.0.1:9876" in line
    assert "restarting or down" in line and "not registered with the name server" in line
    assert "does not exist" not in line and "create" not in line
    assert "`stream-assets cluster status`" in line


def test_a_route_still_missing_past_the_budget_names_the_unregistered_broker() -> None:
    step = Flaky(TopicNotFoundError("t", "127.0.0.1:1"))
    with pytest.raises(BrokerOutageError, match="not registered with the name server") as raised:
        ride(step, budget_s=0)
    assert "does not exist" not in str(raised.value) and step.calls == 1


def test_a_topic_not_found_subclass_keeps_its_own_message() -> None:
    class Definite(TopicNotFoundError):
        def __init__(self) -> None:
            super().__init__("src", "127.0.0.1:1")
            self.args = ("source topic 'src' does not exist; create it first",)

    with pytest.raises(BrokerOutageError) as raised:
        ride(Flaky(Definite()), budget_s=0)
    assert isinstance(raised.value.__cause__, Definite)


def test_other_errors_are_still_logged_with_their_own_text() -> None:
    step = Flaky(BrokerUnreachableError("broker broker-a", "127.0.0.1:1", "connection refused"))
    log: list[str] = []
    ride(step, budget_s=30, log=log)
    assert "broker unavailable (cannot reach RocketMQ broker broker-a at 127.0.0.1:1" in log[0]


def test_an_unknown_address_is_not_printed_as_a_dash() -> None:
    text = str(BrokerUnreachableError("broker group broker-b", "-", "its master is down"))
    assert text.startswith("cannot reach RocketMQ broker group broker-b: its master is down.")
    assert "cluster status" in text and "deploy status" in text


def test_the_default_message_names_both_causes() -> None:
    text = str(TopicNotFoundError("t", "127.0.0.1:1"))
    assert "no route for topic 't'" in text
    assert "does not exist" in text and "create it" in text
    assert "registered with the name server" in text and "broker status" in text
