"""Stop and start a topology from the Dagster UI, keeping its offsets and state.

**stop_topology_job** (``{"ops": {"stop_topology": {"config": {"topology": "wordcount"}}}}``)
sets the topology's desired instance count to 0. The supervisor then launches
nothing for it, and every instance run sees it: each finishes its batch in
flight (its final checkpoint: offsets and state committed together) and ends
SUCCESS. With ``drain: true`` each instance first stops reading the sources and
exits only once every instance did and every shuffle topic is consumed, so
nothing the running version sent waits for the next one (before an upgrade that
drops an operator's state: docs/operating.md, "Upgrading a topology"). Runs
still queued are marked CANCELED (they never ran); a run that has
not exited after ``stop_timeout_s`` is cancelled. The job returns once no
instance run of the topology is left. Consumer
offsets, state topics and local stores are untouched, and the allocation is
kept, so a later start resumes exactly where the stop left off.

**start_topology_job** (``{"ops": {"start_topology": {"config": {"topology":
"wordcount"}}}}``) puts the instance count back: as many as before the stop
(``target_instances: 0``, the default; the registered ``default_instances`` for
a topology never deployed), or the count given. The same count reuses the kept
allocation, so every queue goes back to the instance index that had it; another
count allocates anew (nothing runs, so nothing has to move). The supervisor
launches the instances on its next tick; the job waits until each heartbeats
(``wait_s``, 0: do not wait).

Both refuse, changing nothing, while supervision is paused (a reset runs) or a
rebalance is under way (the scale job's ``warm``/``release`` phases).

Example (from Python, as the tests do)::

    >>> defs.get_job_def("stop_topology_job").execute_in_process(
    ...     run_config={"ops": {"stop_topology": {"config": {"topology": "wordcount"}}}},
    ...     instance=instance)  # doctest: +SKIP
"""

import time
from collections.abc import Callable
from typing import Protocol

import dagster as dg

from stream_assets.control.allocation import Allocation, allocate, topology_queues
from stream_assets.control.desired_state import DesiredState, DesiredStateStore, heartbeats
from stream_assets.control.liveness import process_alive
from stream_assets.jobs.failures import acting_on, failure, registered
from stream_assets.jobs.supervisor import instance_runs, run_index, run_process
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.resources.spark import SparkResource
from stream_assets.resources.state_store import RocksDBStateStoreResource
from stream_assets.rocketmq.acl import check_topology_credentials
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.rocketmq.provision import plan_topology_upgrade, provision_topics
from stream_assets.settings import EngineSettings, RocketMQSettings

STOP_JOB = "stop_topology_job"
START_JOB = "start_topology_job"


class StopConfig(dg.Config):
    """Which topology to stop, and how long its instances may take to finish their batch."""

    topology: str
    stop_timeout_s: float = 300.0
    #: Stop reading the sources first and exit once every shuffle topic is consumed, so
    #: nothing the running version sent is left for the next (before an upgrade).
    drain: bool = False


class StartConfig(dg.Config):
    """Which topology to start, with how many instances, and how long to wait for them."""

    topology: str
    target_instances: int = 0  # 0: as many as before the stop (or the registered default)
    wait_s: float = 600.0  # wait until every instance heartbeats; 0: return at once


def _refuse_if_busy(name: str, state: DesiredState | None, what: str) -> None:
    if state is None:
        return
    if state.paused:
        raise failure(
            f"cannot {what} {name}: its supervision is paused, so a reset_job is changing it (or "
            "one failed part-way: run it again to complete it). Try again when it is done. "
            "Nothing was changed."
        )
    if state.phase != "run":
        raise failure(
            f"cannot {what} {name}: a rebalance is under way (phase {state.phase!r}); wait for "
            "the scale_job run to finish, then try again. Nothing was changed."
        )


class Log(Protocol):
    """Where stop and start say what they do: an op's ``context.log``, or the CLI's stderr."""

    def info(self, msg: str) -> None: ...

    def warning(self, msg: str) -> None: ...


class PrintLog:
    """A :class:`Log` that hands each line to ``say`` (the CLI's stderr, a deployment's progress).

    Example::

        >>> PrintLog(print).warning("slow")
        warning: slow
    """

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say

    def info(self, msg: str) -> None:
        """Say ``msg``."""
        self.say(msg)

    def warning(self, msg: str) -> None:
        """Say ``msg`` as a warning."""
        self.say(f"warning: {msg}")


