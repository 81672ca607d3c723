"""Supervision with a real Dagster daemon, broker and Spark: kill, hang, cancel.

A temporary DAGSTER_HOME with the project's instance config and a real
``dagster-daemon`` over the real code location (a WordCount registered under a
fresh name through ``STREAM_ASSETS_TOPOLOGIES``), the supervisor and alert
sensors ticking every 2 s, and an alert hook that writes to a file. Instance
runs are real runs of the default run launcher, each with its SparkSession.
(Stop and start are proven on the production-shaped deployment:
tests/integration/test_prod_like.py.)

Every wait is for an event (a run status, a heartbeat, sensor ticks, drained
queues) with a deadline; "nothing happens" is checked over a number of
completed supervisor ticks, never over a fixed sleep.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy.exc

from stream_assets.control.desired_state import heartbeats
from stream_assets.control.liveness import process_alive
from stream_assets.control.registry import INSTANCE_INDEX_TAG, REGISTRY, TOPOLOGY_TAG
from stream_assets.control.run_launcher import ALREADY_RUNNING
from stream_assets.jobs.checks import crash_check_key
from stream_assets.jobs.control_retries import RETRIED_JOBS, RETRY_OF_TAG, topology_of
from stream_assets.jobs.supervisor import (
    crash_history,
    failure_message,
    instance_runs,
    launch_failure,
)
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.settings import RocketMQSettings, SupervisorSettings
from tests.integration._alert_hook import recorded
from tests.integration._dagster_env import (
    VENV_BIN,
    CodeServer,
    dagster_deployment,
    sensor_ticks,
    tick_times,
)
from tests.integration._engine_util import Message, final_counts, produce, read_topic, wait_until
from tests.integration._live_runs import LiveRunsPerIndex

pytestmark = pytest.mark.integration

TICK_S = 2  # the sensors' interval here
HEARTBEAT_TIMEOUT_S = 20
#: How long the restarted code server takes to load its code in the last test.
SLOW_LOAD_S = 40


@dataclass
class Env:
    """The module's Dagster home, topology and input sent so far."""

    home: Path
    name: str
    instance: dg.DagsterInstance
    code_server: CodeServer
    alerts: str
    settings: RocketMQSettings
    #: Live runs per index, counted over the whole module: never more than one.
    watch: LiveRunsPerIndex
    sent: list[str] = field(default_factory=list)

    @property
    def source(self) -> str:
        return f"{self.name}-in"

    @property
    def sink(self) -> str:
        return f"{self.name}-out"

    def feed(self, seed: int, count: int) -> None:
        """Send ``count`` random lines (10 per message) to the source topic."""
        rnd = random.Random(seed)
        vocab = [f"w{i:03d}" for i in range(300)]
        lines = [" ".join(rnd.choices(vocab, k=6)) for _ in range(count)]
        messages = [
            Message("\n".join(lines[i : i + 10]).encode(), key=f"s{seed}-{i}")
            for i in range(0, len(lines), 10)
        ]
        produce(self.settings, self.source, messages, threads=2)
        self.sent.extend(lines)

    def expected(self) -> dict[str, int]:
        return dict(collections.Counter(w for line in self.sent for w in line.split()))


@pytest.fixture(scope="module")
def env(
    client_settings: RocketMQSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    """DAGSTER_HOME, env for the code location, the source topic, a running dagster-daemon."""
    home = tmp_path_factory.mktemp("dagster_supervision")
    alerts = str(home / "alerts.jsonl")
    with dagster_deployment(
        home,
        client_settings.namesrv_addr,
        # Launches fail as home/refuse scripts them (the code server's timeout:
        # tests/integration/_faults.py); one retry 2 s later, so a refused run fails fast.
        instance_yaml=(
            "run_launcher:\n  module: tests.integration._faults\n"
            "  class: UnreachableCodeServerLauncher\n"
            f"  config: {{fault_file: {home / 'refuse'}}}\n"
            "run_queue:\n  max_user_code_failure_retries: 1\n"
            "  user_code_failure_retry_delay: 2\n"
            # Below the code server's slow load in the last test: a timeout for code
            # servers the daemon starts itself, which it no longer does.
            f"code_servers:\n  local_startup_timeout: {SLOW_LOAD_S // 2}\n"
        ),
        STREAM_ASSETS_TEST_SLOW_LOAD_FILE=str(home / "slow-load"),
        STREAM_ASSETS_SUPERVISOR_INTERVAL_S=str(TICK_S),
        STREAM_ASSETS_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S),
        STREAM_ASSETS_ALERT_HOOKS="tests.integration._alert_hook:record",
        STREAM_ASSETS_TEST_ALERT_FILE=alerts,
    ) as deployment:
        with RocketMQAdmin(client_settings) as admin:
            admin.create_topic(f"{deployment.name}-in", 4)
        watch = LiveRunsPerIndex(deployment.instance, deployment.name)
        watch.start()
        try:
            yield Env(
                home,
                deployment.name,
                deployment.instance,
                deployment.code_server,
                alerts,
                client_settings,
                watch,
            )
        finally:
            watch.stop()


