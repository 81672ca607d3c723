"""The scale job: move a topology to ``target_instances``, queues and state together.

Steps (each logged; the figures go to the run's output metadata):

1. Check the request (registered topology, target >= 1, broker reachable):
   a bad request fails here and changes nothing.
2. Compute the new allocation (RocketMQ's average allocation, or sticky,
   which moves fewer queues) and pause the supervisor for this topology.
3. Cancel only the instance runs whose queues change; each finishes its batch
   in flight (its final checkpoint) before it exits.
4. Restore every moved stateful queue's RocksDB from the state topic (latest
   snapshot + changelog tail), with progress.
5. Publish the new allocation (new generation) and resume the supervisor,
   which launches the new instances.
6. Verify that every instance of the new allocation runs and heartbeats, and
   that every queue is owned and advancing (or has nothing left to read).
"""

import time

import dagster as dg

from jobs.failures import failure, registered
from jobs.supervisor import instance_runs, run_index, serves
from resources.rocketmq import RocketMQResource
from resources.spark import SparkResource
from resources.state_store import RocksDBStateStoreResource
from stream_assets.control.allocation import (
    STRATEGIES,
    Allocation,
    allocate,
    changed_instances,
    moves,
    topology_queues,
)
from stream_assets.control.desired_state import DesiredState, DesiredStateStore, heartbeats
from stream_assets.control.restore import restore_queues
from stream_assets.control.topics import provision_topics
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.runtime.clients import admin_for, reader_for

SCALE_JOB = "scale_job"


class ScaleConfig(dg.Config):
    """Which topology, how many instances, and how long to wait for each step."""

    topology: str
    target_instances: int
    strategy: str = ""  # "average" | "sticky"; empty: the topology's registered default
    stop_timeout_s: float = 300.0
    start_timeout_s: float = 600.0


