"""The supervisor sensor: keeps each deployed topology's instances running, honestly.

For every registered topology with a desired state (written by the scale,
stop and start jobs), each tick:

1. **judges every unfinished instance run** by its process *and* its heartbeat
   (:func:`judge`). The process is known from Dagster's engine event "Started
   process for run (pid: N)" until the run's first heartbeat, which then
   carries pid and host. On this host:

   - process gone: the run is **dead** at once (marked FAILURE: Dagster's
     default run launcher never notices a killed run worker);
   - process alive, no heartbeat yet: **starting**, however long Spark takes
     (no fixed grace kills a live run);
   - process alive, heartbeat older than ``heartbeat_timeout_s``: **hung**
     (the heartbeat comes from a thread of its own: the process cannot run);
   - process alive and beating, but its run loop has not gone round for
     ``stall_timeout_s``: **hung** (stuck in one step). A run reporting a
     step under way (a query start, a release, a warm-up) within that bound
     is alive, however long the step or a batch takes.

   A hung run is terminated (SIGTERM, SIGKILL after ``terminate_grace_s``)
   and only then marked failed, so it can never run beside its replacement;
   not while it exits by itself (topology stopped, index scaled away).

   A run on another host (or whose pid is unknown) is judged by its heartbeat:
   dead when it is older than ``heartbeat_timeout_s``, or when no heartbeat
   came within ``startup_grace_s`` of its start. A CANCELING run is only
   watched for its process going away (then marked CANCELED): it is stopping,
   and a stopping instance sends no heartbeats while it finishes its batch.

2. **launches the missing instances**: an index of the current allocation is
   served while *any* unfinished run (QUEUED, NOT_STARTED, STARTING, STARTED,
   CANCELING) exists for it, whatever generation it was launched with: an
   instance adopts allocation changes in place. A missing index gets a run of
   the current generation and share, also during a rebalance's ``warm`` and
   ``release`` phases (new instances of a scale-out warm up then), but never a
   second run for an index.

3. **backs off a crash loop**: after two consecutive failed runs of an index
   within ``crash_window_s``, it waits ``backoff_base_s`` (then twice as long
   per further failure, at most ``backoff_max_s``) before relaunching, and says
   so: ``instance 1 of wordcount crashed 3 times in 4 min; next attempt in 30 s;
   last error: ...``.

A topology whose desired state is ``paused`` (a reset in progress), stopped
(``target_instances`` 0) or never allocated gets no new run; its runs are
still judged, so a dead one does not stay STARTED. Settings:
:class:`~stream_assets.settings.SupervisorSettings`.

Example (one pass, as the sensor makes it)::

    >>> settings, now = SupervisorSettings(), time.time()  # doctest: +SKIP
    >>> for item in plan_topology(instance, "wordcount", state, now, settings):  # doctest: +SKIP
    ...     print(item if isinstance(item, str) else item.run_key)
    wordcount: instance 0 (run 3f2a...): its process 4242 on node-1 is gone; marked failed
    wordcount:g3:i0:a1
"""

import json
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import dagster as dg
from dagster._core.launcher import DefaultRunLauncher
from dagster._core.launcher.sync_in_memory_run_launcher import SyncInMemoryRunLauncher
from dagster._core.storage.dagster_run import RunRecord

from stream_assets.control.allocation import Allocation
from stream_assets.control.desired_state import (
    DesiredState,
    DesiredStateStore,
    Heartbeat,
    heartbeats,
)
from stream_assets.control.lineage import topic_asset_key
from stream_assets.control.liveness import RunProcess, process_alive, terminate, this_host
from stream_assets.control.registry import (
    GENERATION_TAG,
    INSTANCE_INDEX_TAG,
    REGISTRY,
    TOPOLOGY_TAG,
)
from stream_assets.jobs.instance_job import (
    INSTANCE_JOB,
    instance_job,
    instance_run_config,
    instance_run_tags,
)
from stream_assets.settings import SupervisorSettings

#: Seconds between supervisor ticks (STREAM_ASSETS_SUPERVISOR_INTERVAL_S), read when
#: Dagster loads the code location.
SENSOR_INTERVAL_S = SupervisorSettings().interval_s

