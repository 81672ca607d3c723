"""The supervisor's plan on a real (temporary) Dagster instance: what it launches and why."""

import json
import time
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from jobs.instance_job import instance_job, instance_run_config
from jobs.supervisor import STARTUP_GRACE_S, plan_topology
from stream_assets.control.allocation import allocate, changed_instances
from stream_assets.control.desired_state import DesiredState, record_heartbeat
from stream_assets.control.registry import (
    GENERATION_TAG,
    IDLE_TAG,
    INSTANCE_INDEX_TAG,
    TOPOLOGY_TAG,
)

NAME = "wc"
QUEUES = {"wc-src": [0, 1], "wc-shuffle": [0, 1, 2, 3]}


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def _requests(instance: dg.DagsterInstance, state: DesiredState, now: float) -> list[Any]:
    return [r for r in plan_topology(instance, NAME, state, now) if isinstance(r, dg.RunRequest)]


def _assignment(request: dg.RunRequest) -> Any:
    config = request.run_config["ops"]["run_instance"]["config"]
    return json.loads(config["assignment_json"])


def _start(instance: dg.DagsterInstance, request: dg.RunRequest) -> dg.DagsterRun:
    run = instance.create_run_for_job(
        instance_job, run_config=request.run_config, tags=dict(request.tags)
    )
    instance.handle_new_event(
        dg.EventLogEntry(
            error_info=None,
            level="DEBUG",
            user_message="",
            run_id=run.run_id,
            timestamp=0.0,
            dagster_event=dg.DagsterEvent(
                event_type_value=dg.DagsterEventType.RUN_START.value, job_name=run.job_name
            ),
        )
    )
    started = instance.get_run_by_id(run.run_id)
    assert started is not None and started.status == dg.DagsterRunStatus.STARTED
    return started


def test_instances_beyond_the_queue_count_are_launched_idle_and_tagged(
    instance: dg.DagsterInstance,
) -> None:
    allocation = allocate(QUEUES, 5)
    requests = _requests(instance, DesiredState(5, allocation), now=0.0)
    by_index = {int(r.tags[INSTANCE_INDEX_TAG]): r for r in requests}
    assert sorted(by_index) == [0, 1, 2, 3, 4]
    # Four shuffle queues for five instances: exactly one instance owns nothing.
    owned = {i: any(_assignment(r).values()) for i, r in by_index.items()}
    assert [i for i, has in owned.items() if not has] == [4]
    assert _assignment(by_index[4]) == {"wc-shuffle": [], "wc-src": []}
    assert {i for i, r in by_index.items() if r.tags.get(IDLE_TAG) == "true"} == {4}
    # Every queue is owned by exactly one request's assignment.
    for topic, queues in QUEUES.items():
        assert sorted(q for r in requests for q in _assignment(r)[topic]) == queues


def test_paused_topology_gets_no_runs(instance: dg.DagsterInstance) -> None:
    state = DesiredState(2, allocate(QUEUES, 2), paused=True)
    assert _requests(instance, state, now=0.0) == []


def test_live_runs_are_kept_and_silent_ones_relaunched(instance: dg.DagsterInstance) -> None:
    allocation = allocate(QUEUES, 2)
    state = DesiredState(2, allocation)
    first = _requests(instance, state, now=time.time())
    runs = {int(r.tags[INSTANCE_INDEX_TAG]): _start(instance, r) for r in first}
    now = time.time()
    for index, run in runs.items():
        record_heartbeat(instance, NAME, allocation.generation, index, run.run_id, ts=now)
    assert _requests(instance, state, now=now) == []

    # Instance 1 stops beating (its process was killed): after the timeout it is
    # marked failed and requested again under a new run key; instance 0 is left alone.
    record_heartbeat(instance, NAME, allocation.generation, 0, runs[0].run_id, ts=now + 600)
    again = _requests(instance, state, now=now + 600)
    assert [int(r.tags[INSTANCE_INDEX_TAG]) for r in again] == [1]
    assert again[0].tags[GENERATION_TAG] == str(allocation.generation)
    assert _assignment(again[0]) == allocation.for_instance(1)
    assert again[0].run_key != first[1].run_key
    failed = instance.get_run_by_id(runs[1].run_id)
    assert failed is not None and failed.status == dg.DagsterRunStatus.FAILURE


def test_a_run_that_never_beats_is_relaunched_after_the_grace(
    instance: dg.DagsterInstance,
) -> None:
    state = DesiredState(1, allocate(QUEUES, 1))
    (request,) = _requests(instance, state, now=time.time())
    _start(instance, request)
    assert _requests(instance, state, now=time.time()) == []
    (relaunch,) = _requests(instance, state, now=time.time() + STARTUP_GRACE_S + 1)
    assert relaunch.tags[INSTANCE_INDEX_TAG] == "0"


def test_runs_whose_share_changed_no_longer_serve(instance: dg.DagsterInstance) -> None:
    old = allocate(QUEUES, 2)
    now = time.time()
    for request in _requests(instance, DesiredState(2, old), now=now):
        run = _start(instance, request)
        index = int(request.tags[INSTANCE_INDEX_TAG])
        record_heartbeat(instance, NAME, old.generation, index, run.run_id, ts=now)
    # A run started by hand without an instance index serves no index (and is no error).
    _start(
        instance,
        dg.RunRequest(
            run_config=instance_run_config(NAME, old.generation, 0, old.for_instance(0)),
            tags={TOPOLOGY_TAG: NAME},
        ),
    )
    new = allocate(QUEUES, 3, "sticky", previous=old)
    requests = _requests(instance, DesiredState(3, new), now=now)
    # Instance 0's share survives the scale, so its run (of the older generation)
    # keeps serving; instance 1's share changed and instance 2 is new.
    assert sorted(changed_instances(old, new)) == [1, 2]
    assert sorted(int(r.tags[INSTANCE_INDEX_TAG]) for r in requests) == [1, 2]
