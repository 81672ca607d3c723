"""The instance job: one long-running Dagster run per compute instance of a topology.

The op starts an :class:`~stream_assets.runtime.spark.instance.Instance` on its
assignment (restoring state for queues it does not hold locally on the first
batch), then loops until it is told to stop: a thread of its own heartbeats into the
Dagster instance's storage (the supervisor's crash detector, jobs/instance_heart.py),
the loop reports its progress through it, observes its topology
asset with its own numbers every ``metrics_interval_s`` (the metrics sensor
turns them into topology totals), follows rebalances in place
(:mod:`stream_assets.control.rebalance`: warm up, release, take the new share
over, or exit when scaled away or stopped), and watches for cancellation. On
stop it lets the batch in flight finish, which is its final checkpoint, and
exits; a cancelled run ends CANCELED.

Termination needs care: Dagster turns run termination into SIGINT, and
PySpark's SparkContext installs its own SIGINT handler that cancels every Spark
job at once. The op therefore installs a handler that only sets a stop flag
once the SparkSession exists.
"""

import json
import signal
import threading
import time
import weakref
from typing import Any

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError

from stream_assets.control.desired_state import DesiredStateStore, heartbeats
from stream_assets.control.lineage import topology_asset_key
from stream_assets.control.metrics import (
    RUN_KEY,
    RateMeters,
    instance_key,
    instance_metadata,
    instance_numbers,
)
from stream_assets.control.rebalance import DRAIN, RebalanceFollower
from stream_assets.control.registry import (
    GENERATION_TAG,
    IDLE_TAG,
    INSTANCE_INDEX_TAG,
    TOPOLOGY_TAG,
    registration,
)
from stream_assets.jobs.instance_heart import Heart
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.resources.spark import SparkResource
from stream_assets.resources.state_store import RocksDBStateStoreResource
from stream_assets.runtime.drive.outage import TRANSIENT
from stream_assets.runtime.spark.instance import Instance
from stream_assets.settings import MetricsSettings

INSTANCE_JOB = "instance_job"


class InstanceConfig(dg.Config):
    """Which instance this run is: topology, generation, index and its queues."""

    topology: str
    generation: int = 0
    instance_index: int = 0
    assignment_json: str = "null"  # {"topic": [queue ids]}; null: every queue
    metrics_interval_s: float = 10.0
    heartbeat_interval_s: float = 2.0


def instance_run_config(
    topology: str, generation: int, index: int, assignment: dict[str, list[int]] | None
) -> dict[str, Any]:
    """Run config of the instance job for one instance."""
    return {
        "ops": {
            "run_instance": {
                "config": {
                    "topology": topology,
                    "generation": generation,
                    "instance_index": index,
                    "assignment_json": json.dumps(assignment, sort_keys=True),
                }
            }
        }
    }


def instance_run_tags(
    topology: str, generation: int, index: int, assignment: dict[str, list[int]]
) -> dict[str, str]:
    """Run tags the supervisor and the scale job find instance runs by (and idle ones marked)."""
    tags = {
        TOPOLOGY_TAG: topology,
        GENERATION_TAG: str(generation),
        INSTANCE_INDEX_TAG: str(index),
    }
    if not any(assignment.values()):
        tags[IDLE_TAG] = "true"
    return tags


