"""The supervisor's plan on a real (temporary) Dagster instance: what it launches, ends and why.

Processes are real: a ``sleep`` child is a live run process, the pid of a
child that already exited (and was reaped) a dead one. Heartbeats are written
as the instance job writes them, with the fake process's pid and this host.
"""

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import dagster as dg
import pytest
from dagster._core.errors import DagsterUserCodeUnreachableError
from dagster._core.events import EngineEventData
from dagster._utils.error import serializable_error_info_from_exc_info

from stream_assets.control.alerts import Alert
from stream_assets.control.allocation import allocate
from stream_assets.control.desired_state import (
    DesiredState,
    DesiredStateStore,
    Heartbeat,
    heartbeat_key,
)
from stream_assets.control.lineage import topology_asset_key
from stream_assets.control.liveness import this_host
from stream_assets.control.registry import (
    GENERATION_TAG,
    IDLE_TAG,
    INSTANCE_INDEX_TAG,
    TOPOLOGY_TAG,
)
from stream_assets.jobs.alerts import alert_for
from stream_assets.jobs.checks import crash_check_key
from stream_assets.jobs.instance_job import (
    DISOWNED,
    InstanceConfig,
    _supervise,
    instance_job,
    instance_run_config,
)
from stream_assets.jobs.supervisor import crash_history, plan_topology
from stream_assets.settings import SupervisorSettings
from tests.unit._alert_sensor import alert_sensor_tick

NAME = "wc"
QUEUES = {"wc-src": [0, 1], "wc-shuffle": [0, 1, 2, 3]}
SETTINGS = SupervisorSettings(
    heartbeat_timeout_s=30,
    startup_grace_s=180,
    terminate_grace_s=0.5,
    backoff_base_s=15,
    backoff_max_s=600,
    crash_window_s=600,
    alert_hooks=(),
)


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture
def live() -> Iterator[subprocess.Popen[bytes]]:
    """A live process standing in for a run worker."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _plan(
    instance: dg.DagsterInstance,
    state: DesiredState,
    now: float,
    settings: SupervisorSettings = SETTINGS,
) -> tuple[list[dg.RunRequest], list[str]]:
    items = list(plan_topology(instance, NAME, state, now, settings))
    return (
        [i for i in items if isinstance(i, dg.RunRequest)],
        [i for i in items if isinstance(i, str)],
    )


def _requests(instance: dg.DagsterInstance, state: DesiredState, now: float) -> list[Any]:
    return _plan(instance, state, now)[0]


def _indexes(requests: list[dg.RunRequest]) -> list[int]:
    return sorted(int(r.tags[INSTANCE_INDEX_TAG]) for r in requests)


def _assignment(request: dg.RunRequest) -> Any:
    config = request.run_config["ops"]["run_instance"]["config"]
    return json.loads(config["assignment_json"])


def _event(instance: dg.DagsterInstance, run: dg.DagsterRun, kind: dg.DagsterEventType) -> None:
    instance.handle_new_event(
        dg.EventLogEntry(  # type: ignore[no-untyped-call]
            error_info=None,
            level="DEBUG",
            user_message="",
            run_id=run.run_id,
            timestamp=time.time(),
            dagster_event=dg.DagsterEvent(event_type_value=kind.value, job_name=run.job_name),
        )
    )


def _start(
    instance: dg.DagsterInstance, request: dg.RunRequest, pid: int | None = None
) -> dg.DagsterRun:
    """Create the run and start it as Dagster's run worker does (engine event with the pid)."""
    run = instance.create_run_for_job(
        instance_job, run_config=request.run_config, tags=dict(request.tags)
    )
    _event(instance, run, dg.DagsterEventType.RUN_STARTING)
    if pid is not None:
        instance.report_engine_event(
            f"Started process for run (pid: {pid}).", run, EngineEventData.in_process(pid)
        )
    _event(instance, run, dg.DagsterEventType.RUN_START)
    return _status(instance, run, dg.DagsterRunStatus.STARTED)


def _status(
    instance: dg.DagsterInstance, run: dg.DagsterRun, expected: dg.DagsterRunStatus
) -> dg.DagsterRun:
    current = instance.get_run_by_id(run.run_id)
    assert current is not None
    assert current.status == expected, current.status
    return current