@dg.op
def stop_topology(context: dg.OpExecutionContext, config: StopConfig) -> None:
    """Stop ``config.topology``: desired count 0, every instance finishes its batch and exits."""
    acting_on(context, config.topology)
    before, stopped = stop(
        context.instance, config.topology, config.stop_timeout_s, config.drain, context.log
    )
    context.add_output_metadata({"instances_before": before, "runs_stopped": len(stopped)})


def stop(
    instance: dg.DagsterInstance, name: str, timeout_s: float, drain: bool, log: Log
) -> tuple[int, list[str]]:
    """Stop ``name`` in ``instance``'s storage; (instances before, the runs waited for).

    What stop_topology_job does, callable without the job (``stream-assets stop``):
    it needs the Dagster instance's storage, not its daemon or code server.

    Example::

        >>> stop(DagsterInstance.get(), "wordcount", 300.0, False, log)  # doctest: +SKIP
        (2, ['8f0c...', '1b2e...'])
    """
    registered(name)  # an unknown name fails here, changing nothing
    store = DesiredStateStore(instance)
    current = store.get(name)
    _refuse_if_busy(name, current, "stop")
    before = current.target_instances if current else 0
    allocation = current.allocation if current else None
    # Written first: from here on the supervisor launches nothing for the topology,
    # so the runs cancelled below stay stopped.
    store.set(name, DesiredState(0, allocation, drain=drain))
    kept = (
        f"; allocation of generation {allocation.generation} ({allocation.instances} "
        "instances) kept for the start"
        if allocation is not None
        else ""
    )
    draining = (
        ": draining first (sources no longer read; each instance exits once every shuffle "
        "topic is consumed)"
        if drain
        else ""
    )
    log.info(f"{name}: desired instances {before} -> 0 (stopped){kept}{draining}")
    stopped = _stop_runs(instance, name, timeout_s, log)
    log.info(
        f"{name} is stopped: no instance runs; offsets and state are where the last batch "
        "committed them. start_topology_job (or stream-assets start) resumes it."
    )
    return before, stopped


def _stop_runs(instance: dg.DagsterInstance, name: str, timeout_s: float, log: Log) -> list[str]:
    """Wait until every instance run of ``name`` has ended; the run ids waited for.

    Every run that runs sees the desired count 0, finishes its batch in flight
    and ends SUCCESS ("stopping (the topology was stopped)"): one way for all,
    whichever moment of its loop the stop found it in. Only runs that never
    started (queued) are marked CANCELED, and runs still there after
    ``timeout_s`` are cancelled, which ends them CANCELED. Listed again until
    none is left: a supervisor tick that began before the desired state
    changed may still launch one run.
    """
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    cancelled = False
    while True:
        runs = instance_runs(instance, name)
        if not runs:
            return seen
        for run in runs:
            if run.run_id not in seen:
                seen.append(run.run_id)
                log.info(
                    f"stopping instance {run_index(run)} (run {run.run_id}, {run.status.value}): "
                    "it finishes its batch in flight, then exits"
                )
            _settle_unstarted(instance, run)
        if time.monotonic() > deadline and not cancelled:
            # A run stuck in a step does not look at the desired state: cancel it
            # (SIGINT: it still finishes its batch if it can), then give it as long again.
            cancelled = True
            for run in runs:
                log.warning(
                    f"instance {run_index(run)} (run {run.run_id}) did not exit within "
                    f"{timeout_s:.0f}s: cancelling it"
                )
                _cancel(instance, run, log)
            deadline = time.monotonic() + timeout_s
        elif time.monotonic() > deadline:
            left = ", ".join(f"{r.run_id} ({r.status.value})" for r in runs)
            raise failure(
                f"{name} is stopped (desired instances 0: the supervisor launches nothing), but "
                f"these instance runs did not end within {2 * timeout_s:.0f}s, even cancelled: "
                f"{left}. Look at their logs; run this job again to keep waiting, or terminate "
                "them from the Runs page."
            )
        time.sleep(0.5)


