"""What a reset checks in Dagster: no run of the topology, and no supervisor relaunching one.

A reset (:mod:`stream_assets.control.reset`) is only consistent while nothing
runs the topology: an instance would commit offsets and state over it. Under
Dagster two things can run it: a run of the topology (an instance run, tagged
``stream_assets/topology``; a scale or another reset, configured with it), and
the supervisor sensor, which launches instance runs whenever the desired state
has an allocation and is not paused. So a reset pauses supervision first (as
the scale job does), then looks for runs, refuses naming them, and on success
resumes supervision: the supervisor then relaunches the instances, which
recompute from the reset point. A reset that fails after it started changing
things leaves supervision paused, so no instance runs on a half-reset
topology; running the reset again completes it and resumes supervision.
:func:`run_reset_command` is the whole sequence for ``stream-assets reset``;
the reset job (jobs/reset.py) does the same with Dagster's logging.

Example::

    >>> pause = SupervisionPause(instance, "wordcount", print)  # doctest: +SKIP
    >>> pause.pause()  # doctest: +SKIP
    >>> runs = active_runs(instance, "wordcount")  # doctest: +SKIP
    >>> if runs:
    ...     pause.restore()
    ...     raise ResetRefusedError(refusal_message("wordcount", runs))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import dagster as dg

from stream_assets.control.desired_state import DesiredState, DesiredStateStore
from stream_assets.control.registry import GENERATION_TAG, INSTANCE_INDEX_TAG, TOPOLOGY_TAG
from stream_assets.control.reset import (
    ResetRefusedError,
    ResetTarget,
    apply_reset,
    plan_reset,
)
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.settings import RocketMQSettings
from stream_assets.state.errors import StateError

#: Jobs that write a topology's offsets or state and name it only in their op config
#: (jobs/scale.py, jobs/reset.py, jobs/upgrade.py); a state query names it too, but only reads.
WRITING_JOBS = ("scale_job", "reset_job", "upgrade_job")

#: Run statuses of a run that may still write (NOT_STARTED: created, about to be launched).
ACTIVE_STATUSES = (
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
)


@dataclass(frozen=True)
class ActiveRun:
    """A run that still runs (or is about to run) a topology."""

    run_id: str
    job_name: str
    status: str
    tags: dict[str, str]

    def describe(self) -> str:
        """``instance_job run 1f2e... (STARTED, instance 0, generation 3)``."""
        details = [self.status]
        if INSTANCE_INDEX_TAG in self.tags:
            details.append(f"instance {self.tags[INSTANCE_INDEX_TAG]}")
        if GENERATION_TAG in self.tags:
            details.append(f"generation {self.tags[GENERATION_TAG]}")
        return f"{self.job_name} run {self.run_id} ({', '.join(details)})"


def _configured_for(run_config: Any, topology: str) -> bool:
    """Whether an op of the run is configured with ``topology: <topology>``."""
    ops = run_config.get("ops", {}) if isinstance(run_config, dict) else {}
    for op in ops.values() if isinstance(ops, dict) else ():
        config = op.get("config", {}) if isinstance(op, dict) else {}
        if isinstance(config, dict) and config.get("topology") == topology:
            return True
    return False


def active_runs(
    instance: dg.DagsterInstance, topology: str, exclude_run_id: str | None = None
) -> list[ActiveRun]:
    """Unfinished runs of ``topology``: tagged with it, or with an op configured for it.

    The tag finds instance runs (and scheduled scale runs); the config finds a
    scale or reset run launched by hand (:data:`WRITING_JOBS`). ``exclude_run_id``:
    the caller's own run.

    Example::

        >>> active_runs(dg.DagsterInstance.ephemeral(), "wordcount")
        []
    """
    found: list[ActiveRun] = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=list(ACTIVE_STATUSES))):
        if run.run_id == exclude_run_id:
            continue
        configured = run.job_name in WRITING_JOBS and _configured_for(run.run_config, topology)
        if run.tags.get(TOPOLOGY_TAG) == topology or configured:
            found.append(ActiveRun(run.run_id, run.job_name, run.status.value, dict(run.tags)))
    return sorted(found, key=lambda r: (r.job_name, r.tags.get(INSTANCE_INDEX_TAG, ""), r.run_id))


def refusal_message(topology: str, runs: Sequence[ActiveRun], how_to_stop: str = "") -> str:
    """Why a reset of ``topology`` is refused, naming ``runs``, and what to do.

    >>> run = ActiveRun("r1", "instance_job", "STARTED", {INSTANCE_INDEX_TAG: "0"})
    >>> print(refusal_message("wordcount", [run]))  # doctest: +NORMALIZE_WHITESPACE
    refusing to reset wordcount: 1 run still runs it: instance_job run r1 (STARTED,
    instance 0). A reset under running instances would be overwritten by their next
    commits. Stop them first (cancel them in the Dagster UI; the supervisor leaves
    them stopped only while supervision is paused). Nothing was changed.
    """
    listed = "; ".join(r.describe() for r in runs)
    stop = how_to_stop or (
        "cancel them in the Dagster UI; the supervisor leaves them stopped only while "
        "supervision is paused"
    )
    return (
        f"refusing to reset {topology}: {len(runs)} run{'s' if len(runs) != 1 else ''} still "
        f"run{'' if len(runs) != 1 else 's'} it: {listed}. A reset under running instances "
        f"would be overwritten by their next commits. Stop them first ({stop}). "
        "Nothing was changed."
    )


class SupervisionPause:
    """Keeps the supervisor from launching instances of ``topology`` while a reset runs.

    :meth:`pause` marks the desired state paused (the scale job's mechanism,
    jobs/supervisor.py skips paused topologies); :meth:`restore` puts back
    exactly what was there (a refusal: nothing happened); :meth:`resume`
    unpauses after a reset that completed, so the supervisor relaunches the
    instances. A topology never deployed (no desired state) is left alone.

    Example::

        >>> pause = SupervisionPause(dg.DagsterInstance.ephemeral(), "wordcount")
        >>> pause.pause(), pause.before
        (None, None)
    """

    def __init__(
        self,
        instance: dg.DagsterInstance,
        topology: str,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.store = DesiredStateStore(instance)
        self.topology = topology
        self.say = progress or (lambda _line: None)
        self.before: DesiredState | None = None

    def pause(self) -> None:
        """Pause supervision of the topology (if it has a desired state)."""
        self.before = self.store.get(self.topology)
        if self.before is not None and not self.before.paused:
            self.store.set(self.topology, replace(self.before, paused=True))
            self.say(f"paused supervision of {self.topology}: no instance is launched meanwhile")

    def restore(self) -> None:
        """Put the desired state back as :meth:`pause` found it."""
        if self.before is not None:
            self.store.set(self.topology, self.before)

    def resume(self) -> None:
        """Unpause supervision: the supervisor relaunches the topology's instances."""
        current = self.store.get(self.topology)
        if current is not None and current.paused:
            self.store.set(self.topology, replace(current, paused=False))
            self.say(
                f"resumed supervision of {self.topology}: the supervisor sensor relaunches its "
                "instances, which recompute from the reset point"
            )

    def left_paused(self) -> str:
        """What to tell the operator when the reset failed after :meth:`pause`."""
        return after_failure(self.topology, paused=self.before is not None)


