"""An instance run's heartbeat: silent while starting, then beaten by a thread of its own.

The thread is what keeps a run whose loop is stuck in a slow step (a query start
on a busy machine) from being judged hung; the beat says which step and since when.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace

import dagster as dg
import pytest
import sqlalchemy.exc

from stream_assets.control.desired_state import Heartbeat, heartbeats
from stream_assets.control.rebalance import RebalanceFollower
from stream_assets.jobs.instance_heart import Heart
from stream_assets.jobs.instance_job import InstanceConfig


class StartedInstance:
    running = True


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def _heart(instance: dg.DagsterInstance, run_id: str, **config: object) -> Heart:
    # A real logger: a busy storage (SQLite "table is locked" on a loaded machine) makes
    # the thread warn and retry, as under Dagster; a log without warning() killed it.
    log = logging.getLogger(f"test-heart-{run_id}")
    context = SimpleNamespace(instance=instance, run_id=run_id, log=log)
    return Heart(context, InstanceConfig(topology="wc", **config))  # type: ignore[arg-type]


def _await_beat(
    instance: dg.DagsterInstance, run_id: str, accept: object, timeout_s: float = 30.0
) -> Heartbeat:
    """The first stored beat of ``run_id`` that ``accept`` takes (polling the storage)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            beat = heartbeats(instance, [run_id]).get(run_id)
        except sqlalchemy.exc.OperationalError:
            # The ephemeral instance's in-memory SQLite locks its table while the
            # heart's thread writes a beat: read again, as the supervisor would.
            beat = None
        if beat is not None and accept(beat):  # type: ignore[operator]
            return beat
        time.sleep(0.02)
    raise AssertionError(f"no matching heartbeat of {run_id} within {timeout_s} s")


def test_no_heartbeat_before_the_run_follows_rebalances(instance: dg.DagsterInstance) -> None:
    """Until then the supervisor sees "no heartbeat yet": starting, however long it takes."""
    heart = _heart(instance, "run-a")
    heart.beat()
    assert heartbeats(instance, ["run-a"]) == {}


def test_a_beat_carries_progress_and_lag_and_progress_is_answered_at_once(
    instance: dg.DagsterInstance,
) -> None:
    heart = _heart(instance, "run-b", instance_index=1, generation=3, heartbeat_interval_s=60)
    follower = RebalanceFollower(StartedInstance(), 1, 3, {"in": [1]})  # type: ignore[arg-type]
    heart.follower = follower
    heart.lag = {"in": {1: 4, 3: 2}}
    heart.batch_at = lambda: 123.0
    assert heart.progressed()  # nothing sent yet
    heart.beat()
    beat = heartbeats(instance, ["run-b"])["run-b"]
    assert (beat.generation, beat.instance_index, beat.running, beat.lag) == (3, 1, 3, {"in": 6})
    assert beat.batch_at == 123.0 and beat.busy == ""
    assert not heart.progressed()
    follower.progress = type(follower.progress)(warmed=4)  # a rebalance step done
    assert heart.progressed()


def test_the_thread_beats_while_the_loop_is_stuck_and_says_in_what(
    instance: dg.DagsterInstance,
) -> None:
    """The loop blocks in one step (as a query start does); beats keep coming, naming it."""
    heart = _heart(instance, "run-c", heartbeat_interval_s=0.05)
    heart.follower = RebalanceFollower(StartedInstance(), 0, 1, {"in": [0]})  # type: ignore[arg-type]
    # Bounds taken around each call, not a tolerance: on a loaded machine the thread
    # can be descheduled for longer than any fixed one between the call and time().
    before_loop = time.time()
    heart.looped()
    looped_at = time.time()
    heart.start()
    try:
        before_busy = time.time()
        with heart.busy("starting the query of stage 1"):
            entered = time.time()
            first = _await_beat(instance, "run-c", lambda b: b.busy != "")
            later = _await_beat(instance, "run-c", lambda b: b.ts > first.ts + 0.2)
        # Beats came while the loop was stuck; its last round stayed where it was.
        assert later.busy == "starting the query of stage 1"
        assert before_busy <= later.busy_since <= entered
        assert before_loop <= later.loop_at <= looped_at
        assert later.stalled_s(later.ts) >= 0.2
        done = _await_beat(instance, "run-c", lambda b: b.busy == "")
        assert done.ts > later.ts
    finally:
        heart.stop()
    stopped = heartbeats(instance, ["run-c"])["run-c"]
    time.sleep(0.2)  # several intervals: no beat may come after stop()
    assert heartbeats(instance, ["run-c"])["run-c"] == stopped


def test_nested_steps_show_the_innermost_then_the_outer_again() -> None:
    heart = Heart(None, None)  # type: ignore[arg-type]
    with heart.busy("taking queues over"):
        with heart.busy("starting the query of stage 0"):
            assert heart.doing() is not None and heart.doing()[0].startswith("starting")  # type: ignore[index]
        assert heart.doing() is not None and heart.doing()[0] == "taking queues over"  # type: ignore[index]
    assert heart.doing() is None


def test_a_busy_storage_costs_beats_not_the_thread(
    instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite under load refuses writes now and then ("table is locked"): the thread
    warns once and beats again when the storage takes writes."""
    from stream_assets.jobs import instance_heart

    real = instance_heart.record_heartbeat
    refused: list[int] = []

    def refuse_three(*args: object, **kwargs: object) -> None:
        if len(refused) < 3:
            refused.append(1)
            raise RuntimeError("database table is locked: kvs")
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(instance_heart, "record_heartbeat", refuse_three)
    heart = _heart(instance, "run-e", heartbeat_interval_s=0.05)
    heart.follower = RebalanceFollower(StartedInstance(), 0, 1, {"in": [0]})  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="test-heart-run-e"):
        heart.start()
        try:
            _await_beat(instance, "run-e", lambda b: True)
        finally:
            heart.stop()
    assert len(refused) == 3
    warned = [r.message for r in caplog.records if "heartbeat not recorded" in r.message]
    assert len(warned) == 1 and "table is locked" in warned[0]
