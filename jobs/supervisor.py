"""The supervisor sensor: keeps each deployed topology's instances running.

For every registered topology with a desired state (written by the scale job),
each tick:

- finds the unfinished instance runs of the topology (by run tags);
- declares dead a run whose heartbeat is older than ``heartbeat_timeout_s``
  (or that never beat within that time of starting): Dagster's default run
  launcher never notices a run whose process was killed, so the run would stay
  STARTED forever. The dead run is marked FAILED;
- requests a run for every instance index of the current allocation that has
  no live run serving exactly its assignment, with a fresh ``run_key`` per
  attempt (one run_key makes one run);
- reports the topology's lag as an observation of its source topic.

A topology whose desired state is ``paused`` (a scale in progress) is left
alone. Instances beyond the queue count are launched too, and idle.
"""

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import dagster as dg

from jobs.instance_job import (
    INSTANCE_JOB,
    instance_job,
    instance_run_config,
    instance_run_tags,
)
from stream_assets.control.allocation import Allocation
from stream_assets.control.desired_state import DesiredState, DesiredStateStore, heartbeats
from stream_assets.control.lineage import topic_asset_key
from stream_assets.control.registry import (
    GENERATION_TAG,
    INSTANCE_INDEX_TAG,
    REGISTRY,
    TOPOLOGY_TAG,
)

#: Seconds without a heartbeat after which a run's process is presumed gone.
HEARTBEAT_TIMEOUT_S = float(os.environ.get("STREAM_ASSETS_HEARTBEAT_TIMEOUT_S", "30"))
#: How long a new run may take to send its first heartbeat (Spark start-up).
STARTUP_GRACE_S = float(os.environ.get("STREAM_ASSETS_STARTUP_GRACE_S", "180"))
SENSOR_INTERVAL_S = int(os.environ.get("STREAM_ASSETS_SUPERVISOR_INTERVAL_S", "15"))

UNFINISHED = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


def instance_runs(
    instance: dg.DagsterInstance, topology: str, statuses: list[dg.DagsterRunStatus] | None = None
) -> list[dg.DagsterRun]:
    """Instance runs of ``topology`` (unfinished ones by default)."""
    return list(
        instance.get_runs(
            filters=dg.RunsFilter(
                job_name=INSTANCE_JOB,
                tags={TOPOLOGY_TAG: topology},
                statuses=statuses if statuses is not None else UNFINISHED,
            )
        )
    )


def run_assignment(run: dg.DagsterRun) -> Any:
    """The assignment an instance run was started with."""
    run_config: dict[str, Any] = dict(run.run_config)
    config = run_config.get("ops", {}).get("run_instance", {}).get("config", {})
    return json.loads(config.get("assignment_json", "null"))


def run_index(run: dg.DagsterRun) -> int:
    """The instance index an instance run was tagged with (-1 if untagged)."""
    return int(run.tags.get(INSTANCE_INDEX_TAG, -1))


def serves(run: dg.DagsterRun, allocation: Allocation) -> bool:
    """Whether instance run ``run`` owns its share of ``allocation`` (:meth:`Allocation.assigns`).

    Example::

        >>> to_stop = [r for r in instance_runs(instance, "wordcount")
        ...            if not serves(r, new_allocation)]  # doctest: +SKIP
    """
    return allocation.assigns(run_index(run), run_assignment(run))


def dead_runs(instance: dg.DagsterInstance, runs: list[dg.DagsterRun], now: float) -> list[str]:
    """Runs that are STARTED but whose process stopped heartbeating."""
    started = [r for r in runs if r.status == dg.DagsterRunStatus.STARTED]
    if not started:
        return []
    beats = heartbeats(instance, [r.run_id for r in started])
    dead = []
    for run in started:
        beat = beats.get(run.run_id)
        if beat is not None:
            if beat.age(now) > HEARTBEAT_TIMEOUT_S:
                dead.append(run.run_id)
            continue
        record = instance.get_run_record_by_id(run.run_id)
        since = record.start_time if record and record.start_time else run_created(record)
        if since is not None and now - since > STARTUP_GRACE_S:
            dead.append(run.run_id)
    return dead


def run_created(record: Any) -> float | None:
    """Creation time of a run record, as epoch seconds."""
    if record is None or record.create_timestamp is None:
        return None
    return float(record.create_timestamp.timestamp())


def plan_topology(
    instance: dg.DagsterInstance, name: str, state: DesiredState, now: float
) -> Iterator[dg.RunRequest | str]:
    """Run requests (and log lines) that bring ``name`` to its desired state."""
    allocation = state.allocation
    if allocation is None or state.paused:
        return
    runs = instance_runs(instance, name)
    dead = set(dead_runs(instance, runs, now))
    for run in runs:
        if run.run_id in dead:
            instance.report_run_failed(run, "no heartbeat: the instance process is gone")
            yield f"{name}: run {run.run_id} stopped heartbeating; marked failed, relaunching"
    live = [r for r in runs if r.run_id not in dead and r.status != dg.DagsterRunStatus.CANCELING]
    serving = {run_index(r) for r in live if serves(r, allocation)}
    for index in range(allocation.instances):
        if index in serving:
            continue
        attempts = instance.get_runs_count(
            filters=dg.RunsFilter(
                job_name=INSTANCE_JOB,
                tags={
                    TOPOLOGY_TAG: name,
                    GENERATION_TAG: str(allocation.generation),
                    INSTANCE_INDEX_TAG: str(index),
                },
            )
        )
        share = allocation.for_instance(index)
        yield dg.RunRequest(
            run_key=f"{name}:g{allocation.generation}:i{index}:a{attempts}",
            job_name=INSTANCE_JOB,
            run_config=instance_run_config(name, allocation.generation, index, share),
            tags=instance_run_tags(name, allocation.generation, index, share),
        )


@dg.sensor(
    job=instance_job,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Keeps every deployed topology's instances running; relaunches crashed ones.",
)
def supervisor_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    """One supervision pass over every registered topology."""
    now = time.time()
    requests: list[dg.RunRequest] = []
    events: list[dg.AssetObservation] = []
    states = DesiredStateStore(context.instance).get_many(REGISTRY)
    for name, state in sorted(states.items()):
        for item in plan_topology(context.instance, name, state, now):
            if isinstance(item, str):
                context.log.warning(item)
            else:
                requests.append(item)
        lag = _reported_lag(context.instance, name)
        if lag is not None:
            topology = REGISTRY[name].topology()
            events.append(
                dg.AssetObservation(
                    asset_key=topic_asset_key(topology.source_topic),
                    metadata={"consumer_lag": lag, "topology": name},
                )
            )
    return dg.SensorResult(
        run_requests=requests,
        asset_events=events,
        skip_reason=None if requests else "every instance is running",
    )


def _reported_lag(instance: dg.DagsterInstance, name: str) -> int | None:
    runs = instance_runs(instance, name, [dg.DagsterRunStatus.STARTED])
    beats = heartbeats(instance, [r.run_id for r in runs]) if runs else {}
    if not beats:
        return None
    return sum(sum(b.lag.values()) for b in beats.values())