# -- helpers ------------------------------------------------------------------------------------


def _job(name: str, instance: dg.DagsterInstance, **config: Any) -> dg.ExecuteInProcessResult:
    from stream_assets.definitions import defs

    op = RETRIED_JOBS[name]
    result = defs.get_job_def(name).execute_in_process(
        run_config={"ops": {op: {"config": config}}}, instance=instance, raise_on_error=False
    )
    if not result.success:
        failure = next(e for e in result.all_events if e.is_step_failure)
        pytest.fail(f"{name} failed: {failure.step_failure_data.error}")
    return result


def _runs(
    env: Env, index: int, statuses: list[dg.DagsterRunStatus] | None = None
) -> list[dg.DagsterRun]:
    return list(
        env.instance.get_runs(
            filters=dg.RunsFilter(
                job_name="instance_job",
                tags={TOPOLOGY_TAG: env.name, INSTANCE_INDEX_TAG: str(index)},
                statuses=statuses or [],
            )
        )
    )


def _unfinished(env: Env) -> list[dg.DagsterRun]:
    return instance_runs(env.instance, env.name)


def _status(env: Env, run_id: str) -> dg.DagsterRunStatus | None:
    run = env.instance.get_run_by_id(run_id)
    return run.status if run is not None else None


def _beating(env: Env, index: int, other_than: str = "") -> dg.DagsterRun | None:
    """The STARTED run of ``index`` that has heartbeat (past its Spark start-up), if any."""
    runs = [r for r in _runs(env, index, [dg.DagsterRunStatus.STARTED]) if r.run_id != other_than]
    beats = heartbeats(env.instance, [r.run_id for r in runs]) if runs else {}
    return next((r for r in runs if r.run_id in beats), None)


def _await_beating(env: Env, index: int, what: str, other_than: str = "") -> dg.DagsterRun:
    """Wait (Spark start-up included) until a run of ``index`` heartbeats; that run."""
    run = wait_until(lambda: _beating(env, index, other_than), 240, what)
    assert run is not None
    return run


def _await_ticks(env: Env, count: int, sensor: str = "supervisor_sensor") -> None:
    """Wait until ``sensor`` completed ``count`` ticks from now."""
    since = datetime.now(UTC).timestamp()
    wait_until(
        lambda: sensor_ticks(env.instance, sensor, since) >= count,
        60 + count * TICK_S * 5,
        f"{count} ticks of {sensor} (is the daemon up? see {env.home / 'daemon.log'})",
        poll_s=0.5,
    )


def _sensor_log(env: Env) -> str:
    """What the sensors logged: they run in the code server (the daemon asks it to)."""
    return (env.home / "code-server.log").read_text()


def _drained(env: Env, admin: RocketMQAdmin) -> bool:
    topology = REGISTRY[env.name].topology()
    for topic in [env.source, *topology.shuffle_topics]:
        for q in admin.queues(topic):
            if (admin.query_consumer_offset(env.name, q) or 0) < admin.max_offset(q):
                return False
    return True


def _counts_exact(env: Env, admin: RocketMQAdmin, what: str) -> None:
    wait_until(lambda: _drained(env, admin), 300, f"every queue drained ({what})", poll_s=1.0)
    wait_until(
        lambda: final_counts(read_topic(admin, env.sink)) == env.expected(),
        120,
        f"exact counts ({what})",
        poll_s=1.0,
    )


def _assert_alerted_once(env: Env, run_id: str, reason: str) -> None:
    """The hook got the alert of failed run ``run_id`` once, and the topology's crash
    check failed with it (an alert shows as a failed check)."""
    alert = wait_until(
        lambda: next((a for a in recorded(env.alerts) if a["run_id"] == run_id), None),
        60,
        "the alert hook to be called",
    )
    assert alert is not None
    assert (alert["topology"], alert["instance"]) == (env.name, 0)
    # (More than one crash if the instance failed to start before: a busy shared broker.)
    assert int(str(alert["crashes"])) >= 1 and alert["message"] == reason
    assert sum(a["run_id"] == run_id for a in recorded(env.alerts)) == 1
    history = env.instance.event_log_storage.get_asset_check_execution_history(
        crash_check_key(env.name), limit=50
    )
    alerted = [
        h.event.asset_check_evaluation
        for h in history
        if h.event is not None and h.event.asset_check_evaluation is not None
    ]
    assert any(not e.passed and e.metadata["run_id"].value == run_id for e in alerted), alerted


