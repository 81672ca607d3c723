"""An instance run's heartbeat: silent while starting, then progress and lag with every beat."""

from __future__ import annotations

from types import SimpleNamespace

import dagster as dg

from jobs.instance_job import Heart, InstanceConfig
from stream_assets.control.desired_state import heartbeats
from stream_assets.control.rebalance import RebalanceFollower


class StartedInstance:
    running = True


def test_no_heartbeat_before_the_run_follows_rebalances() -> None:
    """Until then the supervisor sees "no heartbeat yet": starting, however long it takes."""
    instance = dg.DagsterInstance.ephemeral()
    heart = Heart(SimpleNamespace(instance=instance, run_id="run-a"), InstanceConfig(topology="wc"))  # type: ignore[arg-type]
    heart.beat()
    assert heartbeats(instance, ["run-a"]) == {}


def test_a_beat_carries_progress_and_lag_and_answers_progress_at_once() -> None:
    instance = dg.DagsterInstance.ephemeral()
    config = InstanceConfig(topology="wc", instance_index=1, generation=3, heartbeat_interval_s=60)
    heart = Heart(SimpleNamespace(instance=instance, run_id="run-b"), config)  # type: ignore[arg-type]
    heart.follower = RebalanceFollower(StartedInstance(), 1, 3, {"in": [1]})  # type: ignore[arg-type]
    heart.lag = {"in": {1: 4, 3: 2}}
    assert heart.due(now=60.0)  # the interval is up since the (never sent) last beat
    heart.beat()
    beat = heartbeats(instance, ["run-b"])["run-b"]
    assert (beat.generation, beat.instance_index, beat.running, beat.lag) == (3, 1, 3, {"in": 6})
    assert not heart.due(heart.sent_at + 1.0)
    heart.follower.progress.warmed = 4  # a rebalance step done: answer it now
    assert heart.due(heart.sent_at + 1.0)
