"""The reset job: recompute a topology from its first offsets or from a time.

Launch it from the Launchpad with, e.g.::

    ops:
      reset:
        config: {topology: wordcount, to_time: "2025-11-21T14:30:00Z"}

``to_time`` is ISO 8601 with a UTC offset or epoch milliseconds, compared with
the broker's store time of each message; empty means the earliest offsets.
``dry_run: true`` only logs the plan.

Steps (each logged):

1. Plan (:func:`~stream_assets.control.reset.plan_reset`) and log it: per
   topic and queue, the committed offset now and after; the state queues that
   get an empty snapshot; the local stores that are wiped.
2. Pause supervision of the topology, then look for its unfinished runs
   (:mod:`~stream_assets.control.reset_guard`). If any run, refuse naming them
   and put supervision back, unless ``stop_instances: true``: then cancel
   them, wait until each has finished its batch, and plan again.
3. Apply (:func:`~stream_assets.control.reset.apply_reset`), which refuses
   first if anything moved since the plan. Then resume supervision: the
   supervisor relaunches the instances, which recompute from the reset point.
   A failure after changes began leaves supervision paused; run the job again.
"""

import time
from pathlib import Path

import dagster as dg

from stream_assets.control.reset import (
    ResetPlan,
    ResetRefusedError,
    ResetTarget,
    apply_reset,
    parse_reset_time,
    plan_reset,
)
from stream_assets.control.reset_guard import (
    WRITING_JOBS,
    ActiveRun,
    SupervisionPause,
    active_runs,
    refusal_message,
)
from stream_assets.jobs.failures import acting_on, failure
from stream_assets.plan.topology import Topology
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.resources.state_store import RocksDBStateStoreResource
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.state.errors import StateError

RESET_JOB = "reset_job"
assert RESET_JOB in WRITING_JOBS  # the guard finds a reset run of a topology by this name

_HOW_TO_STOP = (
    "run this job with stop_instances: true, which pauses supervision and stops them, each "
    "after its batch in flight"
)


class ResetConfig(dg.Config):
    """Which topology, to when, and whether to only show the plan."""

    topology: str
    to_time: str = ""  # ISO 8601 with a UTC offset, or epoch ms; empty: the earliest offsets
    dry_run: bool = False  # only log the plan
    stop_instances: bool = False  # stop running instances first instead of refusing
    stop_timeout_s: float = 300.0


@dg.op
def reset(
    context: dg.OpExecutionContext,
    config: ResetConfig,
    rocketmq: RocketMQResource,
    state_store: RocksDBStateStoreResource,
) -> None:
    """Reset ``config.topology`` to ``config.to_time``: offsets, state topics, local stores."""
    reg = acting_on(context, config.topology)
    try:
        target = parse_reset_time(config.to_time)
    except ValueError as exc:
        raise failure(f"{exc}. Nothing was changed.") from exc
    topology = reg.topology()
    root = state_store.root()
    with RocketMQAdmin(rocketmq.settings()) as admin:
        reader = QueueReader(admin, f"{topology.job_id}-reset")
        try:
            made = _plan(context, topology, target, admin, reader, root)
            if config.dry_run:
                runs = active_runs(context.instance, config.topology, context.run_id)
                if runs:
                    context.log.warning(refusal_message(config.topology, runs, _HOW_TO_STOP))
                context.log.info("dry run: nothing was changed")
                return
            pause = SupervisionPause(context.instance, config.topology, context.log.info)
            pause.pause()
            # Looked for after pausing: a run the supervisor launched just before shows now.
            runs = active_runs(context.instance, config.topology, context.run_id)
            if runs and not config.stop_instances:
                pause.restore()
                raise failure(refusal_message(config.topology, runs, _HOW_TO_STOP))
            if runs:
                _stop(context, runs, config.stop_timeout_s, pause)
                context.log.info("planning again: the stopped instances committed their last batch")
                made = _plan(context, topology, target, admin, reader, root)
            try:
                result = apply_reset(made, admin, progress=context.log.info)
            except ResetRefusedError as exc:
                pause.restore()  # it changed nothing
                raise failure(str(exc)) from exc
            except (StateError, RocketMQError) as exc:
                raise failure(f"the reset failed part-way: {exc}. {pause.left_paused()}") from exc
            except Exception:
                context.log.error(pause.left_paused())
                raise
            pause.resume()
        finally:
            reader.close()
    context.log.info(result.describe())
    context.add_output_metadata(
        {
            "target": made.target_text,
            "offsets_committed": result.offsets_committed,
            "state_queues_emptied": len(result.snapshots),
            "local_stores_wiped": len(result.wiped),
            "runs_stopped": len(runs),
            "seconds": round(result.seconds, 2),
            "plan": dg.MetadataValue.md(f"```\n{made.describe()}\n```"),
        }
    )


def _plan(
    context: dg.OpExecutionContext,
    topology: Topology,
    target: ResetTarget,
    admin: RocketMQAdmin,
    reader: QueueReader,
    root: Path,
) -> ResetPlan:
    """Plan the reset and log the plan; a failure to read changes nothing."""
    try:
        made = plan_reset(
            topology, target, admin, reader, state_root=root, progress=context.log.info
        )
    except (RocketMQError, ValueError) as exc:
        raise failure(f"cannot plan the reset: {exc}. Nothing was changed.") from exc
    context.log.info(made.describe())
    return made


def _stop(
    context: dg.OpExecutionContext,
    runs: list[ActiveRun],
    timeout_s: float,
    pause: SupervisionPause,
) -> None:
    """Cancel ``runs`` and wait until each has finished (its batch in flight, then exit)."""
    for run in runs:
        context.log.info(f"stopping {run.describe()}")
        if run.status != dg.DagsterRunStatus.CANCELING.value:
            context.instance.run_coordinator.cancel_run(run.run_id)
    deadline = time.monotonic() + timeout_s
    for run in runs:
        while True:
            current = context.instance.get_run_by_id(run.run_id)
            if current is None or current.is_finished:
                break
            if time.monotonic() > deadline:
                pause.restore()
                raise failure(
                    f"{run.describe()} did not stop within {timeout_s:.0f}s, so the reset was "
                    "not made (it must not run under a live instance); supervision is as before. "
                    "Nothing was changed."
                )
            time.sleep(0.5)


@dg.job(
    name=RESET_JOB,
    description="Reset a topology to its first offsets or to a time; results are recomputed.",
)
def reset_job() -> None:
    """Reset a registered topology."""
    reset()