UNFINISHED = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]

#: The engine event Dagster's run worker logs, with metadata ``pid``, before the op runs
#: (dagster/_cli/api.py and dagster/_grpc/impl.py: ``EngineEventData.in_process(pid)``).
STARTED_PROCESS_PREFIX = "Started process for run"

Verdict = Literal["alive", "starting", "hung", "dead"]


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
    """Whether instance run ``run`` serves an index of ``allocation``.

    An instance adopts allocation changes in place (it keeps its process and
    SparkSession and swaps queues), so a run serves its index whatever
    generation and share it was launched with, as long as the index is still
    part of the allocation; a run whose index is scaled away stops by itself.
    An untagged run (index -1) serves nothing.

    Example::

        >>> to_stop = [r for r in instance_runs(instance, "wordcount")
        ...            if not serves(r, new_allocation)]  # doctest: +SKIP
    """
    return 0 <= run_index(run) < allocation.instances


@dataclass(frozen=True)
class Liveness:
    """What the supervisor concluded about one run, and why (the reason is logged).

    Example::

        >>> Liveness("hung", "its heartbeat is 45 s old", None).verdict
        'hung'
    """

    verdict: Verdict
    reason: str
    process: RunProcess | None


def judge(
    beat: Heartbeat | None,
    process: RunProcess | None,
    alive: bool | None,
    started_at: float | None,
    now: float,
    settings: SupervisorSettings,
) -> Liveness:
    """Liveness of a STARTED run from its heartbeat and process.

    ``alive`` is whether ``process`` runs (None: it cannot be checked from
    here, another host or no pid known); ``started_at`` is when the run
    started (epoch seconds), for the startup grace of unverifiable runs.

    Example::

        >>> s = SupervisorSettings(heartbeat_timeout_s=30, startup_grace_s=180)
        >>> p = RunProcess(4242, this_host(), 0.0, "engine event")
        >>> judge(None, p, True, started_at=0.0, now=1000.0, settings=s).verdict
        'starting'
        >>> judge(None, p, False, started_at=0.0, now=1.0, settings=s).verdict
        'dead'
        >>> beat = Heartbeat("wc", 1, 0, "r1", ts=900.0, pid=4242, host=this_host())
        >>> judge(beat, p, True, started_at=0.0, now=1000.0, settings=s).reason
        'its process 4242 is alive but its last heartbeat is 100 s old (timeout 30 s): hung'
        >>> judge(None, None, None, started_at=0.0, now=200.0, settings=s).verdict
        'dead'
    """
    timeout = settings.heartbeat_timeout_s
    if alive is False and process is not None:
        return Liveness("dead", f"its {process.describe()} is gone", process)
    if alive:
        assert process is not None
        if beat is None:
            return Liveness("starting", "its process is alive, no heartbeat yet", process)
        age = beat.age(now)
        if age > timeout:
            return Liveness(
                "hung",
                f"its process {process.pid} is alive but its last heartbeat is {age:.0f} s old "
                f"(timeout {timeout:.0f} s): hung",
                process,
            )
        return _progress(beat, process, now, settings)
    where = process.describe() if process is not None else "its process (pid unknown)"
    if beat is not None:
        age = beat.age(now)
        if age > timeout:
            return Liveness(
                "dead",
                f"no heartbeat for {age:.0f} s (timeout {timeout:.0f} s); {where} cannot be "
                "checked from here",
                process,
            )
        return _progress(beat, process, now, settings)
    if started_at is not None and now - started_at > settings.startup_grace_s:
        return Liveness(
            "dead",
            f"no heartbeat within {settings.startup_grace_s:.0f} s of its start; {where} "
            "cannot be checked from here",
            process,
        )
    return Liveness("starting", "no heartbeat yet (within the startup grace)", process)


