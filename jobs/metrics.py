"""The metrics sensor: topology totals on the topology, sink and source assets.

Each instance run observes only its topology asset, under keys named for its
index (``instance_<i>.records_per_s``, ...; see
:mod:`stream_assets.control.metrics`). Every ``STREAM_ASSETS_METRICS_INTERVAL_S``
this sensor, for each deployed topology (one with a desired state):

1. takes the latest observation of every unfinished instance run of the
   topology, if it is newer than ``STREAM_ASSETS_METRICS_STALE_S``;
2. sums them (:func:`~stream_assets.control.metrics.aggregate`) and
   - *materializes* the **topology** asset with its headline first (``1_lag``,
     ``2_records_per_s``, ``3_records_out_per_s``, ``4_dead_letters``,
     ``5_running_instances``, ``6_desired_instances``), then ``phase``,
     ``paused``, ``generation`` and the other totals (``all.state_bytes``, ...);
   - observes every **sink** topic with the totals, under the keys instances
     used to write there (``records_per_s``, ``lag``, ``records_out``, ...);
   - observes every **source** topic with the topology's lag and input rate there.

Why a materialization for the topology's own numbers: the instances observe
the same asset every few seconds, and the asset page's Metadata table shows
the latest materialization before any observation (and refreshes when a new
one arrives). As observations, the totals would lead that table only when no
instance happened to report after them. In the Events tab, materializations
are then the topology's numbers and observations the instances' reports (the
type filter separates them); alerts are failed asset checks, not events
(jobs/alerts.py, jobs/checks.py).

Why a sensor and not, say, instance 0: the totals need every instance's
numbers and the desired state, and must go on while any one instance is down
or restarting; the sensor runs in the daemon, costs no run, and reads both
from the Dagster instance. Every series then has one writer, so the sink
asset's plots are topology totals instead of a line jumping between instances.
A topic that several topologies use (a shared source, or one topology's sink
feeding another) gets each topology's keys prefixed ``<job id>.``.

Events are emitted only when there is something new: the cursor keeps,
per topology, the newest instance observation summed and the desired state
last shown.

Example (one tick, as the daemon makes it)::

    >>> context = dg.build_sensor_context(instance=instance)  # doctest: +SKIP
    >>> result = topology_metrics_sensor(context)  # doctest: +SKIP
    >>> sorted((e.asset_key.to_user_string(), type(e).__name__)
    ...        for e in result.asset_events)  # doctest: +SKIP
    [('topics/sourceTopic', 'AssetObservation'), ('topics/wordcount_out', 'AssetObservation'),
     ('topologies/wordcount', 'AssetMaterialization')]
"""

import json
import time
from collections.abc import Mapping
from typing import Any

import dagster as dg

from stream_assets.control.desired_state import DesiredState, DesiredStateStore
from stream_assets.control.lineage import topic_asset_key, topology_asset_key
from stream_assets.control.metrics import (
    RUN_KEY,
    InstanceReport,
    aggregate,
    parse_instance_metadata,
    scoped,
    sink_metadata,
    source_metadata,
    topology_metadata,
)
from stream_assets.control.registry import REGISTRY, TOPOLOGY_TAG, TopologyRegistration
from stream_assets.jobs.instance_job import INSTANCE_JOB
from stream_assets.jobs.supervisor import serving_runs
from stream_assets.plan.topology import Topology
from stream_assets.settings import MetricsSettings, SupervisorSettings

#: Runs whose observations count: any that has not finished (a CANCELING one
#: still finishes its batch).
LIVE = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]

#: At most this many recent topology observations are read per tick: far more
#: than instances x (stale_s / metrics interval).
OBSERVATIONS_LIMIT = 1000

#: What the sensor records: the topology's materialization, the topics' observations.
MetricsEvent = dg.AssetMaterialization | dg.AssetObservation


def live_runs(instance: dg.DagsterInstance, job_id: str) -> list[dg.DagsterRun]:
    """The unfinished instance runs of ``job_id``."""
    return list(
        instance.get_runs(
            filters=dg.RunsFilter(job_name=INSTANCE_JOB, tags={TOPOLOGY_TAG: job_id}, statuses=LIVE)
        )
    )


def latest_reports(
    instance: dg.DagsterInstance, job_id: str, run_ids: set[str], since_ts: float
) -> tuple[list[InstanceReport], int]:
    """The newest report of each run in ``run_ids`` observed after ``since_ts``, and the
    storage id of the newest of them (0 if none).

    Example::

        >>> inst = dg.DagsterInstance.ephemeral()
        >>> latest_reports(inst, "wordcount", {"run-a"}, since_ts=0.0)
        ([], 0)
    """
    if not run_ids:
        return [], 0
    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=topology_asset_key(job_id), after_timestamp=since_ts),
        limit=OBSERVATIONS_LIMIT,
    ).records  # newest first
    reports: dict[str, InstanceReport] = {}
    newest = 0
    for record in records:
        observation = record.asset_observation
        if observation is None:
            continue
        # Instances observe runless, naming their run (RUN_KEY); older ones in their run.
        label = observation.metadata.get(RUN_KEY)
        run_id = str(getattr(label, "value", "")) if label is not None else record.run_id
        if run_id not in run_ids or run_id in reports:
            continue
        report = parse_instance_metadata(observation.metadata, run_id, record.timestamp)
        if report is not None:
            reports[run_id] = report
            newest = max(newest, record.storage_id)
    return sorted(reports.values(), key=lambda r: (r.index, r.run_id)), newest