# -- the tests (in order: they share the topology and its input) -------------------------------


def test_a_killed_run_is_alerted_and_its_replacement_outlasts_a_silent_code_server(
    env: Env, admin: RocketMQAdmin
) -> None:
    """Deployed by the start job. A killed run is marked failed naming the cause and
    alerted once (hook and crash check); its replacement meets a code server that times
    out three times, the last time after it started the run's worker: that launch
    stands (one worker, never re-queued); none is counted as a crash. (One kill for
    all: CI time.)"""
    # Deploy through the start job: never deployed, so its registered default (1 instance).
    started = _job("start_topology_job", env.instance, topology=env.name, wait_s=600)
    assert started.success
    # The alert sensor must have ticked once: its first tick only sets its cursor.
    _await_ticks(env, 1, "instance_failure_alerts")
    env.feed(1, 1000)
    victim = _await_beating(env, 0, "instance 0 heartbeating")
    pid = heartbeats(env.instance, [victim.run_id])[victim.run_id].pid
    refuse = env.home / "refuse"
    # Refused twice (the first replacement fails), then the second's worker starts but
    # the reply times out.
    refuse.write_text("RRS")
    before = crash_history(env.instance, env.name, 0, time.time(), SupervisorSettings())
    known = {r.run_id for r in _runs(env, 0)}
    os.kill(pid, signal.SIGKILL)

    # Marked failed at once (not after a heartbeat timeout): by the supervisor, which
    # finds the process gone, or by Dagster's code server, which notices that the run
    # worker it started died, whichever looks first. The message names the cause.
    wait_until(
        lambda: _status(env, victim.run_id) == dg.DagsterRunStatus.FAILURE,
        10 * TICK_S + 20,
        "the killed run to be marked failed",
    )
    reason = failure_message(env.instance, victim.run_id)
    causes = (f"process {pid} on ", "was terminated by signal 9 (SIGKILL)")
    assert any(cause in reason for cause in causes), reason
    replacement = _await_beating(env, 0, "a replacement heartbeating", other_than=victim.run_id)
    _assert_alerted_once(env, victim.run_id, reason)
    assert refuse.read_text() == "", "the launcher did not refuse three launches"
    # Dagster's run queue retried once, then failed the first replacement; the supervisor
    # launched another, saying why, without counting it. Its launch's reply timed out
    # after its worker started: launched all the same, not re-queued.
    refused = [r for r in _runs(env, 0) if r.run_id not in known | {replacement.run_id}]
    newer = [r for r in refused if r.status == dg.DagsterRunStatus.FAILURE]
    assert len(newer) == len(refused) == 1, [(r.run_id, r.status) for r in refused]
    record = env.instance.get_run_record_by_id(newer[0].run_id)
    assert record is not None
    assert "DEADLINE_EXCEEDED" in (launch_failure(env.instance, record) or "")
    said = [e.message or "" for e in env.instance.all_logs(newer[0].run_id)]
    assert sum("re-submitting the run into the queue" in m for m in said) == 1, said
    said = [e.message or "" for e in env.instance.all_logs(replacement.run_id)]
    assert sum(m.startswith("Started process for run") for m in said) == 1, said
    assert sum(ALREADY_RUNNING in m for m in said) == 1, said
    assert not any("re-submitting" in m or "duplicate" in m for m in said), said
    after = crash_history(env.instance, env.name, 0, time.time(), SupervisorSettings())
    assert after.consecutive == before.consecutive + 1  # the kill, not the refused launch
    log = _sensor_log(env)
    assert "instance 0 could not be launched" in log and "not counted as a crash" in log
    env.feed(5, 300)
    _counts_exact(env, admin, "after the refused launches")


def test_a_hung_instance_is_terminated_before_it_is_replaced(
    env: Env, admin: RocketMQAdmin
) -> None:
    victim = _await_beating(env, 0, "instance 0 heartbeating")
    pid = heartbeats(env.instance, [victim.run_id])[victim.run_id].pid
    # Frozen: alive, silent. Past the heartbeat timeout the supervisor sends SIGTERM
    # (held while the process is stopped), then SIGKILL, and only then replaces it.
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: _status(env, victim.run_id) == dg.DagsterRunStatus.FAILURE,
            HEARTBEAT_TIMEOUT_S + 10 * TICK_S + 30,
            "the supervisor to end the hung run",
        )
    finally:
        if process_alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert not process_alive(pid), "the hung run was marked failed while its process lived"
    log = _sensor_log(env)
    assert f"process {pid} on" in log and "ignored SIGTERM" in log
    replacement = _await_beating(env, 0, "the replacement heartbeating", other_than=victim.run_id)
    assert [r.run_id for r in _unfinished(env)] == [replacement.run_id]