def _progress(
    beat: Heartbeat, process: RunProcess | None, now: float, settings: SupervisorSettings
) -> Liveness:
    """A beating run: alive, unless its loop has been stuck in one step past the bound.

    The beat comes from a thread of its own, so it proves only that the process
    runs; the loop's last round says whether the run gets anywhere.
    """
    stalled = beat.stalled_s(now)
    doing = beat.activity(now)
    if stalled > settings.stall_timeout_s:
        return Liveness(
            "hung",
            f"its loop has not gone round for {stalled:.0f} s (stall timeout "
            f"{settings.stall_timeout_s:.0f} s){'; busy ' + doing if doing else ''}: hung",
            process,
        )
    return Liveness("alive", f"heartbeating{'; ' + doing if doing else ''}", process)


def _launches_locally(instance: dg.DagsterInstance) -> bool:
    """Whether run workers run on the machine that evaluates this sensor.

    Dagster's default launcher starts them from the code server, the same
    process that evaluates sensors (in-memory launchers run them in-process);
    other launchers (Docker, Kubernetes, ...) run them elsewhere, where a pid
    from the engine event means nothing here.
    """
    return isinstance(instance.run_launcher, (DefaultRunLauncher, SyncInMemoryRunLauncher))


def run_process(
    instance: dg.DagsterInstance, run: dg.DagsterRun, beat: Heartbeat | None
) -> RunProcess | None:
    """The run's process: from its heartbeat, else from Dagster's "Started process" event.

    Example::

        >>> beat = heartbeats(instance, [run.run_id]).get(run.run_id)  # doctest: +SKIP
        >>> run_process(instance, run, beat)  # doctest: +SKIP
        RunProcess(pid=4242, host='node-1', seen_at=1763735400.5, source='heartbeat')
    """
    if beat is not None and beat.pid > 0:
        return RunProcess(beat.pid, beat.host, beat.ts, "heartbeat")
    records = instance.get_records_for_run(
        run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT
    ).records
    for record in reversed(records):
        entry = record.event_log_entry
        event = entry.dagster_event
        if event is None or not (event.message or "").startswith(STARTED_PROCESS_PREFIX):
            continue
        pid_value = event.engine_event_data.metadata.get("pid")
        pid_text = str(getattr(pid_value, "value", "") or "")
        if pid_text.isdigit():
            host = this_host() if _launches_locally(instance) else ""
            return RunProcess(int(pid_text), host, entry.timestamp, "engine event")
    return None


def _started_at(instance: dg.DagsterInstance, run: dg.DagsterRun) -> float | None:
    record = instance.get_run_record_by_id(run.run_id)
    if record is None:
        return None
    if record.start_time:
        return float(record.start_time)
    return float(record.create_timestamp.timestamp())


def serving_runs(
    instance: dg.DagsterInstance,
    runs: list[dg.DagsterRun],
    now: float,
    settings: SupervisorSettings,
) -> list[dg.DagsterRun]:
    """The runs of ``runs`` that serve now: STARTED, heartbeating, their process alive.

    What a headline may call running. Dagster's run status alone says
    neither: a queued or starting run serves nothing yet, and a run whose
    process was killed stays STARTED until the supervisor notices.

    Example::

        >>> serving_runs(dg.DagsterInstance.ephemeral(), [], 0.0, SupervisorSettings())
        []
    """
    started = [r for r in runs if r.status == dg.DagsterRunStatus.STARTED]
    beats = heartbeats(instance, [r.run_id for r in started]) if started else {}
    return [
        run
        for run in started
        if run.run_id in beats  # no heartbeat yet: starting, nothing served
        and _beating(instance, run, beats[run.run_id], now, settings).verdict == "alive"
    ]


def _beating(
    instance: dg.DagsterInstance,
    run: dg.DagsterRun,
    beat: Heartbeat,
    now: float,
    settings: SupervisorSettings,
) -> Liveness:
    """:func:`judge` of a run that heartbeats, whatever Dagster's status of it says."""
    process = run_process(instance, run, beat)
    alive = process_alive(process.pid, process.seen_at) if process and process.local else None
    return judge(beat, process, alive, None, now, settings)


#: Run statuses whose process may exist: the ones the supervisor judges.
_JUDGED = (
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
)