def topic_users(topologies: Mapping[str, Topology]) -> dict[str, set[str]]:
    """For every source and sink topic, the job ids that read or write it.

    Example::

        >>> from stream_assets.examples import wordcount
        >>> users = topic_users({"a": wordcount.build(), "b": wordcount.build(job_id="b")})
        >>> sorted(users["sourceTopic"])
        ['a', 'b']
    """
    users: dict[str, set[str]] = {}
    for job_id, topology in topologies.items():
        for topic in (*topology.source_topics, *topology.sink_topics):
            users.setdefault(topic, set()).add(job_id)
    return users


def _desired_signature(state: DesiredState, running: int) -> str:
    generation = None if state.allocation is None else state.allocation.generation
    return json.dumps([state.target_instances, generation, state.phase, state.paused, running])


def topology_events(
    instance: dg.DagsterInstance,
    topology: Topology,
    state: DesiredState,
    users: Mapping[str, set[str]],
    now: float,
    settings: MetricsSettings,
    seen: Mapping[str, Any],
    supervisor: SupervisorSettings,
) -> tuple[list[MetricsEvent], dict[str, Any]]:
    """One topology's events this tick, and its cursor entry after them.

    ``seen`` is its cursor entry from the previous tick (``{}`` the first time).
    """
    job_id = topology.job_id
    runs = live_runs(instance, job_id)
    run_ids = {r.run_id for r in runs}
    reports, newest = latest_reports(instance, job_id, run_ids, now - settings.stale_s)
    # Serving, not merely unfinished: a queued, starting or killed run is no running
    # instance. Part of the signature: when the last instance dies, no report is fresh.
    running = len(serving_runs(instance, runs, now, supervisor))
    signature = _desired_signature(state, running)
    fresh = newest > int(seen.get("seen", 0))
    if not fresh and signature == seen.get("desired"):
        return [], dict(seen)
    totals = aggregate(reports) if reports else None
    events: list[MetricsEvent] = [
        dg.AssetMaterialization(
            asset_key=topology_asset_key(job_id),
            metadata=topology_metadata(
                totals,
                desired_instances=state.target_instances,
                generation=None if state.allocation is None else state.allocation.generation,
                running_instances=running,
                phase=state.phase,
                paused=state.paused,
                instances=reports,
            ),
        )
    ]
    if totals is not None and fresh:

        def own(topic: str, metadata: dict[str, Any]) -> dict[str, Any]:
            return metadata if users.get(topic, set()) <= {job_id} else scoped(metadata, job_id)

        for topic in topology.sink_topics:
            events.append(
                dg.AssetObservation(
                    asset_key=topic_asset_key(topic),
                    metadata=own(topic, sink_metadata(job_id, totals)),
                )
            )
        for topic in topology.source_topics:
            events.append(
                dg.AssetObservation(
                    asset_key=topic_asset_key(topic),
                    metadata=own(topic, source_metadata(job_id, topic, totals)),
                )
            )
    return events, {"seen": max(newest, int(seen.get("seen", 0))), "desired": signature}


def build_metrics_sensor(
    registrations: Mapping[str, TopologyRegistration],
    name: str = "topology_metrics_sensor",
    settings: MetricsSettings | None = None,
) -> dg.SensorDefinition:
    """The metrics sensor over ``registrations`` (read at every tick: may grow later).

    Example::

        >>> build_metrics_sensor(REGISTRY).name
        'topology_metrics_sensor'
    """
    interval = (settings or MetricsSettings()).interval_s

    @dg.sensor(
        name=name,
        minimum_interval_seconds=interval,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Sums the running instances' numbers into topology totals: the topology "
        "asset's materialization (headline first), observations of its sink and source topics.",
    )
    def metrics_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        now = time.time()
        current = settings or MetricsSettings()
        supervisor = SupervisorSettings()  # once a tick: what "serving" means
        cursor: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}
        states = DesiredStateStore(context.instance).get_many(registrations)
        topologies = {name: reg.topology() for name, reg in registrations.items()}
        users = topic_users(topologies)
        events: list[MetricsEvent] = []
        for job_id, state in sorted(states.items()):
            found, cursor[job_id] = topology_events(
                context.instance,
                topologies[job_id],
                state,
                users,
                now,
                current,
                cursor.get(job_id, {}),
                supervisor,
            )
            events.extend(found)
        return dg.SensorResult(
            asset_events=events,
            cursor=json.dumps(cursor, sort_keys=True),
            skip_reason=None if events else "no new instance observations",
        )

    return metrics_sensor


#: The code location's metrics sensor (over every registered topology).
topology_metrics_sensor = build_metrics_sensor(REGISTRY)