def _beat(
    instance: dg.DagsterInstance,
    run: dg.DagsterRun,
    pid: int,
    ts: float,
    host: str | None = None,
    loop_at: float = 0.0,
    busy: str = "",
) -> None:
    """The heartbeat the instance job writes, from process ``pid`` on ``host``.

    ``loop_at``: when its run loop last went round (0: as the beat); ``busy``:
    the step it is in since then.
    """
    beat = Heartbeat(
        job_id=NAME,
        generation=int(run.tags[GENERATION_TAG]),
        instance_index=int(run.tags[INSTANCE_INDEX_TAG]),
        run_id=run.run_id,
        ts=ts,
        pid=pid,
        host=this_host() if host is None else host,
        loop_at=loop_at or ts,
        busy=busy,
        busy_since=loop_at if busy else 0.0,
    )
    instance.daemon_cursor_storage.set_cursor_values({heartbeat_key(run.run_id): beat.to_json()})


def _fail(instance: dg.DagsterInstance, request: dg.RunRequest, message: str) -> dg.DagsterRun:
    run = instance.create_run_for_job(
        instance_job, run_config=request.run_config, tags=dict(request.tags)
    )
    instance.report_run_failed(run, message)
    return _status(instance, run, dg.DagsterRunStatus.FAILURE)