def _patience(state: DesiredState, run: dg.DagsterRun) -> str | None:
    """Why a hung run of ``state``'s topology must not be terminated, if it must not.

    A run on its way out (topology stopped, index scaled away) is finishing its
    batch and exits by itself; nothing replaces it, so ending it gains nothing.
    A rebalance is no reason: the heartbeat comes from a thread of its own,
    and the steps of a rebalance have the stall bound like any other.
    """
    allocation = state.allocation
    if state.target_instances == 0:
        return "the topology is stopped: it is finishing its batch before it exits"
    if allocation is not None and run_index(run) >= allocation.instances:
        return "its index left the allocation: it is finishing its batch before it exits"
    return None


def _settle(
    instance: dg.DagsterInstance,
    name: str,
    state: DesiredState,
    runs: list[dg.DagsterRun],
    now: float,
    settings: SupervisorSettings,
) -> Generator[str, None, set[str]]:
    """Judge ``runs``; end the dead and hung ones. Yields log lines; returns the ended run ids."""
    judged = [r for r in runs if r.status in _JUDGED]
    beats = heartbeats(instance, [r.run_id for r in judged]) if judged else {}
    ended: set[str] = set()
    hung: list[tuple[dg.DagsterRun, Liveness]] = []
    for run in judged:
        beat = beats.get(run.run_id)
        process = run_process(instance, run, beat)
        alive = process_alive(process.pid, process.seen_at) if process and process.local else None
        label = f"{name}: instance {run_index(run)} (run {run.run_id})"
        if run.status != dg.DagsterRunStatus.STARTED:
            # STARTING: not yet running the op (run monitoring bounds a start that hangs);
            # CANCELING: stopping, silent while it finishes its batch. Only a process
            # that is gone settles them now.
            if alive is False and process is not None:
                reason = f"its {process.describe()} is gone"
                canceling = run.status == dg.DagsterRunStatus.CANCELING
                if _end(instance, run, reason, canceled=canceling):
                    yield f"{label}: {reason}; marked {'canceled' if canceling else 'failed'}"
                ended.add(run.run_id)
            continue
        liveness = judge(beat, process, alive, _started_at(instance, run), now, settings)
        if liveness.verdict == "dead":
            if _end(instance, run, liveness.reason):
                yield f"{label}: {liveness.reason}; marked failed"
            ended.add(run.run_id)
        elif liveness.verdict == "hung":
            patience = _patience(state, run)
            if patience is None:
                hung.append((run, liveness))
            else:
                yield f"{label}: {liveness.reason}, but not terminated: {patience}"
    if hung:
        lines: list[str] = []
        gone = terminate(
            [lv.process for _, lv in hung if lv.process is not None],
            settings.terminate_grace_s,
            lines.append,
        )
        yield from (f"{name}: {line}" for line in lines)
        for run, liveness in hung:
            label = f"{name}: instance {run_index(run)} (run {run.run_id})"
            process = liveness.process
            if process is None or not gone.get(process.pid, False):
                where = (
                    f"kill -9 {process.pid} on {process.host or 'its host'}"
                    if process is not None
                    else "its pid is unknown here"
                )
                yield (
                    f"{label}: {liveness.reason}, and its process could not be terminated; no "
                    f"replacement is launched while it lives. Kill it by hand ({where})."
                )
                continue
            reason = f"{liveness.reason}; terminated"
            if _end(instance, run, reason):
                yield f"{label}: {reason}; marked failed"
            ended.add(run.run_id)
    return ended


def _end(
    instance: dg.DagsterInstance, run: dg.DagsterRun, reason: str, canceled: bool = False
) -> bool:
    """Mark ``run`` failed (or canceled) unless it finished meanwhile; whether it was marked."""
    current = instance.get_run_by_id(run.run_id)
    if current is None or current.is_finished:
        return False  # it ended on its own between the listing and now
    message = f"the supervisor ended this run: {reason}"
    if canceled:
        instance.report_run_canceled(current, message)
    else:
        instance.report_run_failed(current, message)
    return True


