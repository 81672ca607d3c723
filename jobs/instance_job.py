"""The instance job: one long-running Dagster run per compute instance of a topology.

The op starts an :class:`~stream_assets.runtime.instance.Instance` on its
assignment (restoring state for queues it does not hold locally on the first
batch), then loops until it is told to stop: it heartbeats into the Dagster
instance's storage (the supervisor's crash detector), logs asset observations
with numeric metadata for the topology's sink topics every
``metrics_interval_s``, and watches for cancellation and for being superseded
by a newer allocation (fencing). On stop it lets the batch in flight finish,
which is its final checkpoint, and exits; a cancelled run ends CANCELED.

Termination needs care: Dagster turns run termination into SIGINT, and
PySpark's SparkContext installs its own SIGINT handler that cancels every Spark
job at once. The op therefore installs a handler that only sets a stop flag
once the SparkSession exists.
"""

import json
import signal
import threading
import time
from typing import Any

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError

from resources.rocketmq import RocketMQResource
from resources.spark import SparkResource
from resources.state_store import RocksDBStateStoreResource
from stream_assets.control.desired_state import DesiredStateStore, record_heartbeat
from stream_assets.control.lineage import topic_asset_key
from stream_assets.control.registry import (
    GENERATION_TAG,
    IDLE_TAG,
    INSTANCE_INDEX_TAG,
    TOPOLOGY_TAG,
    registration,
)
from stream_assets.runtime.instance import Instance
from stream_assets.runtime.outage import TRANSIENT

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
    inst = Instance(
        topology,
        rocketmq=rocketmq.settings(),
        engine=engine,
        assignment=assignment,
        generation=config.generation,
        progress=context.log.info,
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
    inst.start()
    _take_over_stop_signals(stop)
    reason = _supervise(context, config, inst, assignment, stop)
    context.log.info(f"stopping ({reason}): finishing the batch in flight")
    inst.stop()
    inst.close()
    context.log.info("instance stopped cleanly; state and offsets checkpointed")
    if reason == "cancelled":
        # Lets Dagster record the run as CANCELED rather than SUCCESS.
        raise DagsterExecutionInterruptedError("instance run cancelled")


def _take_over_stop_signals(stop: threading.Event) -> None:
    def request_stop(signum: int, _frame: object) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)


def _supervise(
    context: dg.OpExecutionContext,
    config: InstanceConfig,
    inst: Instance,
    assignment: dict[str, list[int]] | None,
    stop: threading.Event,
) -> str:
    """Heartbeat and report until a reason to stop; return that reason."""
    desired = DesiredStateStore(context.instance)
    last_metrics = 0.0
    last_totals: dict[int, dict[str, float]] = {}
    while True:
        if stop.is_set():
            return "cancelled"
        run = context.instance.get_run_by_id(context.run_id)
        if run is not None and run.status == dg.DagsterRunStatus.CANCELING:
            return "cancelled"
        inst.check_failed()
        state = desired.get(config.topology)
        if (
            state is not None
            and state.allocation is not None
            and not state.paused
            and assignment is not None
            and not state.allocation.assigns(config.instance_index, assignment)
        ):
            return f"superseded by generation {state.allocation.generation}"
        lag: dict[str, dict[int, int]] | None
        try:
            lag = inst.lag_by_queue()
        except TRANSIENT as exc:
            # Keep beating: the stage queries ride out the outage on their own.
            context.log.warning(f"lag unknown, the broker is unavailable: {exc}")
            lag = None
        record_heartbeat(
            context.instance,
            config.topology,
            config.generation,
            config.instance_index,
            context.run_id,
            lag={t: sum(q.values()) for t, q in (lag or {}).items()},
        )
        now = time.monotonic()
        if lag is not None and now - last_metrics >= config.metrics_interval_s:
            _observe(context, inst, lag, last_totals, now - last_metrics if last_metrics else 0.0)
            last_totals = {i: dict(m.totals) for i, m in inst.metrics.items()}
            last_metrics = now
        stop.wait(config.heartbeat_interval_s)


def _observe(
    context: dg.OpExecutionContext,
    inst: Instance,
    lag: dict[str, dict[int, int]],
    previous: dict[int, dict[str, float]],
    elapsed_s: float,
) -> None:
    """One AssetObservation per sink topic, with numbers the UI can plot."""
    stages = inst.topology.stages
    first, last = inst.metrics[0].totals, inst.metrics[stages[-1].index].totals
    prev_in = previous.get(0, {}).get("records_in", 0.0)
    rate = (first.get("records_in", 0.0) - prev_in) / elapsed_s if elapsed_s else 0.0
    keys, size = inst.state_size()
    metadata: dict[str, Any] = {
        "records_in": int(first.get("records_in", 0)),
        "records_out": int(last.get("outputs", 0)),
        "records_per_s": round(rate, 1),
        "lag": sum(sum(q.values()) for q in lag.values()),
        "dead_letters": int(sum(m.totals.get("dead_letters", 0) for m in inst.metrics.values())),
        "late": int(last.get("late", 0)),
        "state_keys": keys,
        "state_bytes": size,
        "lag_per_queue": dg.MetadataValue.json(
            {t: {str(q): v for q, v in qs.items()} for t, qs in lag.items()}
        ),
    }
    for topic in inst.topology.sink_topics:
        context.log_event(dg.AssetObservation(asset_key=topic_asset_key(topic), metadata=metadata))


@dg.job(
    name=INSTANCE_JOB,
    executor_def=dg.in_process_executor,
    description="One long-running compute instance of a topology (launched by the supervisor).",
)
def instance_job() -> None:
    """A compute instance of a registered topology."""
    run_instance()