def _messages(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str:
    return " | ".join(e.message for e in instance.all_logs(run.run_id))


# -- what is launched ---------------------------------------------------------------------------


def test_instances_beyond_the_queue_count_are_launched_idle_and_tagged(
    instance: dg.DagsterInstance,
) -> None:
    allocation = allocate(QUEUES, 5)
    requests = _requests(instance, DesiredState(5, allocation), now=0.0)
    by_index = {int(r.tags[INSTANCE_INDEX_TAG]): r for r in requests}
    assert sorted(by_index) == [0, 1, 2, 3, 4]
    # Four shuffle queues for five instances: exactly one instance owns nothing.
    owned = {i: any(_assignment(r).values()) for i, r in by_index.items()}
    assert [i for i, has in owned.items() if not has] == [4]
    assert _assignment(by_index[4]) == {"wc-shuffle": [], "wc-src": []}
    assert {i for i, r in by_index.items() if r.tags.get(IDLE_TAG) == "true"} == {4}
    # Every queue is owned by exactly one request's assignment.
    for topic, queues in QUEUES.items():
        assert sorted(q for r in requests for q in _assignment(r)[topic]) == queues


def test_paused_topology_gets_no_runs(instance: dg.DagsterInstance) -> None:
    state = DesiredState(2, allocate(QUEUES, 2), paused=True)
    assert _requests(instance, state, now=0.0) == []


def test_stopped_topology_launches_nothing_but_its_dead_runs_are_still_ended(
    instance: dg.DagsterInstance, dead_pid: int
) -> None:
    allocation = allocate(QUEUES, 2)
    (first, _) = _requests(instance, DesiredState(2, allocation), now=time.time())
    run = _start(instance, first, pid=dead_pid)
    stopped = DesiredState(0, allocation)
    for _tick in range(3):
        assert _requests(instance, stopped, now=time.time()) == []
    # The run whose process is gone does not stay STARTED, stopped topology or not.
    _status(instance, run, dg.DagsterRunStatus.FAILURE)


def test_a_live_run_of_an_older_generation_serves_its_index(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> None:
    old = allocate(QUEUES, 2)
    now = time.time()
    for request in _requests(instance, DesiredState(2, old), now=now):
        _beat(instance, _start(instance, request, pid=live.pid), live.pid, now)
    # A run started by hand without an instance index serves no index (and is no error).
    _start(
        instance,
        dg.RunRequest(
            run_config=instance_run_config(NAME, old.generation, 0, old.for_instance(0)),
            tags={TOPOLOGY_TAG: NAME},
        ),
    )
    new = allocate(QUEUES, 3, "sticky", previous=old)
    # Runs adopt a new allocation in place: only the new index 2 is launched, with the
    # new generation and its share, in every phase of the rebalance.
    for phase in ("warm", "release", "run"):
        (request,) = _requests(instance, DesiredState(3, new, phase=phase), now=now)
        assert request.tags[INSTANCE_INDEX_TAG] == "2"
        assert request.tags[GENERATION_TAG] == str(new.generation)
        assert _assignment(request) == new.for_instance(2)
    # A scale-in launches nothing: the run of index 1 stops by itself.
    assert _requests(instance, DesiredState(1, allocate(QUEUES, 1, previous=new)), now) == []


def test_no_second_run_while_a_run_dagster_ended_still_serves(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> None:
    # Dagster marked the run failed from outside (a launch it retried after the worker
    # had started) while its process went on heartbeating: a second run of the index
    # would read its queues twice.
    state = DesiredState(2, allocate(QUEUES, 2))
    zero, one = _requests(instance, state, now=time.time())
    _start(instance, one)
    run = _start(instance, zero, pid=live.pid)
    now = time.time()
    _beat(instance, run, live.pid, now)
    instance.report_run_failed(run, "Ignoring a duplicate run (from outside)")
    _status(instance, run, dg.DagsterRunStatus.FAILURE)
    for tick in range(3):
        requests, lines = _plan(instance, state, now + tick)
        assert requests == []
        assert any(f"run {run.run_id} is FAILURE in Dagster" in line for line in lines), lines
    # Its process gone (it saw its status and left): the index is launched again.
    live.kill()
    live.wait()
    (request,) = _requests(instance, state, now=time.time())
    assert request.tags[INSTANCE_INDEX_TAG] == "0"


def test_a_run_dagster_ended_from_outside_stops_itself() -> None:
    # The other half: the run sees its own status and leaves at its next round
    # (before touching its engine), naming why.
    seen: list[str] = []

    @dg.op
    def ended_from_outside(context: dg.OpExecutionContext) -> None:
        context.instance.report_run_failed(context.dagster_run, "marked failed from outside")
        heart = SimpleNamespace(follower=object())  # the loop leaves before using either
        config = InstanceConfig(topology=NAME, generation=1, instance_index=0)
        reason = _supervise(context, config, None, heart, threading.Event(), 30.0)  # type: ignore[arg-type]
        seen.append(reason)

    @dg.job
    def disowned() -> None:
        ended_from_outside()

    disowned.execute_in_process(instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    assert len(seen) == 1 and seen[0].startswith(DISOWNED), seen
    assert "Dagster marked this run FAILURE while it ran" in seen[0]


def test_no_second_run_while_a_run_is_queued_or_starting(
    instance: dg.DagsterInstance,
) -> None:
    state = DesiredState(2, allocate(QUEUES, 2))
    zero, one = _requests(instance, state, now=time.time())
    instance.create_run_for_job(instance_job, run_config=zero.run_config, tags=dict(zero.tags))
    starting = instance.create_run_for_job(
        instance_job, run_config=one.run_config, tags=dict(one.tags)
    )
    _event(instance, starting, dg.DagsterEventType.RUN_STARTING)
    _status(instance, starting, dg.DagsterRunStatus.STARTING)
    assert _requests(instance, state, now=time.time() + 10_000) == []


# -- liveness -----------------------------------------------------------------------------------


def test_alive_process_without_heartbeat_is_starting_however_long_it_takes(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> None:
    state = DesiredState(1, allocate(QUEUES, 1))
    (request,) = _requests(instance, state, now=time.time())
    run = _start(instance, request, pid=live.pid)
    # Far past any startup grace: the process is alive, so the run is still starting.
    assert _requests(instance, state, now=time.time() + 100 * SETTINGS.startup_grace_s) == []
    _status(instance, run, dg.DagsterRunStatus.STARTED)
    assert live.poll() is None


def test_dead_process_is_dead_at_once(instance: dg.DagsterInstance, dead_pid: int) -> None:
    state = DesiredState(1, allocate(QUEUES, 1))
    (request,) = _requests(instance, state, now=time.time())
    run = _start(instance, request, pid=dead_pid)
    # No heartbeat yet and well within every timeout: the process is gone, so is the run.
    (relaunch, *_), lines = _plan(instance, state, now=time.time())
    assert relaunch.tags[INSTANCE_INDEX_TAG] == "0" and relaunch.run_key != request.run_key
    _status(instance, run, dg.DagsterRunStatus.FAILURE)
    assert any(f"process {dead_pid} on {this_host()} is gone" in line for line in lines), lines
    assert f"process {dead_pid}" in _messages(instance, run)


def test_a_heartbeating_run_whose_process_died_is_dead_before_its_heartbeat_ages(
    instance: dg.DagsterInstance, dead_pid: int, live: subprocess.Popen[bytes]
) -> None:
    state = DesiredState(2, allocate(QUEUES, 2))
    now = time.time()
    zero, one = _requests(instance, state, now=now)
    gone = _start(instance, zero, pid=dead_pid)
    _beat(instance, gone, dead_pid, now)
    kept = _start(instance, one, pid=live.pid)
    _beat(instance, kept, live.pid, now)
    assert _indexes(_requests(instance, state, now=now + 1)) == [0]
    _status(instance, gone, dg.DagsterRunStatus.FAILURE)
    _status(instance, kept, dg.DagsterRunStatus.STARTED)


def _one_started(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> tuple[DesiredState, dg.DagsterRun, float]:
    """A topology of one instance, its run started with process ``live``; and when."""
    state = DesiredState(1, allocate(QUEUES, 1))
    now = time.time()
    (request,) = _requests(instance, state, now=now)
    return state, _start(instance, request, pid=live.pid), now


def test_hung_run_is_terminated_before_it_is_replaced(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> None:
    state, run, now = _one_started(instance, live)
    _beat(instance, run, live.pid, now)
    assert _requests(instance, state, now=now + SETTINGS.heartbeat_timeout_s - 1) == []
    # Alive but silent past the timeout: hung. SIGTERM ends the sleep, then it is replaced.
    (relaunch,), lines = _plan(instance, state, now=now + SETTINGS.heartbeat_timeout_s + 15)
    assert live.wait(5) == -15
    assert relaunch.tags[INSTANCE_INDEX_TAG] == "0"
    _status(instance, run, dg.DagsterRunStatus.FAILURE)
    assert any("hung; terminated" in line for line in lines), lines


def test_a_run_busy_in_one_step_is_alive_until_the_stall_bound_then_terminated(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> None:
    """Beats from its thread, loop stuck in a query start: alive for the whole bound."""
    state, run, now = _one_started(instance, live)
    starting = "starting the query of stage 1 (attempt 2)"
    # Far longer than a heartbeat timeout, every beat fresh: a slow start, not a hang.
    slow = now + 10 * SETTINGS.heartbeat_timeout_s
    _beat(instance, run, live.pid, slow, loop_at=now, busy=starting)
    assert _plan(instance, state, slow) == ([], [])
    assert live.poll() is None
    _status(instance, run, dg.DagsterRunStatus.STARTED)
    # The same step past the stall bound: hung, terminated, then replaced.
    stuck = now + SETTINGS.stall_timeout_s + 5
    _beat(instance, run, live.pid, stuck, loop_at=now, busy=starting)
    (relaunch,), lines = _plan(instance, state, stuck)
    assert live.wait(5) == -15
    assert relaunch.tags[INSTANCE_INDEX_TAG] == "0"
    _status(instance, run, dg.DagsterRunStatus.FAILURE)
    (line,) = [x for x in lines if "terminated" in x]
    assert f"its loop has not gone round for {SETTINGS.stall_timeout_s + 5:.0f} s" in line
    assert starting in line, line


def test_a_frozen_run_is_terminated_in_the_middle_of_a_rebalance(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> None:
    """Its heartbeat thread cannot run: a rebalance does not excuse the silence."""
    allocation = allocate(QUEUES, 1)
    now = time.time()
    (request,) = _requests(instance, DesiredState(1, allocation), now=now)
    run = _start(instance, request, pid=live.pid)
    _beat(instance, run, live.pid, now)
    warm = DesiredState(2, allocate(QUEUES, 2, previous=allocation), phase="warm")
    _, lines = _plan(instance, warm, now + SETTINGS.heartbeat_timeout_s + 5)
    assert live.wait(5) == -15
    _status(instance, run, dg.DagsterRunStatus.FAILURE)
    assert any("hung; terminated" in line for line in lines), lines


def test_a_silent_run_is_not_terminated_while_it_exits_by_itself(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> None:
    allocation = allocate(QUEUES, 2)
    now = time.time()
    runs = [
        _start(instance, request, pid=live.pid)
        for request in _requests(instance, DesiredState(2, allocation), now=now)
    ]
    for run in runs:
        _beat(instance, run, live.pid, now)
    later = now + 10 * SETTINGS.heartbeat_timeout_s
    # A stopped topology's instances and a scaled-away index finish their batch before
    # they exit: nothing replaces them, so they are not terminated.
    for state in (DesiredState(0, allocation),):
        requests, lines = _plan(instance, state, later)
        assert requests == [] and len(lines) == 2, lines
        assert all("but not terminated" in line for line in lines)
    _beat(instance, runs[0], live.pid, later)  # instance 0 stays in the allocation and beats
    _, (line,) = _plan(instance, DesiredState(1, allocate(QUEUES, 1, previous=allocation)), later)
    assert "instance 1" in line and "its index left the allocation" in line
    assert live.poll() is None
    for run in runs:
        _status(instance, run, dg.DagsterRunStatus.STARTED)


def test_hung_run_that_ignores_sigterm_is_killed(instance: dg.DagsterInstance) -> None:
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(300)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == b"ready\n"
        state = DesiredState(1, allocate(QUEUES, 1))
        now = time.time()
        (request,) = _requests(instance, state, now=now)
        run = _start(instance, request, pid=stubborn.pid)
        _beat(instance, run, stubborn.pid, now)
        (relaunch,), lines = _plan(instance, state, now=now + 600)
        assert stubborn.wait(5) == -9 and relaunch.tags[INSTANCE_INDEX_TAG] == "0"
        assert any("ignored SIGTERM" in line for line in lines), lines
        _status(instance, run, dg.DagsterRunStatus.FAILURE)
    finally:
        stubborn.kill()
        stubborn.wait()


def test_run_on_another_host_falls_back_to_heartbeat_timeout_and_grace(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> None:
    state = DesiredState(2, allocate(QUEUES, 2))
    now = time.time()
    zero, one = _requests(instance, state, now=now)
    remote = _start(instance, zero, pid=live.pid)
    _beat(instance, remote, live.pid, now, host="another-host")
    # No engine event, no heartbeat: the pid is unknown, only the startup grace applies.
    unknown = _start(instance, one)
    assert _requests(instance, state, now=now + 10) == []
    requests = _requests(instance, state, now=now + SETTINGS.startup_grace_s + 1)
    assert _indexes(requests) == [0, 1]
    _status(instance, remote, dg.DagsterRunStatus.FAILURE)
    _status(instance, unknown, dg.DagsterRunStatus.FAILURE)
    # A process on another host is never signalled from here (the pid is someone else's).
    assert live.poll() is None


def test_no_relaunch_while_canceling_until_the_process_is_gone(
    instance: dg.DagsterInstance, live: subprocess.Popen[bytes]
) -> None:
    state = DesiredState(1, allocate(QUEUES, 1))
    now = time.time()
    (request,) = _requests(instance, state, now=now)
    run = _start(instance, request, pid=live.pid)
    _beat(instance, run, live.pid, now)
    instance.report_run_canceling(run)
    # Stopping instances beat no more while they finish their batch: never hung, never doubled.
    for later in (10, 100, 10_000):
        assert _requests(instance, state, now=now + later) == []
    assert live.poll() is None
    _status(instance, run, dg.DagsterRunStatus.CANCELING)
    live.kill()
    live.wait()
    (relaunch,) = _requests(instance, state, now=time.time())
    assert relaunch.tags[INSTANCE_INDEX_TAG] == "0"
    _status(instance, run, dg.DagsterRunStatus.CANCELED)


# -- crash-loop backoff -------------------------------------------------------------------------


def test_backoff_after_two_consecutive_crashes_doubles_and_is_forgotten_after_the_window(
    instance: dg.DagsterInstance,
) -> None:
    state = DesiredState(2, allocate(QUEUES, 2))
    requests = {int(r.tags[INSTANCE_INDEX_TAG]): r for r in _requests(instance, state, 0.0)}
    _fail(instance, requests[0], "RuntimeError: boom 1")
    now = time.time()
    # One crash: relaunched at once.
    assert _indexes(_requests(instance, state, now)) == [0, 1]
    _fail(instance, requests[0], "RuntimeError: boom 2")
    now = time.time()
    requests_now, lines = _plan(instance, state, now)
    assert _indexes(requests_now) == [1]  # instance 1 never crashed: not held back
    (line,) = lines
    # (Seconds may be off by one or two on a busy machine: the failures are real runs.)
    assert re.search(r"instance 0 of wc crashed 2 times in \d s; next attempt in 1[345] s", line)
    assert line.endswith("last error: RuntimeError: boom 2")
    assert _indexes(_requests(instance, state, now + 16)) == [0, 1]
    _fail(instance, requests[0], "RuntimeError: boom 3")
    now = time.time()
    _, (line,) = _plan(instance, state, now)
    assert re.search(r"crashed 3 times in \d+ s; next attempt in (28|29|30) s", line), line
    assert _indexes(_requests(instance, state, now + 25)) == [1]
    assert _indexes(_requests(instance, state, now + 31)) == [0, 1]
    # Crashes older than the window are forgotten.
    history = crash_history(instance, NAME, 0, now + SETTINGS.crash_window_s + 1, SETTINGS)
    assert history.consecutive == 0
    assert _indexes(_requests(instance, state, now + SETTINGS.crash_window_s + 1)) == [0, 1]


def test_a_run_that_did_not_fail_ends_the_crash_streak(instance: dg.DagsterInstance) -> None:
    state = DesiredState(1, allocate(QUEUES, 1))
    (request,) = _requests(instance, state, 0.0)
    for i in range(3):
        _fail(instance, request, f"boom {i}")
    canceled = instance.create_run_for_job(
        instance_job, run_config=request.run_config, tags=dict(request.tags)
    )
    instance.report_run_canceled(canceled)
    history = crash_history(instance, NAME, 0, time.time(), SETTINGS)
    assert (history.consecutive, history.in_window) == (0, 3)
    assert _indexes(_requests(instance, state, time.time())) == [0]


def _refused_launch(instance: dg.DagsterInstance, request: dg.RunRequest) -> dg.DagsterRun:
    """A run failed as Dagster's run queue fails it when the code server never answered."""
    run = instance.create_run_for_job(
        instance_job, run_config=request.run_config, tags=dict(request.tags)
    )
    try:
        raise DagsterUserCodeUnreachableError(
            "Could not reach user code server. gRPC Error code: DEADLINE_EXCEEDED"
        )
    except DagsterUserCodeUnreachableError:
        error = serializable_error_info_from_exc_info(sys.exc_info())
    instance.report_engine_event(
        "Run dequeue failed to reach the user code server after 5 attempts, failing run",
        run,
        EngineEventData.engine_error(error),
    )
    instance.report_run_failed(run)
    return _status(instance, run, dg.DagsterRunStatus.FAILURE)


def test_a_launch_the_code_server_never_answered_is_not_a_crash(
    instance: dg.DagsterInstance,
) -> None:
    state = DesiredState(1, allocate(QUEUES, 1))
    (request,) = _requests(instance, state, 0.0)
    _fail(instance, request, "RuntimeError: boom")
    for _ in range(3):
        refused = _refused_launch(instance, request)
    # Neither counted nor breaking the streak: one crash, so no backoff; relaunched at once.
    history = crash_history(instance, NAME, 0, time.time(), SETTINGS)
    assert (history.consecutive, history.in_window) == (1, 1)
    (relaunch,), (line,) = _plan(instance, state, time.time())
    assert relaunch.tags[INSTANCE_INDEX_TAG] == "0"
    assert "instance 0 could not be launched" in line and "DEADLINE_EXCEEDED" in line, line
    assert "not counted as a crash" in line
    # Its alert says what it was; the crash check is not failed by it.
    alert = alert_for(instance, refused, time.time(), SETTINGS)
    assert (alert.kind, alert.crashes) == ("launch_failed", 1)
    assert "could not be launched" in alert.describe() and "DEADLINE_EXCEEDED" in alert.message
    # A second real crash after them is the second in a row: the backoff engages.
    _fail(instance, request, "RuntimeError: boom again")
    assert crash_history(instance, NAME, 0, time.time(), SETTINGS).consecutive == 2
    assert _requests(instance, state, time.time()) == []


# -- alerts -------------------------------------------------------------------------------------

ALERTS: list[Alert] = []


def record_alert(alert: Alert) -> None:
    """An alert hook (STREAM_ASSETS_ALERT_HOOKS=tests.unit.test_supervisor:record_alert)."""
    ALERTS.append(alert)


def broken_hook(alert: Alert) -> None:
    raise RuntimeError(f"cannot page for {alert.run_id}")


def test_failed_runs_raise_alerts_to_the_log_the_topology_asset_and_the_hooks(
    instance: dg.DagsterInstance,
    dead_pid: int,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(
        "STREAM_ASSETS_ALERT_HOOKS",
        "tests.unit.test_supervisor:broken_hook, tests.unit.test_supervisor:record_alert",
    )
    ALERTS.clear()
    state = DesiredState(1, allocate(QUEUES, 1))
    (request,) = _requests(instance, state, now=time.time())
    # A killed process, found dead by the supervisor: the first failure is a plain crash.
    run = _start(instance, request, pid=dead_pid)
    (relaunch,) = _requests(instance, state, now=time.time())
    alert_sensor_tick(instance, _status(instance, run, dg.DagsterRunStatus.FAILURE))
    (alert,) = ALERTS
    assert (alert.topology, alert.instance, alert.run_id, alert.crashes, alert.kind) == (
        NAME,
        0,
        run.run_id,
        1,
        "crash",
    )
    assert f"process {dead_pid}" in alert.message
    # Dagster's code server may report the same run failed again: still one alert.
    instance.report_run_failed(run)
    alert_sensor_tick(instance, run)
    assert len(ALERTS) == 1
    # One clear line; the broken hook is reported, and did not keep the other from running.
    logged = capfd.readouterr().err
    assert f"instance 0 of wc failed (run {run.run_id}): its process {dead_pid}" in logged
    assert "alert hook 'tests.unit.test_supervisor:broken_hook' raised RuntimeError" in logged
    # The alert fails the topology's crash check (not one more observation among the metrics).
    assert not instance.fetch_observations(topology_asset_key(NAME), limit=5).records
    key = crash_check_key(NAME)
    summary = instance.event_log_storage.get_asset_check_summary_records([key])[key]
    record = summary.last_check_execution_record
    evaluation = (
        None if record is None or record.event is None else record.event.asset_check_evaluation
    )
    assert evaluation is not None and not evaluation.passed
    assert evaluation.severity == dg.AssetCheckSeverity.ERROR
    metadata = evaluation.metadata
    assert metadata["run_id"].value == run.run_id
    assert metadata["instance"].value == "0"  # text: a label, never plotted
    assert metadata["crashes_in_window"].value == 1
    assert "process" in str(metadata["failure"].value)

    # The second consecutive failure engages the backoff: a crash-loop alert.
    second = _fail(instance, relaunch, "RuntimeError: cannot connect to the broker")
    alert_sensor_tick(instance, second)
    loop = ALERTS[-1]
    assert (loop.kind, loop.crashes, loop.run_id) == ("crash_loop", 2, second.run_id)
    assert 0 < loop.retry_in_s <= SETTINGS.backoff_base_s
    assert loop.message == "RuntimeError: cannot connect to the broker"
    assert alert_for(instance, second, time.time(), SETTINGS).kind == "crash_loop"


def test_op_errors_are_the_alert_message(instance: dg.DagsterInstance) -> None:
    @dg.op
    def explode() -> None:
        raise ValueError("the topology's source topic is gone")

    @dg.job(name="instance_job")
    def failing() -> None:
        explode()

    result = failing.execute_in_process(
        instance=instance,
        raise_on_error=False,
        tags={TOPOLOGY_TAG: NAME, INSTANCE_INDEX_TAG: "0", GENERATION_TAG: "1"},
    )
    assert not result.success
    alert = alert_for(instance, result.dagster_run, time.time(), SETTINGS)
    assert alert.message == "ValueError: the topology's source topic is gone"


# -- settings and hooks -------------------------------------------------------------------------


def test_supervisor_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAM_ASSETS_STARTUP_GRACE_S", "7")
    monkeypatch.setenv("STREAM_ASSETS_HEARTBEAT_TIMEOUT_S", "11")
    monkeypatch.setenv("STREAM_ASSETS_SUPERVISOR_INTERVAL_S", "2")
    monkeypatch.setenv("STREAM_ASSETS_BACKOFF_BASE_S", "1.5")
    monkeypatch.setenv("STREAM_ASSETS_ALERT_HOOKS", "a.b:c,d:e")
    s = SupervisorSettings()
    assert (s.startup_grace_s, s.heartbeat_timeout_s, s.interval_s) == (7.0, 11.0, 2)
    assert s.backoff_base_s == 1.5 and s.alert_hooks == ("a.b:c", "d:e")
    monkeypatch.setenv("STREAM_ASSETS_ALERT_HOOKS", "just_a_module")
    with pytest.raises(ValueError, match="must be 'module:function'"):
        SupervisorSettings()


# -- stop and start jobs ------------------------------------------------------------------------


def _job(name: str, instance: dg.DagsterInstance, **config: Any) -> dg.ExecuteInProcessResult:
    from stream_assets.definitions import defs

    op = {"stop_topology_job": "stop_topology", "start_topology_job": "start_topology"}[name]
    return defs.get_job_def(name).execute_in_process(
        run_config={"ops": {op: {"config": config}}}, instance=instance, raise_on_error=False
    )


def _error(result: dg.ExecuteInProcessResult) -> str:
    failure = next(e for e in result.all_events if e.is_step_failure)
    return str(failure.step_failure_data.error)


@pytest.fixture
def wordcount(instance: dg.DagsterInstance) -> str:
    """The registered wordcount topology, deployed with 2 instances (no runs)."""
    queues = {"sourceTopic": [0, 1, 2, 3], "wordcount__shuffle__aggregate": list(range(8))}
    DesiredStateStore(instance).set("wordcount", DesiredState(2, allocate(queues, 2)))
    return "wordcount"


def test_stop_then_start_resumes_the_same_allocation(
    instance: dg.DagsterInstance, wordcount: str, live: subprocess.Popen[bytes]
) -> None:
    store = DesiredStateStore(instance)
    before = store.get(wordcount)
    assert before is not None and before.allocation is not None
    # One instance runs; it exits by itself once it sees the topology stopped (this
    # instance's launcher cannot terminate runs).
    request = dg.RunRequest(
        run_config=instance_run_config(wordcount, 1, 0, before.allocation.for_instance(0)),
        tags={TOPOLOGY_TAG: wordcount, INSTANCE_INDEX_TAG: "0", GENERATION_TAG: "1"},
    )
    run = _start(instance, request, pid=live.pid)

    def exit_when_stopped() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = store.get(wordcount)
            if state is not None and state.target_instances == 0:
                instance.report_run_canceled(run, "stopped")
                return
            time.sleep(0.05)

    follower = threading.Thread(target=exit_when_stopped)
    follower.start()
    stopped = _job("stop_topology_job", instance, topology=wordcount, stop_timeout_s=30)
    follower.join()
    assert stopped.success, _error(stopped)
    assert store.get(wordcount) == DesiredState(0, before.allocation)
    assert _requests(instance, DesiredState(0, before.allocation), time.time()) == []

    started = _job("start_topology_job", instance, topology=wordcount, wait_s=0)
    assert started.success, _error(started)
    assert store.get(wordcount) == before  # same count, same allocation and generation
    # Starting a running topology changes nothing.
    again = _job("start_topology_job", instance, topology=wordcount, wait_s=0)
    assert again.success and store.get(wordcount) == before


def test_stop_and_start_refuse_while_a_reset_or_rebalance_runs(
    instance: dg.DagsterInstance, wordcount: str
) -> None:
    store = DesiredStateStore(instance)
    state = store.get(wordcount)
    assert state is not None
    for busy, why in (
        (DesiredState(2, state.allocation, paused=True), "supervision is paused"),
        (DesiredState(2, state.allocation, phase="warm"), "a rebalance is under way"),
    ):
        store.set(wordcount, busy)
        for job in ("stop_topology_job", "start_topology_job"):
            result = _job(job, instance, topology=wordcount)
            assert not result.success and why in _error(result), _error(result)
            assert store.get(wordcount) == busy
    unknown = _job("stop_topology_job", instance, topology="no-such-topology")
    assert "unknown topology 'no-such-topology'" in _error(unknown)