@dataclass(frozen=True)
class CrashHistory:
    """Recent failed runs of one instance index, and the backoff they call for.

    ``consecutive`` counts the failures since the index's last run that did not
    fail (within the window), which is what the backoff grows with; ``in_window``
    counts every failure in the window (the alerts' crash count).

    Example::

        >>> s = SupervisorSettings(backoff_base_s=15, backoff_max_s=600)
        >>> [CrashHistory("wc", 0, n, n, 0.0, 100.0, None).backoff_s(s) for n in range(1, 8)]
        [0.0, 15.0, 30.0, 60.0, 120.0, 240.0, 480.0]
        >>> CrashHistory("wc", 0, 9, 9, 0.0, 100.0, None).retry_at(s)
        700.0
    """

    topology: str
    index: int
    consecutive: int
    in_window: int
    first_at: float  # end of the first of the consecutive failures (epoch s)
    last_at: float  # end of the latest failure
    last_run_id: str | None

    def backoff_s(self, settings: SupervisorSettings) -> float:
        """Wait after the latest failure before the next launch (0: none)."""
        if self.consecutive < 2:
            return 0.0
        delay = settings.backoff_base_s * 2 ** (self.consecutive - 2)
        return float(min(delay, settings.backoff_max_s))

    def retry_at(self, settings: SupervisorSettings) -> float:
        """Epoch seconds from which the index may be launched again."""
        backoff = self.backoff_s(settings)
        return self.last_at + backoff if backoff > 0 else 0.0

    def describe(self, now: float, settings: SupervisorSettings, last_error: str) -> str:
        """``instance 1 of wordcount crashed 3 times in 4 min; next attempt in 30 s; ...``."""
        wait = max(0.0, self.retry_at(settings) - now)
        return (
            f"instance {self.index} of {self.topology} crashed {self.consecutive} times in "
            f"{_span(now - self.first_at)}; next attempt in {wait:.0f} s; last error: {last_error}"
        )


def _span(seconds: float) -> str:
    """``45 s``, ``4 min``, ``2 h``."""
    if seconds < 120:
        return f"{max(seconds, 0):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"


def crash_history(
    instance: dg.DagsterInstance,
    topology: str,
    index: int,
    now: float,
    settings: SupervisorSettings,
) -> CrashHistory:
    """The failed runs of instance ``index`` of ``topology`` in the last ``crash_window_s``.

    Example::

        >>> crash_history(dg.DagsterInstance.ephemeral(), "wc", 0, 0.0, SupervisorSettings())
        CrashHistory(topology='wc', index=0, consecutive=0, in_window=0, ...)
    """
    since = now - settings.crash_window_s
    records = instance.get_run_records(
        filters=dg.RunsFilter(
            job_name=INSTANCE_JOB,
            tags={TOPOLOGY_TAG: topology, INSTANCE_INDEX_TAG: str(index)},
            statuses=[
                dg.DagsterRunStatus.FAILURE,
                dg.DagsterRunStatus.CANCELED,
                dg.DagsterRunStatus.SUCCESS,
            ],
            updated_after=datetime.fromtimestamp(max(since, 0.0), UTC),
        ),
        limit=200,
    )
    ended = sorted(
        (
            (float(r.end_time or r.update_timestamp.timestamp()), r)
            for r in records
            if float(r.end_time or r.update_timestamp.timestamp()) >= since
            # Not the instance's doing: neither a crash nor a break in a crash streak.
            and launch_failure(instance, r) is None
        ),
        key=lambda pair: pair[0],
        reverse=True,
    )
    failed = [(t, r) for t, r in ended if r.dagster_run.status == dg.DagsterRunStatus.FAILURE]
    streak: list[tuple[float, Any]] = []
    for t, r in ended:
        if r.dagster_run.status != dg.DagsterRunStatus.FAILURE:
            break
        streak.append((t, r))
    return CrashHistory(
        topology=topology,
        index=index,
        consecutive=len(streak),
        in_window=len(failed),
        first_at=streak[-1][0] if streak else 0.0,
        last_at=streak[0][0] if streak else 0.0,
        last_run_id=streak[0][1].dagster_run.run_id if streak else None,
    )


#: The error Dagster's run queue records when it cannot reach the code server to
#: launch a run (a gRPC DEADLINE_EXCEEDED or UNAVAILABLE from a busy code server).
_UNREACHABLE = "DagsterUserCodeUnreachableError"