def after_failure(topology: str, paused: bool) -> str:
    """What to do after a reset of ``topology`` failed part-way.

    >>> print(after_failure("wordcount", paused=False))
    the reset of wordcount is incomplete: run it again (it is safe to repeat) before any ...
    """
    if not paused:
        return (
            f"the reset of {topology} is incomplete: run it again (it is safe to repeat) "
            "before any instance of it starts"
        )
    return (
        f"supervision of {topology} stays paused so that no instance runs on a half-reset "
        "topology; run the reset again (it is safe to repeat), which resumes supervision when "
        "it completes"
    )


#: How a command-line user stops a deployed topology's instances before a reset.
CLI_HOW_TO_STOP = (
    "launch the Dagster reset_job with stop_instances: true, which pauses supervision and "
    "stops them after their batch in flight, then resets"
)


def run_reset_command(
    topology: Topology,
    target: ResetTarget,
    *,
    apply: bool,
    settings: RocketMQSettings,
    state_root: Path | None,
    instance: dg.DagsterInstance | None,
    say: Callable[[str], None],
    show: Callable[[str], None] = print,
) -> int:
    """``stream-assets reset``: plan, show the plan, refuse or (with ``apply``) reset.

    ``instance``: the Dagster instance whose runs and supervisor are checked
    (None: no Dagster here; the checks of :func:`apply_reset` still run).
    ``show`` gets the plan, ``say`` progress and refusals. Returns the exit
    code: 0 done (or shown only), 3 refused (nothing changed), 1 failed
    part-way (run it again).

    Example::

        >>> run_reset_command(wordcount.build(), EARLIEST, apply=False, settings=settings,
        ...                   state_root=None, instance=None, say=print)  # doctest: +SKIP
        Reset of topology 'wordcount' (consumer group 'wordcount') to the earliest offsets:
        ...
        nothing was changed: run again with --yes to apply this plan
        0
    """
    name = topology.job_id
    with RocketMQAdmin(settings) as admin:
        reader = QueueReader(admin, f"{name}-reset")
        try:
            plan = plan_reset(topology, target, admin, reader, state_root=state_root, progress=say)
            show(plan.describe())
            runs = active_runs(instance, name) if instance is not None else []
            if runs:
                say(refusal_message(name, runs, CLI_HOW_TO_STOP))
                return 3
            if plan.held_stores:
                say(
                    f"refusing to reset {name}: a local store is open in another process (see "
                    "the plan); stop every instance of the job first. Nothing was changed."
                )
                return 3
            if not apply:
                say("nothing was changed: run again with --yes to apply this plan")
                return 0
            pause = SupervisionPause(instance, name, say) if instance is not None else None
            if pause is not None:
                pause.pause()
                runs = active_runs(pause.store.instance, name)
                if runs:
                    pause.restore()
                    say(refusal_message(name, runs, CLI_HOW_TO_STOP))
                    return 3
            try:
                result = apply_reset(plan, admin, progress=say)
            except ResetRefusedError as exc:
                if pause is not None:
                    pause.restore()
                say(str(exc))
                return 3
            except (StateError, RocketMQError) as exc:
                say(f"the reset failed part-way: {exc}")
                say(pause.left_paused() if pause is not None else after_failure(name, False))
                return 1
            except BaseException:
                say(pause.left_paused() if pause is not None else after_failure(name, False))
                raise
            if pause is not None:
                pause.resume()
            say(result.describe())
            return 0
        finally:
            reader.close()
