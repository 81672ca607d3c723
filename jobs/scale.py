"""The scale job: move a topology to ``target_instances``, queues and state together, in place.

Steps (each logged; the figures go to the run's output metadata):

1. Check the request (registered topology, target >= 0, broker reachable):
   a bad request fails here and changes nothing.
2. Compute the new allocation (RocketMQ's average allocation, or sticky,
   which moves fewer queues), a new generation.
3. **warm**: publish it in phase ``warm``. The supervisor launches the new
   instances of a scale-out; every instance of the new allocation gets ready
   while the old one keeps running (SparkSession up, the local stores of the
   queues it gains brought up to date from the state topic). Wait for all.
   If an instance cannot warm up, the old allocation is put back: nothing
   was handed over yet.
4. **release**: every instance whose share changes finishes its batch in
   flight and stops its queries; the others keep running. Wait for all.
5. **run**: every instance starts over its new share as the new generation;
   instances beyond the new count exit. Wait for all, then verify that every
   queue is owned and advancing (or has nothing left to read).

Instances keep their process and SparkSession throughout
(:mod:`stream_assets.control.rebalance`). The pause (no owner for some queue)
lasts from the first release to the last start, and is recorded as
``pause_s``. ``target_instances`` 0 stops the topology: every instance
finishes its batch and exits; state and offsets stay, and a later scale
resumes exactly.
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import dagster as dg

from stream_assets.control.allocation import (
    STRATEGIES,
    Allocation,
    allocate,
    changed_instances,
    moves,
    topology_queues,
)
from stream_assets.control.desired_state import (
    DesiredState,
    DesiredStateStore,
    Heartbeat,
    heartbeats,
)
from stream_assets.jobs.failures import acting_on, failure
from stream_assets.jobs.supervisor import failure_message, instance_runs, run_index
from stream_assets.plan.topology import Topology
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.resources.spark import SparkResource
from stream_assets.resources.state_store import RocksDBStateStoreResource
from stream_assets.rocketmq.acl import check_topology_credentials
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.rocketmq.provision import plan_topology_upgrade, provision_topics
from stream_assets.runtime.drive.clients import admin_for

SCALE_JOB = "scale_job"


class ScaleConfig(dg.Config):
    """Which topology, how many instances, and how long a step may go without progress.

    ``start_timeout_s`` bounds a phase's *silence*, not its length: any answer, any
    step begun by an instance it waits for (one still starting included) and any
    queue that advances starts it again. A machine too busy to start an instance
    in ten minutes then still finishes its scale; an instance that never comes up
    (a crash loop, a launch that fails) ends it.
    """

    topology: str
    target_instances: int
    strategy: str = ""  # "average" | "sticky"; empty: the topology's registered default
    stop_timeout_s: float = 300.0
    start_timeout_s: float = 600.0


@dataclass
class Patience:
    """A wait bounded by the time since its last progress, not by its length.

    Example::

        >>> patience = Patience(timeout_s=60.0)
        >>> patience.spent()
        False
        >>> patience.last -= 61.0; patience.spent()
        True
        >>> patience.progressed(); patience.spent()
        False
    """

    timeout_s: float
    last: float = field(default_factory=time.monotonic)

    def progressed(self) -> None:
        """Something moved: the wait starts over."""
        self.last = time.monotonic()

    def spent(self) -> bool:
        """Whether nothing moved for ``timeout_s``."""
        return time.monotonic() - self.last > self.timeout_s


@dg.op
def scale(
    context: dg.OpExecutionContext,
    config: ScaleConfig,
    rocketmq: RocketMQResource,
    spark: SparkResource,
    state_store: RocksDBStateStoreResource,
) -> None:
    """Scale ``config.topology`` to ``config.target_instances`` instances."""
    reg = acting_on(context, config.topology)
    if config.target_instances < 0:
        raise failure(
            f"target_instances must be 0 (stop) or more, got {config.target_instances}. "
            "Nothing was changed."
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
        # The topics the job runs under; a change its instances would refuse is refused here.
        upgrade = plan_topology_upgrade(admin, topology)
        upgrade.refuse_if_needed()
        topology = upgrade.topology
        check_topology_credentials(admin, topology, topology.job_id)
        topics = provision_topics(admin, topology, engine, context.log.info)
    except (RocketMQError, ValueError) as exc:
        raise failure(f"cannot scale {config.topology}: {exc}. Nothing was changed.") from exc

    store = DesiredStateStore(context.instance)
    current = store.get(config.topology)
    old = current.allocation if current else None
    if current is not None and current.paused:
        # A scale left mid-phase (its process died) is not refused: this one's new
        # generation takes every instance through the phases again.
        raise failure(
            f"{config.topology} is paused by a reset: wait for it to finish (or run a "
            "failed one again). Nothing was changed."
        )
    if config.target_instances == 0:
        _stop_all(context, config, store, old)
        return
    queues = topology_queues(topology, topics.source_queues, engine.shuffle_queues)
    new = allocate(queues, config.target_instances, strategy, previous=old)
    moved = moves(old, new)
    changed = changed_instances(old, new)
    live = {run_index(r) for r in instance_runs(context.instance, config.topology)}
    context.log.info(
        f"{config.topology}: {old.instances if old else 0} -> {new.instances} instances "
        f"(generation {new.generation}, {strategy}); {len(moved)} queue moves; instances "
        f"{sorted(changed)} change their share, in place"
    )
    began = time.time()
    if not live:
        # Nothing runs (first deployment, or after a stop): no handover to make.
        store.set(config.topology, DesiredState(config.target_instances, new))
        answers = _await_in_force(context, config, "start", new)
        pause_s = 0.0
    else:
        store.set(config.topology, DesiredState(config.target_instances, new, phase="warm"))
        warm = range(new.instances)
        try:
            _await(context, config, "warm", warm, new.generation)
        except dg.Failure:
            # Nothing was handed over yet: the old allocation simply goes on.
            if old is not None:
                store.set(config.topology, DesiredState(old.instances, old))
            raise
        warmed_s = time.time() - began
        store.set(config.topology, DesiredState(config.target_instances, new, phase="release"))
        everyone = sorted(live | set(range(new.instances)))
        try:
            released = _await(context, config, "release", everyone, new.generation)
        except dg.Failure as exc:
            # Going on is safe: a run that still holds queues it lost is fenced by the
            # new generation's first commit, and fails instead of writing twice.
            context.log.warning(f"{exc.description}; handing over anyway (fencing)")
            released = {}
        store.set(config.topology, DesiredState(config.target_instances, new, phase="run"))
        answers = _await_in_force(context, config, "run", new)
        _await_gone(context, config, range(new.instances), Patience(config.start_timeout_s))
        releases = [b.released_at for i, b in released.items() if i in changed and b.released_at]
        starts = [b.running_at for i, b in answers.items() if i in changed and b.running_at]
        pause_s = max(starts) - min(releases) if releases and starts else 0.0
        context.log.info(
            f"{config.topology}: warm-up {warmed_s:.1f}s; handover pause {pause_s:.2f}s "
            f"(first release to last start, instances {sorted(changed)})"
        )
    catching_up = _verify(context, config, topology, new, queues, answers, admin, topics.layouts)
    context.add_output_metadata(
        {
            "still_catching_up": dg.MetadataValue.json(catching_up),
            "generation": new.generation,
            "instances_before": old.instances if old else 0,
            "instances_after": new.instances,
            "queues_moved": len(moved),
            "instances_changed": len(changed),
            "pause_s": round(pause_s, 2),
            "scale_s": round(time.time() - began, 1),
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
            "allocation": dg.MetadataValue.json(new.to_dict()),
        }
    )


def _stop_all(
    context: dg.OpExecutionContext,
    config: ScaleConfig,
    store: DesiredStateStore,
    old: Allocation | None,
) -> None:
    """Scale to 0: every instance finishes its batch and exits; state and offsets stay."""
    store.set(config.topology, DesiredState(0, old))
    context.log.info(f"{config.topology}: stopping every instance (scale to 0)")
    _await_gone(context, config, range(0), Patience(config.stop_timeout_s))
    context.add_output_metadata({"instances_after": 0, "generation": old.generation if old else 0})


#: Seconds between the scale job's "still waiting for ..." lines in a phase.
PROGRESS_EVERY_S = 15.0

#: What each phase's answer means, for the job's log.
_DONE = {
    "warm": "warmed up",
    "release": "released its changed queues",
    "run": "runs the new allocation",
    "start": "runs",
}


def _await(
    context: dg.OpExecutionContext,
    config: ScaleConfig,
    phase: str,
    indexes: Iterable[int],
    generation: int,
) -> dict[int, Heartbeat]:
    """Wait until the live run of every instance in ``indexes`` answered ``phase``.

    Waits as long as there is progress (:class:`Patience`): an answer, or an
    instance it waits for that begins a step (a cold start's are many) or goes
    round its loop.

    Logs each answer as it comes, and every :data:`PROGRESS_EVERY_S` what each
    instance still waited for is doing (its heartbeat's step: "starting the
    query of stage 1 (for 45 s)"). Fails naming, per missing instance, what is
    known of it (no run yet, the run's status, its last heartbeat), which is
    the real cause to look at.
    """
    wanted = set(indexes)
    field = {"warm": "warmed", "release": "released", "run": "running", "start": "running"}[phase]
    began = time.monotonic()
    patience = Patience(config.start_timeout_s)
    said: set[int] = set()
    seen: dict[int, _Step] = {}  # the step each waited-for instance was last seen in
    next_report = began + PROGRESS_EVERY_S
    while True:
        runs = {
            run_index(r): r
            for r in instance_runs(context.instance, config.topology)
            if r.status != dg.DagsterRunStatus.CANCELING
        }
        beats = heartbeats(context.instance, [r.run_id for r in runs.values()]) if runs else {}
        done = {
            i: beats[r.run_id]
            for i, r in runs.items()
            if i in wanted and r.run_id in beats and getattr(beats[r.run_id], field) >= generation
        }
        for i in sorted(set(done) - said):
            context.log.info(
                f"phase {phase!r}: instance {i} {_DONE[phase]} ({len(done)}/{len(wanted)}, "
                f"{time.monotonic() - began:.0f}s)"
            )
        if set(done) - said or _moved_on(runs, beats, wanted - set(done), seen):
            patience.progressed()
        said |= set(done)
        if set(done) >= wanted:
            return done
        now = time.monotonic()
        if patience.spent():
            missing = "; ".join(_about(context, config, i) for i in sorted(wanted - set(done)))
            raise failure(
                f"{config.topology}: generation {generation} phase {phase!r} not reached: no "
                f"instance it waits for answered or moved on for {config.start_timeout_s:.0f}s "
                f"(start_timeout_s; {now - began:.0f}s in all): {missing}"
            )
        if now >= next_report:
            next_report = now + PROGRESS_EVERY_S
            waiting = "; ".join(_doing(i, runs.get(i), beats) for i in sorted(wanted - set(done)))
            context.log.info(
                f"phase {phase!r}: {len(done)}/{len(wanted)} instances after {now - began:.0f}s; "
                f"waiting for {waiting}"
            )
        time.sleep(0.1)


#: What of a heartbeat shows that its run got somewhere: a beat alone proves only that
#: its heartbeat thread runs (a run hung in one step beats too).
_Step = tuple[str, float, str, float]


def _moved_on(
    runs: dict[int, dg.DagsterRun],
    beats: dict[str, Heartbeat],
    waiting: set[int],
    seen: dict[int, _Step],
) -> bool:
    """Whether an instance in ``waiting`` began a step or went round its loop since ``seen``.

    A new run of an index counts too (its first beat). ``seen`` is updated in place.
    """
    moved = False
    for index, run in runs.items():
        beat = beats.get(run.run_id)
        if index not in waiting or beat is None:
            continue
        step = (run.run_id, beat.loop_at, beat.busy, beat.busy_since)
        if seen.get(index) != step:
            seen[index] = step
            moved = True
    return moved


def _await_in_force(
    context: dg.OpExecutionContext,
    config: ScaleConfig,
    phase: str,
    new: Allocation,
) -> dict[int, Heartbeat]:
    """:func:`_await` for the phase that put ``new`` in force: a failure says that it stands.

    From the ``run`` phase on there is no going back: the desired state holds
    the new allocation, the instances that answered run it, and the supervisor
    keeps relaunching the ones that did not. A failure here reports that, not
    a scale that did not happen.
    """
    try:
        return _await(context, config, phase, range(new.instances), new.generation)
    except dg.Failure as exc:
        raise failure(
            f"the new allocation of {new.instances} instances (generation {new.generation}) "
            "is in force: the instances that run it keep running, and the supervisor keeps "
            f"relaunching the others; nothing needs undoing. Not all answered: {exc.description}"
        ) from exc


def _doing(index: int, run: dg.DagsterRun | None, beats: dict[str, Heartbeat]) -> str:
    """``instance 2 (starting the query of stage 1 (for 45 s))``: one waited-for instance."""
    if run is None:
        return f"instance {index} (no run yet: the supervisor launches it)"
    beat = beats.get(run.run_id)
    if beat is None:
        return f"instance {index} (run {run.status.value}, starting: no heartbeat yet)"
    return f"instance {index} ({beat.activity() or 'between steps'})"


def _about(context: dg.OpExecutionContext, config: ScaleConfig, index: int) -> str:
    """What is known of instance ``index``: its live run and heartbeat, and its failed runs.

    A failure of the scale names this for every instance it waited on in
    vain: the real cause is there (a crash loop, a run that never started).
    """
    runs = instance_runs(context.instance, config.topology)
    live = next((r for r in runs if run_index(r) == index), None)
    ended = [
        r
        for r in instance_runs(
            context.instance,
            config.topology,
            [dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED],
        )
        if run_index(r) == index
    ]
    if live is not None:
        beat = heartbeats(context.instance, [live.run_id]).get(live.run_id)
        seen = f"last heartbeat {beat.age():.0f}s ago" if beat else "no heartbeat yet"
        about = f"instance {index}: run {live.run_id} {live.status.value}, {seen}"
    elif ended:
        about = f"instance {index}: no live run"
    else:
        return (
            f"instance {index}: no run yet (the supervisor sensor launches it: is the dagster "
            "daemon running?)"
        )
    if ended:
        last = ended[0]  # newest first
        cause = failure_message(context.instance, last.run_id) or last.status.value
        about += (
            f"; {len(ended)} earlier run(s) ended, the last ({last.run_id}) "
            f"{last.status.value}: {cause}"
        )
    return about


def _await_gone(
    context: dg.OpExecutionContext, config: ScaleConfig, keep: Iterable[int], patience: Patience
) -> None:
    """Wait until no run of an instance outside ``keep`` is left (they exit by themselves).

    Each run that exits is progress.
    """
    kept = set(keep)
    left: int | None = None
    while True:
        extra = [
            r for r in instance_runs(context.instance, config.topology) if run_index(r) not in kept
        ]
        if not extra:
            return
        if left is not None and len(extra) < left:
            patience.progressed()
        left = len(extra)
        if patience.spent():
            for run in extra:
                # Gone or stuck: the generation fence keeps it from committing.
                context.instance.run_coordinator.cancel_run(run.run_id)
            context.log.warning(
                f"runs {[r.run_id for r in extra]} did not exit within "
                f"{patience.timeout_s:.0f}s of the last one that did; cancelling them"
            )
            return
        time.sleep(0.2)


def _verify(
    context: dg.OpExecutionContext,
    config: ScaleConfig,
    topology: Topology,
    new: Allocation,
    queues: dict[str, list[int]],
    answers: dict[int, Heartbeat],
    admin: RocketMQAdmin,
    layouts: dict[str, TopicLayout],
) -> list[str]:
    """Every instance of ``new`` runs it, every queue is owned, and every queue advances.

    Returns the queues that did not advance (by owner) while no other did for
    ``start_timeout_s``: the
    allocation stands, they are still catching up (a slow first batch on a
    busy machine), which the job's outcome says rather than failing.
    """
    assert set(answers) == set(range(new.instances))
    owned = {(t, q) for t, qs in new.queues_by_topic().items() for q in qs}
    expected = {(t, q) for t, qs in queues.items() for q in qs}
    if owned != expected:
        raise failure(f"allocation leaves queues unowned: {sorted(expected - owned)}")
    patience = Patience(config.start_timeout_s)
    stuck = _await_advancing(context, config, topology, new, patience, admin, layouts)
    if stuck:
        context.log.warning(
            f"{config.topology}: the new allocation of {new.instances} instances (generation "
            f"{new.generation}) is in force and every instance runs it; queues still catching "
            f"up (none advanced for start_timeout_s): {'; '.join(stuck)}"
        )
    else:
        context.log.info(
            f"{config.topology}: all {new.instances} instances of generation {new.generation} "
            "are running, own every queue, and every queue is advancing or drained"
        )
    return stuck


def _await_advancing(
    context: dg.OpExecutionContext,
    config: ScaleConfig,
    topology: Topology,
    new: Allocation,
    patience: Patience,
    admin: RocketMQAdmin,
    layouts: dict[str, TopicLayout],
) -> list[str]:
    """Wait until every queue's committed offset moves past where it was, or reaches the end.

    Each queue that does is progress. Returns, per owner, the queues that had not
    when ``patience`` was spent (empty: all did).
    """
    owner = {
        layouts[t].queue(q): index
        for index, share in enumerate(new.assignment)
        for t, qs in share.items()
        for q in qs
    }
    mqs = list(owner)

    def committed(mq: MessageQueue) -> int:
        return admin.query_consumer_offset(topology.job_id, mq) or 0

    start = {mq: committed(mq) for mq in mqs}
    pending = set(mqs)
    while pending:
        for mq in list(pending):
            now = committed(mq)
            if now > start[mq] or now >= admin.max_offset(mq):
                pending.discard(mq)
                patience.progressed()
        if not pending:
            break
        if patience.spent():
            by_owner: dict[int, list[str]] = {}
            for mq in sorted(pending):
                by_owner.setdefault(owner[mq], []).append(
                    f"{mq.topic}[{mq.broker_name}:{mq.queue_id}]"
                )
            return [
                f"{queues} ({_about(context, config, i)})" for i, queues in sorted(by_owner.items())
            ]
        time.sleep(1.0)
    return []


# One op: a step subprocess (the default multiprocess executor) adds nothing but its
# start and exit, 10-30 s apiece on a busy host, to a scale's time.
@dg.job(
    name=SCALE_JOB,
    description="Scale a topology in or out, moving queues and state.",
    executor_def=dg.in_process_executor,
)
def scale_job() -> None:
    """Scale a registered topology."""
    scale()