def launch_failure(instance: dg.DagsterInstance, record: RunRecord) -> str | None:
    """Why a failed run never started, if the code server was unreachable (else None).

    Such a run had no process: the instance never ran, so it is not a crash
    and must not feed the crash-loop backoff. Dagster's run queue retries these
    launches itself (``run_queue.max_user_code_failure_retries`` in
    dagster.yaml); a run fails only when those retries ran out, and the
    supervisor then simply launches the index again. A code location that
    fails to *load* is the instance's code: that stays a crash.

    Example::

        >>> record = instance.get_run_record_by_id(run_id)  # doctest: +SKIP
        >>> launch_failure(instance, record)  # doctest: +SKIP
        'Could not reach user code server. gRPC Error code: DEADLINE_EXCEEDED'
    """
    run = record.dagster_run
    if run.status != dg.DagsterRunStatus.FAILURE or record.start_time is not None:
        return None
    engine = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
    for entry in engine.records:
        event = entry.event_log_entry.dagster_event
        error = event.engine_event_data.error if event is not None else None
        while error is not None:
            if error.cls_name == _UNREACHABLE:
                return _one_line(error.message, 300)
            error = error.cause
    return None


#: Run-failure messages Dagster writes itself, which say nothing of the cause.
_GENERIC_FAILURES = (
    "This run has been marked as failed from outside the execution context.",
    "Execution of run for ",
)
#: Dagster's code server, when a run worker it started exits without finishing the run.
_CRASH_EXPLANATION = "Run execution process for "


def failure_message(instance: dg.DagsterInstance, run_id: str, limit: int = 400) -> str:
    """Why run ``run_id`` failed, in one line: the real cause, not Dagster's generic wording.

    In order: the op's error (what the instance raised); the first run-failure
    message that names a cause (the supervisor's "its process ... is gone");
    the code server's note on how the run worker died ("terminated by signal
    9"); else whatever failure message there is.

    Example::

        >>> inst = dg.DagsterInstance.ephemeral()
        >>> run = inst.create_run_for_job(instance_job, run_config={
        ...     "ops": {"run_instance": {"config": {"topology": "wordcount"}}}})
        >>> _ = inst.report_run_failed(run, "its process 4242 on node-1 is gone")
        >>> _ = inst.report_run_failed(run)  # the code server noticed too: says nothing new
        >>> failure_message(inst, run.run_id)
        'its process 4242 on node-1 is gone'
    """
    steps = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records
    for record in reversed(steps):
        event = record.event_log_entry.dagster_event
        data = event.step_failure_data if event is not None else None
        if data is not None and data.error is not None:
            error = data.error
            # Dagster wraps user errors ("Error occurred while executing op ..."): the
            # cause is what the instance raised.
            while error.cause is not None and (error.cls_name or "").startswith("Dagster"):
                error = error.cause
            return _one_line(error.message, limit)
    messages = [
        (
            record.event_log_entry.dagster_event.message
            if record.event_log_entry.dagster_event
            else ""
        )
        or record.event_log_entry.user_message
        for record in instance.get_records_for_run(
            run_id, of_type=dg.DagsterEventType.RUN_FAILURE
        ).records
    ]
    for text in messages:
        if text and not text.startswith(_GENERIC_FAILURES):
            return _one_line(text.removeprefix("the supervisor ended this run: "), limit)
    engine = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT).records
    for record in engine:
        event = record.event_log_entry.dagster_event
        text = (event.message if event is not None else None) or ""
        if _CRASH_EXPLANATION in text:
            # "... was terminated by signal 9 (SIGKILL)." and Dagster's guess at why.
            return _one_line(text[text.index(_CRASH_EXPLANATION) :].split(". ")[0], limit)
    return _one_line(next((m for m in messages if m), "no failure event recorded"), limit)


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def plan_topology(
    instance: dg.DagsterInstance,
    name: str,
    state: DesiredState,
    now: float,
    settings: SupervisorSettings,
) -> Iterator[dg.RunRequest | str]:
    """Run requests (and log lines) that bring ``name`` to its desired state.

    Judges and ends dead or hung runs first (see the module docstring), then
    requests a run for every index of the allocation that has no unfinished
    run, unless the topology is paused, stopped or the index is backing off.
    """
    runs = instance_runs(instance, name)
    ended = yield from _settle(instance, name, state, runs, now, settings)
    # Terminating a hung run takes seconds: the backoff counts from the real time.
    now = max(now, time.time())
    allocation = state.allocation
    if allocation is None or state.paused or state.target_instances == 0:
        return
    served = {run_index(r) for r in runs if r.run_id not in ended}
    for index in range(allocation.instances):
        if index in served:
            continue
        survivor = _ended_but_alive(instance, name, index, now, settings)
        if survivor is not None:
            yield survivor
            continue
        history = crash_history(instance, name, index, now, settings)
        if history.retry_at(settings) > now:
            last_error = failure_message(instance, history.last_run_id or "")
            yield f"{name}: {history.describe(now, settings, last_error)}"
            continue
        refused = _last_launch_failure(instance, name, index)
        if refused is not None:
            yield (
                f"{name}: instance {index} could not be launched ({refused}): Dagster could not "
                "reach the code server, which is not the instance's fault; launching it again "
                "(not counted as a crash)"
            )
        yield _request(instance, name, allocation, index)