@dg.op
def run_instance(
    context: dg.OpExecutionContext,
    config: InstanceConfig,
    rocketmq: RocketMQResource,
    spark: SparkResource,
    state_store: RocksDBStateStoreResource,
) -> None:
    """Run one compute instance until cancelled or superseded."""
    reg = registration(config.topology)
    topology = reg.topology()
    assignment: dict[str, list[int]] | None = json.loads(config.assignment_json)
    engine = spark.engine_settings(state_dir=state_store.root())
    heart = Heart(context, config)
    inst = Instance(
        topology,
        rocketmq=rocketmq.settings(),
        engine=engine,
        assignment=assignment,
        generation=config.generation,
        progress=context.log.info,
        busy=heart.busy,
        index=config.instance_index,
    )
    owned = (
        "every queue"
        if assignment is None
        else "; ".join(f"{t}: {q}" for t, q in sorted(assignment.items()))
    )
    context.log.info(
        f"instance {config.instance_index} of {config.topology} (generation "
        f"{config.generation}) owns {owned}"
    )
    if assignment is not None and not any(assignment.values()):
        context.log.warning(
            "this instance owns no queue: it stays idle (more instances than queues)"
        )
    stop = threading.Event()
    state = DesiredStateStore(context.instance).get(config.topology)
    # Launched for a generation whose rebalance is still under way (a scale-out):
    # warm up now, take the queues over when the scale job says "run".
    joining = (
        state is not None
        and state.phase != "run"
        and state.allocation is not None
        and state.allocation.generation == config.generation
    )
    inst.start(run_queries=not joining)
    follower = RebalanceFollower(
        inst,
        config.instance_index,
        config.generation - 1 if joining else config.generation,
        assignment,
        context.log.info,
    )
    heart.follower = follower
    heart.batch_at = inst.last_batch_at
    heart.start()
    try:
        _take_over_stop_signals(stop)
        rate_window_s = MetricsSettings().rate_window_s
        reason = _supervise(context, config, inst, heart, stop, rate_window_s)
        if reason == DRAIN:
            _drain(context, config, inst, heart)
        context.log.info(f"stopping ({reason}): finishing the batch in flight")
        with heart.busy("stopping: finishing the batch in flight"):
            inst.stop()
            inst.close()
    finally:
        heart.stop()
    context.log.info("instance stopped cleanly; state and offsets checkpointed")
    if reason.startswith(DISOWNED):
        raise dg.Failure(
            f"{reason}; stopped cleanly so that the supervisor's next run of instance "
            f"{config.instance_index} is the only one"
        )
    if reason == "cancelled":
        # Lets Dagster record the run as CANCELED rather than SUCCESS.
        raise DagsterExecutionInterruptedError("instance run cancelled")


#: The stop reason of a run Dagster ended from outside while its process ran.
DISOWNED = "disowned"

#: How long a draining instance waits for the shuffle topics to be consumed. What is
#: still unread then is not lost: it stays in the shuffle topics for the next start.
DRAIN_TIMEOUT_S = 600.0


def _drain(
    context: dg.OpExecutionContext, config: InstanceConfig, inst: Instance, heart: Heart
) -> None:
    """Stop reading the sources, then wait until every instance of the topology did so and
    the shuffle topics are consumed: what the running version sent is applied by it."""
    with heart.busy("draining: the sources are no longer read; consuming the shuffle topics"):
        inst.stop_sources()
        heart.draining = True
        heart.beat()
        left = inst.await_shuffles_consumed(
            DRAIN_TIMEOUT_S, lambda: _all_draining(context.instance, config.topology)
        )
    if left:
        context.log.warning(
            f"drain: {left} shuffle messages still unread after {DRAIN_TIMEOUT_S:.0f}s; they "
            "stay in the shuffle topics and the next start applies them"
        )
    else:
        context.log.info("drained: every shuffle topic of the topology is consumed")


def _all_draining(instance: dg.DagsterInstance, topology: str) -> bool:
    """Whether every started instance run of ``topology`` says it reads no source now."""
    runs = instance.get_runs(
        filters=dg.RunsFilter(
            job_name=INSTANCE_JOB,
            tags={TOPOLOGY_TAG: topology},
            statuses=[dg.DagsterRunStatus.STARTED],
        )
    )
    beats = heartbeats(instance, [r.run_id for r in runs])
    return all(r.run_id in beats and beats[r.run_id].draining for r in runs)


def _take_over_stop_signals(stop: threading.Event) -> None:
    def request_stop(signum: int, _frame: object) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)


#: Seconds between looks at the desired state while a rebalance is under way:
#: the pause of a handover is bounded by how soon each instance notices a phase.
REBALANCE_POLL_S = 0.2


def _supervise(
    context: dg.OpExecutionContext,
    config: InstanceConfig,
    inst: Instance,
    heart: Heart,
    stop: threading.Event,
    rate_window_s: float,
) -> str:
    """Heartbeat, report and follow rebalances until a reason to stop; return that reason.

    ``rate_window_s``: the least wall time a rate of this instance's counters spans.
    """
    assert heart.follower is not None
    follower = heart.follower
    desired = DesiredStateStore(context.instance)
    last_metrics = last_lag = 0.0
    tagged = config.generation
    while True:
        if stop.is_set():
            return "cancelled"
        run = context.instance.get_run_by_id(context.run_id)
        if run is not None and run.status == dg.DagsterRunStatus.CANCELING:
            return "cancelled"
        if run is not None and run.is_finished:
            # Ended from outside while this process runs (a launch Dagster retried after
            # its worker had started, marked failed): the supervisor launches no other
            # run of this index while this one lives, so it leaves, and the status
            # Dagster wrote becomes true.
            return f"{DISOWNED}: Dagster marked this run {run.status.value} while it ran"
        heart.looped()
        inst.check_failed()
        inst.commit_waiting()
        state = desired.get(config.topology)
        reason = follower.step(state)
        if reason is not None:
            return reason
        if follower.generation > tagged:
            # The run's tag says which generation it serves, in the Runs list too.
            context.instance.add_run_tags(
                context.run_id, {GENERATION_TAG: str(follower.generation)}
            )
            tagged = follower.generation
        now = time.monotonic()
        if now - last_lag >= config.heartbeat_interval_s:
            last_lag = now
            _look_at_brokers(context, inst, heart)
            try:
                heart.lag = inst.lag_by_queue()
            except TRANSIENT as exc:
                # The stage queries ride out the outage on their own.
                if not heart.waiting:
                    context.log.warning(f"lag unknown, the broker is unavailable: {exc}")
                heart.lag = None
        if heart.progressed():
            heart.beat()
        if heart.lag is not None and now - last_metrics >= config.metrics_interval_s:
            _observe(context, config, inst, heart.lag, rate_window_s, inst.metrics_url)
            last_metrics = now
        rebalancing = state is not None and state.phase != "run"
        stop.wait(REBALANCE_POLL_S if rebalancing else config.heartbeat_interval_s / 4)