def _freeze_then_cancel(env: Env, run: dg.DagsterRun, pid: int, attempts: int = 5) -> None:
    """SIGSTOP the run's process, then record the run as CANCELING.

    A process frozen in the middle of writing to its run's SQLite event log
    keeps that log locked, and the cancellation's write fails after SQLite's
    busy timeout ("database is locked"). Then the process runs on until its
    next heartbeat (seconds later: the write it was frozen in, milliseconds
    long, is done), and is frozen again.
    """
    for _ in range(attempts):
        os.kill(pid, signal.SIGSTOP)
        try:
            env.instance.report_run_canceling(run)
            return
        except BaseException as exc:
            os.kill(pid, signal.SIGCONT)  # never left frozen by a failure
            if not isinstance(exc, sqlalchemy.exc.OperationalError):
                raise
            if "database is locked" not in str(exc):
                raise
        last = heartbeats(env.instance, [run.run_id])[run.run_id].ts
        wait_until(
            lambda last=last: heartbeats(env.instance, [run.run_id])[run.run_id].ts > last,
            120,
            "the run's next heartbeat, after it was frozen mid-write",
        )
    raise AssertionError(f"the run was frozen mid-write {attempts} times in a row")


def test_a_canceling_run_is_never_doubled(env: Env, admin: RocketMQAdmin) -> None:
    target = _await_beating(env, 0, "instance 0 heartbeating")
    pid = heartbeats(env.instance, [target.run_id])[target.run_id].pid
    # Frozen, the run cannot act on its cancellation: it stays CANCELING, silent,
    # its process alive, for as long as the test needs. The cancellation is the
    # status Dagster's terminate records first (the run's loop stops on it); the
    # terminate's signal to the run worker would block on the frozen process.
    _freeze_then_cancel(env, target, pid)
    try:
        assert _status(env, target.run_id) == dg.DagsterRunStatus.CANCELING
        _await_ticks(env, 3)
        assert [r.run_id for r in _unfinished(env)] == [target.run_id]
        assert _status(env, target.run_id) == dg.DagsterRunStatus.CANCELING
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(
        lambda: _status(env, target.run_id) == dg.DagsterRunStatus.CANCELED,
        180,
        "the cancelled run to finish its batch and end CANCELED",
    )
    logs = [e.message for e in env.instance.all_logs(target.run_id)]
    assert any("instance stopped cleanly" in m for m in logs), logs[-10:]
    # Then (and only then) the index is served again, by one run.
    replacement = _await_beating(env, 0, "the replacement heartbeating", other_than=target.run_id)
    assert [r.run_id for r in _unfinished(env)] == [replacement.run_id]
    env.feed(2, 500)


def test_a_run_marked_failed_while_it_serves_leaves_before_it_is_replaced(
    env: Env, admin: RocketMQAdmin
) -> None:
    """As Dagster's code server marks a run FAILURE when a duplicate worker of it exits: the
    serving process sees its status, stops cleanly and leaves; only then is the index
    launched again. No moment with two live runs of the index; the status ends true."""
    target = _await_beating(env, 0, "instance 0 heartbeating")
    pid = heartbeats(env.instance, [target.run_id])[target.run_id].pid
    env.feed(3, 500)
    known = {r.run_id for r in _runs(env, 0)}
    env.instance.report_run_failed(target)
    # While the disowned process lives, no other run of index 0 is created.
    meanwhile: set[str] = set()

    def gone() -> bool:
        alive = process_alive(pid)
        if alive:
            meanwhile.update(r.run_id for r in _runs(env, 0) if r.run_id not in known)
        return not alive

    wait_until(gone, 180, "the disowned run's process to leave", poll_s=0.2)
    assert meanwhile == set(), f"launched while the disowned run lived: {meanwhile}"
    logs = [e.message or "" for e in env.instance.all_logs(target.run_id)]
    assert any("instance stopped cleanly" in m for m in logs), logs[-10:]
    assert any("marked this run FAILURE while it ran" in m for m in logs), logs[-10:]
    assert _status(env, target.run_id) == dg.DagsterRunStatus.FAILURE
    replacement = _await_beating(env, 0, "the replacement heartbeating", other_than=target.run_id)
    assert [r.run_id for r in _unfinished(env)] == [replacement.run_id]
    assert env.watch.most == 1, f"{env.watch.most} live runs of one index at once"