#: How many of an index's newest ended runs are looked at for one still alive.
_ENDED_LOOKED_AT = 5


def _ended_but_alive(
    instance: dg.DagsterInstance, name: str, index: int, now: float, settings: SupervisorSettings
) -> str | None:
    """Why no run of instance ``index`` may be launched now: an ended run of it still serves.

    Dagster can end a run from outside while its process goes on (a launch it
    retried after the worker had started, marked failed). A second run of the
    index would read its queues twice, so none is launched while that one
    heartbeats and its process lives; it sees its status and exits cleanly
    (``instance_job``: ``DISOWNED``). None when no such run exists.
    """
    ended = instance.get_runs(
        filters=dg.RunsFilter(
            job_name=INSTANCE_JOB,
            tags={TOPOLOGY_TAG: name, INSTANCE_INDEX_TAG: str(index)},
            statuses=[dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED],
        ),
        limit=_ENDED_LOOKED_AT,
    )
    beats = heartbeats(instance, [r.run_id for r in ended]) if ended else {}
    for run in ended:
        beat = beats.get(run.run_id)
        liveness = None if beat is None else _beating(instance, run, beat, now, settings)
        if liveness is not None and liveness.verdict == "alive":
            process = liveness.process
            where = process.describe() if process is not None else "its process"
            return (
                f"{name}: instance {index}: run {run.run_id} is {run.status.value} in Dagster "
                f"but {where} lives and heartbeats; launching no second run of the index "
                "while it does (it exits once it sees its status)"
            )
    return None


def _last_launch_failure(instance: dg.DagsterInstance, name: str, index: int) -> str | None:
    """:func:`launch_failure` of the newest run of instance ``index`` of ``name``."""
    newest = instance.get_run_records(
        filters=dg.RunsFilter(
            job_name=INSTANCE_JOB, tags={TOPOLOGY_TAG: name, INSTANCE_INDEX_TAG: str(index)}
        ),
        limit=1,
    )
    return launch_failure(instance, newest[0]) if newest else None


def _request(
    instance: dg.DagsterInstance, name: str, allocation: Allocation, index: int
) -> dg.RunRequest:
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
    return dg.RunRequest(
        # A fresh key per attempt: one run_key makes one run.
        run_key=f"{name}:g{allocation.generation}:i{index}:a{attempts}",
        job_name=INSTANCE_JOB,
        run_config=instance_run_config(name, allocation.generation, index, share),
        tags=instance_run_tags(name, allocation.generation, index, share),
    )


@dg.sensor(
    job=instance_job,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Keeps every deployed topology's instances running; ends dead or hung runs and "
    "relaunches them, backing off a crash loop.",
)
def supervisor_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    """One supervision pass over every registered topology."""
    now = time.time()
    settings = SupervisorSettings()
    requests: list[dg.RunRequest] = []
    events: list[dg.AssetObservation] = []
    states = DesiredStateStore(context.instance).get_many(REGISTRY)
    for name, state in sorted(states.items()):
        for item in plan_topology(context.instance, name, state, now, settings):
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