@dg.op
def scale(
    context: dg.OpExecutionContext,
    config: ScaleConfig,
    rocketmq: RocketMQResource,
    spark: SparkResource,
    state_store: RocksDBStateStoreResource,
) -> None:
    """Scale ``config.topology`` to ``config.target_instances`` instances."""
    reg = registered(config.topology)
    if config.target_instances < 1:
        raise failure(
            f"target_instances must be at least 1, got {config.target_instances}; to stop a "
            "topology cancel its instance runs. Nothing was changed."
        )
    strategy = config.strategy or reg.strategy
    if strategy not in STRATEGIES:
        raise failure(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    topology = reg.topology()
    settings = rocketmq.settings()
    engine = spark.engine_settings(state_dir=state_store.root())
    try:
        # One control-plane client for the whole op (checks, restores, verification).
        admin = admin_for(settings)
        admin.master_brokers()
        topics = provision_topics(admin, topology, engine, context.log.info)
    except (RocketMQError, ValueError) as exc:
        raise failure(f"cannot scale {config.topology}: {exc}. Nothing was changed.") from exc

    store = DesiredStateStore(context.instance)
    current = store.get(config.topology)
    old = current.allocation if current else None
    queues = topology_queues(topology, topics.source_queues, engine.shuffle_queues)
    new = allocate(queues, config.target_instances, strategy, previous=old)
    moved = moves(old, new)
    changed = changed_instances(old, new)
    context.log.info(
        f"{config.topology}: {old.instances if old else 0} -> {new.instances} instances "
        f"(generation {new.generation}, {strategy}); {len(moved)} queue moves; restarting "
        f"instances {sorted(changed)}"
    )
    store.set(config.topology, DesiredState(config.target_instances, old, paused=True))
    pause_start = time.time()
    stopped = _stop_changed(context, config, new)
    restored = restore_queues(
        topology,
        [(m.topic, m.queue_id) for m in moved if m.to_instance is not None],
        engine.resolved_state_dir(),
        admin,
        reader_for(settings, f"{topology.job_id}-scale-restore"),
        context.log.info,
    )
    store.set(config.topology, DesiredState(config.target_instances, new, paused=False))
    _verify(context, config, topology, new, queues, pause_start, admin, topics.broker_name)
    pause_s = time.time() - pause_start
    restore_keys = sum(r.result.keys for r in restored)
    restore_s = sum(r.result.seconds for r in restored)
    context.add_output_metadata(
        {
            "generation": new.generation,
            "instances_before": old.instances if old else 0,
            "instances_after": new.instances,
            "queues_moved": len(moved),
            "runs_stopped": len(stopped),
            "pause_s": round(pause_s, 2),
            "restored_queues": len(restored),
            "restored_keys": restore_keys,
            "restore_s": round(restore_s, 3),
            "restore_keys_per_s": round(restore_keys / restore_s, 1) if restore_s else 0.0,
            "moves": dg.MetadataValue.json(
                [
                    {
                        "topic": m.topic,
                        "queue": m.queue_id,
                        "from": m.from_instance,
                        "to": m.to_instance,
                    }
                    for m in moved
                ]
            ),
            "restores": dg.MetadataValue.json(
                [
                    {
                        "topic": r.state_topic,
                        "queue": r.queue_id,
                        "keys": r.result.keys,
                        "seq": r.result.seq,
                        "messages": r.result.messages_read,
                        "seconds": r.result.seconds,
                    }
                    for r in restored
                ]
            ),
            "allocation": dg.MetadataValue.json(new.to_dict()),
        }
    )


def _stop_changed(
    context: dg.OpExecutionContext, config: ScaleConfig, new: Allocation
) -> list[str]:
    """Cancel the instance runs whose assignment changes; wait for them to end."""
    to_stop = []
    for run in instance_runs(context.instance, config.topology):
        if not serves(run, new):
            to_stop.append(run.run_id)
            context.log.info(
                f"stopping instance {run_index(run)} (run {run.run_id}): its queues change"
            )
            if run.status != dg.DagsterRunStatus.CANCELING:
                context.instance.run_coordinator.cancel_run(run.run_id)
    deadline = time.monotonic() + config.stop_timeout_s
    for run_id in to_stop:
        while True:
            current = context.instance.get_run_by_id(run_id)
            if current is None or current.is_finished:
                break
            if time.monotonic() > deadline:
                # The process is gone or stuck: the generation fence in the
                # state store keeps it from committing for queues that moved.
                context.instance.report_run_canceled(current, "did not stop in time")
                context.log.warning(f"run {run_id} did not stop in time; marked canceled")
                break
            time.sleep(0.5)
    return to_stop


def _verify(
    context: dg.OpExecutionContext,
    config: ScaleConfig,
    topology: Topology,
    new: Allocation,
    queues: dict[str, list[int]],
    since: float,
    admin: RocketMQAdmin,
    broker_name: str,
) -> None:
    """Wait until every instance of ``new`` runs and heartbeats, and ``queues`` advance."""
    deadline = time.monotonic() + config.start_timeout_s
    while True:
        runs = instance_runs(context.instance, config.topology, [dg.DagsterRunStatus.STARTED])
        beats = heartbeats(context.instance, [r.run_id for r in runs]) if runs else {}
        ready = {
            run_index(r)
            for r in runs
            if r.run_id in beats and beats[r.run_id].ts >= since and serves(r, new)
        }
        if ready == set(range(new.instances)):
            break
        if time.monotonic() > deadline:
            raise failure(
                f"instances {sorted(set(range(new.instances)) - ready)} of {config.topology} "
                f"did not start within {config.start_timeout_s:.0f}s. The supervisor sensor "
                "launches them: is the dagster daemon running (`dagster dev` starts it)?"
            )
        time.sleep(1.0)
    owned = {(t, q) for t, qs in new.queues_by_topic().items() for q in qs}
    expected = {(t, q) for t, qs in queues.items() for q in qs}
    if owned != expected:
        raise failure(f"allocation leaves queues unowned: {sorted(expected - owned)}")
    _await_advancing(context, topology, sorted(expected), deadline, admin, broker_name)
    context.log.info(
        f"{config.topology}: all {new.instances} instances of generation {new.generation} "
        "are running, own every queue, and every queue is advancing or drained"
    )


def _await_advancing(
    context: dg.OpExecutionContext,
    topology: Topology,
    queues: list[tuple[str, int]],
    deadline: float,
    admin: RocketMQAdmin,
    broker_name: str,
) -> None:
    """Every queue's committed offset moves past where it was, or reaches the end."""
    mqs = [MessageQueue(t, broker_name, q) for t, q in queues]

    def committed(mq: MessageQueue) -> int:
        return admin.query_consumer_offset(topology.job_id, mq) or 0

    start = {mq: committed(mq) for mq in mqs}
    pending = set(mqs)
    while pending:
        for mq in list(pending):
            now = committed(mq)
            if now > start[mq] or now >= admin.max_offset(mq):
                pending.discard(mq)
        if not pending:
            return
        if time.monotonic() > deadline:
            stuck = sorted(f"{mq.topic}[{mq.queue_id}]" for mq in pending)
            raise failure(f"queues not advancing after the scale: {stuck}")
        time.sleep(1.0)


@dg.job(name=SCALE_JOB, description="Scale a topology in or out, moving queues and state.")
def scale_job() -> None:
    """Scale a registered topology."""
    scale()