def _cancel(instance: dg.DagsterInstance, run: dg.DagsterRun, log: Log) -> None:
    """Ask a run to stop: it finishes its batch in flight, then ends CANCELED."""
    if run.status in (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED):
        return  # no process yet: _settle_unstarted marks it canceled
    if run.status == dg.DagsterRunStatus.CANCELING:
        return
    try:
        instance.run_coordinator.cancel_run(run.run_id)
    except Exception as exc:
        # A launcher that cannot terminate: the instance still sees the desired count 0
        # and exits after its batch by itself.
        log.warning(
            f"could not cancel run {run.run_id} ({type(exc).__name__}: {exc}); it exits by "
            "itself once it sees the topology stopped"
        )


def _settle_unstarted(instance: dg.DagsterInstance, run: dg.DagsterRun) -> None:
    """Mark canceled a run that has no process to end it (never started, or cancelled and gone)."""
    current = instance.get_run_by_id(run.run_id)
    if current is None or current.is_finished:
        return
    if current.status in (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED):
        # Not launched yet: no run worker would report a cancellation (and Dagster does
        # not start a run that is already canceled).
        instance.report_run_canceled(current, "stopped before it started (stop_topology_job)")
        return
    if current.status != dg.DagsterRunStatus.CANCELING:
        return
    beat = heartbeats(instance, [current.run_id]).get(current.run_id)
    process = run_process(instance, current, beat)
    if process is not None and process.local and not process_alive(process.pid, process.seen_at):
        instance.report_run_canceled(
            current, f"stopped (stop_topology_job); its {process.describe()} is gone"
        )


@dg.op
def start_topology(
    context: dg.OpExecutionContext,
    config: StartConfig,
    rocketmq: RocketMQResource,
    spark: SparkResource,
    state_store: RocksDBStateStoreResource,
) -> None:
    """Start ``config.topology`` again (or deploy it): the supervisor launches its instances."""
    acting_on(context, config.topology)
    outcome = start(
        context.instance,
        config.topology,
        config.target_instances,
        rocketmq.settings(),
        spark.engine_settings(state_dir=state_store.root()),
        config.wait_s,
        context.log,
    )
    context.add_output_metadata(outcome)


def start(
    instance: dg.DagsterInstance,
    name: str,
    target_instances: int,
    rocketmq: RocketMQSettings,
    engine: EngineSettings,
    wait_s: float,
    log: Log,
) -> dict[str, int | bool]:
    """Start ``name`` in ``instance``'s storage with ``target_instances`` (0: as before).

    What start_topology_job does, callable without the job (``stream-assets start``).
    The supervisor launches the instances: with ``wait_s`` > 0 this waits until
    each heartbeats. Returns the job's output metadata.

    Example::

        >>> start(DagsterInstance.get(), "wordcount", 0, RocketMQSettings(),
        ...       EngineSettings(), 600.0, log)  # doctest: +SKIP
        {'instances': 2, 'generation': 3, 'started': True}
    """
    reg = registered(name)  # an unknown name fails here, changing nothing
    if target_instances < 0:
        raise failure(
            f"target_instances must be >= 0 (0: as before the stop), got "
            f"{target_instances}. Nothing was changed."
        )
    store = DesiredStateStore(instance)
    current = store.get(name)
    _refuse_if_busy(name, current, "start")
    if current is not None and current.target_instances > 0:
        log.info(
            f"{name} is not stopped: it runs {current.target_instances} instances. Nothing was "
            "changed (scale_job changes the count)."
        )
        return {"instances": current.target_instances, "started": False}
    old = current.allocation if current else None
    count = target_instances or (old.instances if old else reg.default_instances)
    topics = _upgraded_topics(name, rocketmq, log)
    same_topics = topics is None or (old is not None and set(old.assignment[0]) == topics)
    if old is not None and old.instances == count and same_topics:
        allocation = old
        log.info(
            f"{name}: resuming {count} instances on the kept allocation (generation "
            f"{old.generation}): every queue goes back to the index that had it"
        )
    else:
        allocation = _allocate(instance, name, count, old, rocketmq, engine, log)
    since = time.time()
    store.set(name, DesiredState(count, allocation))
    log.info(
        f"{name}: desired instances 0 -> {count}; the supervisor launches them on its next tick "
        "and they resume from the committed offsets and state"
    )
    if wait_s > 0:
        _await_heartbeats(instance, name, count, since, wait_s, log)
    return {"instances": count, "generation": allocation.generation, "started": True}