def _look_at_brokers(context: dg.OpExecutionContext, inst: Instance, heart: Heart) -> None:
    """Say in the log and the heartbeat which broker groups the instance waits for.

    The instance does not fail for an outage: its steps wait, with no output,
    until the group has a master again; this is how an operator learns why.
    """
    outages = inst.broker_outages()
    heart.waiting = outages.down
    for group, since in outages.went_down.items():
        context.log.warning(
            f"waiting for broker group {group}: no master answers (since "
            f"{time.strftime('%H:%M:%S', time.localtime(since))}); the steps that need it wait "
            f"and resume when it is back ({inst.outage_policy.describe_budget()}; "
            f"`{inst.rocketmq.status_command}`)"
        )
    for group, down_s in outages.came_back.items():
        context.log.info(f"broker group {group} answers again, after {down_s:.0f} s")


#: Each running Instance's rate history. Kept beside the Instance rather than in
#: the supervise loop's locals, so a rate spans calls; weak keys drop it with the Instance.
_RATES: weakref.WeakKeyDictionary[Instance, RateMeters] = weakref.WeakKeyDictionary()


def _observe(
    context: dg.OpExecutionContext,
    config: InstanceConfig,
    inst: Instance,
    lag: dict[str, dict[int, int]],
    rate_window_s: float,
    metrics_url: str | None = None,
) -> None:
    """Observe the topology asset with this instance's own numbers, keyed by its index.

    Only the topology asset, and only under keys named for this instance
    (``instance_<i>.records_per_s``, ``instance_<i>.lag``, ...; ``instance`` and
    ``generation`` say who wrote them): when every instance wrote the same keys
    on the sink asset, the UI drew one series jumping between instances. The
    metrics sensor (jobs/metrics.py) sums these into the topology, sink and
    source totals. Rates are of cumulative counters over at least
    ``rate_window_s`` (``STREAM_ASSETS_METRICS_RATE_WINDOW_S``) of wall time between two samples,
    so an interval in which no batch ended does not read 0
    (stream_assets/control/metrics.py). ``metrics_url``, the instance's Prometheus
    endpoint, goes with them as ``instance_<i>.metrics_url``.
    """
    meters = _RATES.get(inst)
    if meters is None:
        meters = _RATES[inst] = RateMeters(rate_window_s)
    numbers = instance_numbers(
        inst.topology,
        {i: dict(m.totals) for i, m in inst.metrics.items()},
        inst.state_size(),
        lag,
    )
    rates = meters.add(time.monotonic(), numbers.counters())
    # inst.generation, not the run's config: a rebalance in place moves it.
    metadata = instance_metadata(config.instance_index, inst.generation, numbers, rates)
    if metrics_url is not None:
        metadata[instance_key(config.instance_index, "metrics_url")] = dg.MetadataValue.url(
            metrics_url
        )
    # Runless, labelled with the run: in the run's log an observation every 10 s
    # buried its rare INFO lines; on the asset they are plotted as before.
    metadata[RUN_KEY] = dg.MetadataValue.text(context.run_id)
    context.instance.report_runless_asset_event(
        dg.AssetObservation(asset_key=topology_asset_key(inst.topology.job_id), metadata=metadata)
    )


@dg.job(
    name=INSTANCE_JOB,
    executor_def=dg.in_process_executor,
    description="One long-running compute instance of a topology (launched by the supervisor).",
)
def instance_job() -> None:
    """A compute instance of a registered topology."""
    run_instance()