def _shuffle_backlog(env: Env, admin: RocketMQAdmin) -> int:
    """Shuffle messages the topology's group has not committed, over every queue."""
    topology = REGISTRY[env.name].topology()
    return sum(
        admin.max_offset(q) - (admin.query_consumer_offset(env.name, q) or 0)
        for topic in topology.shuffle_topics
        for q in admin.queues(topic)
    )


def _launch(env: Env, job: str, **config: Any) -> None:
    """Submit ``job`` to the run queue as an operator does, through the CLI."""
    op = RETRIED_JOBS[job]
    subprocess.run(
        [
            *(str(VENV_BIN / "dagster"), "job", "launch", "-w", str(env.home / "workspace.yaml")),
            *("-j", job, "--config-json", json.dumps({"ops": {op: {"config": config}}})),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )


def _control_runs(env: Env, job: str) -> list[dg.DagsterRun]:
    """Runs of ``job`` for this module's topology, newest first."""
    runs = env.instance.get_runs(dg.RunsFilter(job_name=job))
    return [r for r in runs if topology_of(r) == env.name]


def test_a_stop_that_cannot_start_is_retried_past_a_slow_code_server_and_drains(
    env: Env, admin: RocketMQAdmin, report: Any
) -> None:
    """A drained stop is submitted right after input arrived, and Dagster cannot launch it
    (two refused calls: it fails, never started). The code server then restarts and takes
    SLOW_LOAD_S to load its code. Once it has, supervision resumes and the stop is
    launched again, saying which run it replaces; it drains (the instance stops reading
    the source and exits once the shuffle is consumed), and a start reads the rest."""
    _await_beating(env, 0, "instance 0 heartbeating")
    env.feed(8, 3000)
    refuse = env.home / "refuse"
    refuse.write_text("RR")
    _launch(env, "stop_topology_job", topology=env.name, drain=True)
    [lost] = _control_runs(env, "stop_topology_job")
    wait_until(lambda: _status(env, lost.run_id) == dg.DagsterRunStatus.FAILURE, 120, "refused")

    (env.home / "slow-load").write_text(str(SLOW_LOAD_S))
    down_at = time.time()
    env.code_server.stop()
    env.code_server.start("tests.integration._slow_definitions")
    loaded_s = env.code_server.wait_loaded()
    assert loaded_s >= SLOW_LOAD_S, loaded_s
    _await_ticks(env, 1)  # supervision resumes
    retried = wait_until(
        lambda: next(
            (r for r in _control_runs(env, "stop_topology_job") if r.status.name == "SUCCESS"),
            None,
        ),
        600,
        "the stop, launched again, to succeed",
    )
    assert retried is not None
    # Each retry names the run it replaces, back to the lost one; a retry queued while the
    # code server was down failed to start in turn and was retried.
    chain = [retried]
    while RETRY_OF_TAG in chain[-1].tags:
        chain.append(env.instance.get_run_by_id(chain[-1].tags[RETRY_OF_TAG]))  # type: ignore[arg-type]
    assert chain[-1].run_id == lost.run_id, chain
    assert all(r.status == dg.DagsterRunStatus.FAILURE for r in chain[1:]), chain
    assert "stop_topology_job run " + lost.run_id in _sensor_log(env)
    assert not _unfinished(env)
    assert _shuffle_backlog(env, admin) == 0
    source_left = sum(
        admin.max_offset(q) - (admin.query_consumer_offset(env.name, q) or 0)
        for q in admin.queues(env.source)
    )
    gap = _longest_tick_gap(env, down_at)

    _launch(env, "start_topology_job", topology=env.name, wait_s=600)
    wait_until(
        lambda: any(r.status.name == "SUCCESS" for r in _control_runs(env, "start_topology_job")),
        900,
        "the start to succeed",
    )
    _counts_exact(env, admin, "after a drained stop, retried past a slow code server, and a start")
    report(
        f"code server loaded in {loaded_s:.0f} s; the stop that could not start was retried and "
        f"drained the shuffle ({source_left} source messages left for the start); longest gap "
        f"between supervisor ticks {gap:.0f} s"
    )
    assert env.watch.samples > 0 and env.watch.most == 1, (env.watch.samples, env.watch.most)


def _longest_tick_gap(env: Env, since: float) -> float:
    """The longest time between two supervisor ticks (or ``since`` and the first) since then."""
    times = sorted([since, *tick_times(env.instance, "supervisor_sensor", since)])
    return max(b - a for a, b in itertools.pairwise(times))