def _upgraded_topics(name: str, rocketmq: RocketMQSettings, log: Log) -> set[str] | None:
    """The topics the topology's group reads once started (its upgrade checked first:
    a change its instances would refuse is refused here, changing nothing); None when
    the broker cannot be asked now (the instances check at their start)."""
    try:
        with RocketMQAdmin(rocketmq) as admin:
            upgrade = plan_topology_upgrade(admin, registered(name).topology())
    except RocketMQError as exc:
        log.warning(
            f"{name}: the topology's record could not be read ({exc}); its instances compare "
            "it with their topology when they start"
        )
        return None
    except ValueError as exc:
        raise failure(f"cannot start {name}: {exc}. Nothing was changed.") from exc
    if not upgrade.first:
        log.info(upgrade.describe())
    try:
        upgrade.refuse_if_needed()
    except ValueError as exc:
        raise failure(f"{exc}. Nothing was changed.") from exc
    return {s.input_topic for s in upgrade.topology.stages}


def _allocate(
    instance: dg.DagsterInstance,
    name: str,
    count: int,
    old: Allocation | None,
    rocketmq: RocketMQSettings,
    engine: EngineSettings,
    log: Log,
) -> Allocation:
    """A new allocation of ``count`` instances (the topology is stopped: nothing moves live)."""
    left = instance_runs(instance, name)
    if left:
        raise failure(
            f"cannot start {name} with {count} instances while runs of it are still stopping "
            f"({', '.join(r.run_id for r in left)}); wait for them (stop_topology_job waits) "
            "and try again. Nothing was changed."
        )
    reg = registered(name)
    topology = reg.topology()
    try:
        with RocketMQAdmin(rocketmq) as admin:
            # The topics the job runs under (start refused a change already).
            topology = plan_topology_upgrade(admin, topology).topology
            check_topology_credentials(admin, topology, topology.job_id)
            topics = provision_topics(admin, topology, engine, log.info)
    except (RocketMQError, ValueError) as exc:
        raise failure(f"cannot start {name}: {exc}. Nothing was changed.") from exc
    queues = topology_queues(topology, topics.source_queues, engine.shuffle_queues)
    allocation = allocate(queues, count, reg.strategy, previous=old)
    log.info(
        f"{name}: new allocation of {count} instances (generation {allocation.generation}); "
        "each instance restores the state of queues it does not hold locally on its first batch"
    )
    return allocation


def _await_heartbeats(
    instance: dg.DagsterInstance, name: str, count: int, since: float, wait_s: float, log: Log
) -> None:
    """Wait until every index below ``count`` has a STARTED run that heartbeat after ``since``."""
    deadline = time.monotonic() + wait_s
    ready: set[int] = set()
    while True:
        runs = instance_runs(instance, name, [dg.DagsterRunStatus.STARTED])
        beats = heartbeats(instance, [r.run_id for r in runs]) if runs else {}
        ready = {run_index(r) for r in runs if r.run_id in beats and beats[r.run_id].ts >= since}
        if ready >= set(range(count)):
            log.info(f"{name}: all {count} instances run and heartbeat")
            return
        if time.monotonic() > deadline:
            missing = sorted(set(range(count)) - ready)
            raise failure(
                f"{name} is started (desired instances {count}), but instances {missing} did not "
                f"heartbeat within {wait_s:.0f}s. The supervisor_sensor launches them: is the "
                "dagster daemon running (`dagster dev` starts it) and the sensor on? Their runs' "
                "logs (and instance_failure_alerts) say why they fail."
            )
        time.sleep(1.0)


# One op each: a step subprocess (the default multiprocess executor) adds nothing but
# its start and exit, 10-30 s apiece on a busy host.
@dg.job(
    name=STOP_JOB,
    description="Stop a topology: no instance runs, offsets and state kept; start resumes it.",
    executor_def=dg.in_process_executor,
)
def stop_topology_job() -> None:
    """Stop a registered topology."""
    stop_topology()


@dg.job(
    name=START_JOB,
    description="Start a stopped topology again (or deploy it with its default instance count).",
    executor_def=dg.in_process_executor,
)
def start_topology_job() -> None:
    """Start a registered topology."""
    start_topology()
