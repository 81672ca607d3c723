"""The production-shaped deployment end to end, brought up as `bash infra/dev.sh prod-like` does.

Every component real and a service of its own (stream_assets/deploy/): PostgreSQL as
Dagster's storage, the Dagster code server, webserver and daemon (not ``dg dev``), a
Spark standalone master with two workers whose disks are their own, and a RocketMQ
cluster of two broker groups (one with a slave) with ACL 2.0 on, topologies running as
a non-admin user. Under CPU load, a first ``up`` from an empty home is killed -9 once
it has started Dagster, and a second one resumes from what runs and deploys two
WordCount instances through the scale job over the webserver's GraphQL API while a
feeder process writes live input; then, still loaded, it is scaled 2 -> 3 with a kill
-9 of a staying instance in the scale's run phase, and stopped through the Dagster
storage alone (``stream-assets deploy topology-stop``). The reference answer is
``collections.Counter`` over every line the source topic holds, read back from the
brokers; the runs are read from PostgreSQL directly.

Ports are the deployment's defaults moved by 1 or 10, so a `prod-like` deployment a
developer left running is not disturbed; everything lives under a temporary home.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import dagster as dg
import psycopg2
import pytest

from stream_assets.control.desired_state import DesiredStateStore, heartbeats
from stream_assets.control.registry import INSTANCE_INDEX_TAG
from stream_assets.deploy.daemons import Daemon
from stream_assets.deploy.postgres import PostgresHost
from stream_assets.deploy.prod_like import ProdLike
from stream_assets.jobs.supervisor import instance_runs
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.settings import PROJECT_ROOT, DeploySettings, local_dir
from tests.integration._engine_util import final_counts, read_topic, state_writers, wait_until
from tests.integration._live_runs import LiveRunsPerIndex
from tests.integration._load import cpu_hog

pytestmark = [pytest.mark.integration, pytest.mark.own_deployment]

TOPOLOGY = "wordcount"
#: Supervisor ticks here (production default: 15 s).
TICK_S = 3


# Beside the defaults, so a developer's own `prod-like up` keeps running.
PORTS: dict[str, Any] = {
    "postgres_port": 25433,
    "namesrv_port": 23877,
    "broker_a_master_port": 24921,
    "broker_a_slave_port": 25921,
    "broker_b_master_port": 26921,
    "controller_port": 23879,
    "spark_master_port": 27078,
    "spark_ui_port": 28081,
    "webserver_port": 3301,
    "code_server_port": 4276,
    "metrics_port": 9650,
}


def _kill_an_up_midway(
    settings: dict[str, Any], dagster_env: dict[str, str], daemon: Daemon
) -> str:
    """Run ``up`` from the empty home in a process of its own and kill -9 it once it has
    started ``daemon``, Dagster's (Spark with it, the brokers still booting); what it
    had said."""
    spec = json.dumps({"settings": settings, "dagster_env": dagster_env}, default=str)
    up = subprocess.Popen(
        [sys.executable, "-u", "-m", "tests.integration._prod_like_up", spec],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert up.stdout is not None
    said: list[str] = []
    for line in up.stdout:
        said.append(line.rstrip())
        if line.startswith("[prod-like] postgres: up"):
            break
    wait_until(lambda: daemon.pid() is not None, 600, "the first up to start Dagster")
    up.kill()
    up.wait()
    said.extend(line.rstrip() for line in up.stdout)
    return "\n".join(said)


@pytest.fixture
def deployment(report: Any) -> Iterator[ProdLike]:
    """Two `up`s under CPU load, the first killed mid-way, the second deploying two WordCount
    instances and live input; down at the end."""
    home = local_dir() / "test-prod-like"
    shutil.rmtree(home, ignore_errors=True)
    # PostgreSQL's directory is elsewhere when its user cannot enter the checkout.
    shutil.rmtree(PostgresHost(home / "postgres", 0).home, ignore_errors=True)
    values: dict[str, Any] = {"home": home, **PORTS, "instances": 2, "feed_lines_per_s": 30}
    dagster_env = {
        "STREAM_ASSETS_SUPERVISOR_INTERVAL_S": str(TICK_S),
        # Up to 3 instances beside 12 JVMs on 2 cores: a batch a second per stage
        # leaves CPU for the instances that start.
        "STREAM_ASSETS_ENGINE_TRIGGER_INTERVAL_MS": "1000",
    }
    d = ProdLike(DeploySettings(**values), progress=lambda line: None, dagster_env=dagster_env)
    try:
        with cpu_hog(2):
            killed = _kill_an_up_midway(values, dagster_env, d.dagster.daemon)
            timings = d.up()
        asked = time.monotonic()
        status = d.status()
        status_s = time.monotonic() - asked
        # Every host serving: no host stopped or unregistered, both workers alive, and the
        # webserver, daemon, code server and feeder running.
        assert not any(w in status for w in ("stopped", "not serving", "not registered")) and (
            "2/2 workers alive" in status and status.count("running (pid") == 4
        ), f"{status}\n(the killed up said:\n{killed})"
        report(
            f"production-shaped deployment up under CPU load after a killed up in "
            f"{max(timings.values()):.0f} s: {timings}; status in {status_s:.1f} s"
        )
        yield d
    finally:
        d.down()


def _runs(instance: dg.DagsterInstance) -> dict[str, str]:
    """The unfinished instance run of each index, by index."""
    return {r.tags[INSTANCE_INDEX_TAG]: r.run_id for r in instance_runs(instance, TOPOLOGY)}


def _beating(instance: dg.DagsterInstance, want: int) -> dict[str, str] | None:
    """The runs by index once ``want`` indexes run and every one has heartbeaten."""
    runs = _runs(instance)
    beats = heartbeats(instance, runs.values())
    return runs if len(runs) == want and all(r in beats for r in runs.values()) else None


def _drained(admin: RocketMQAdmin, topics: list[str]) -> bool:
    return all(
        (admin.query_consumer_offset(TOPOLOGY, q) or 0) >= admin.max_offset(q)
        for topic in topics
        for q in admin.queues(topic)
    )


def _expected(admin: RocketMQAdmin, source: str) -> dict[str, int]:
    """collections.Counter of every word of every line the source topic holds."""
    words = collections.Counter(
        w for record in read_topic(admin, source) for w in record.body.decode().split()
    )
    return dict(words)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
        return text


def _postgres_run_ids(d: ProdLike) -> set[str]:
    """Run ids in Dagster's run storage, read from PostgreSQL itself."""
    s = d.settings
    with (
        contextlib.closing(
            psycopg2.connect(
                host=s.host,
                port=s.postgres_port,
                dbname="dagster",
                user="dagster",
                password=d.secrets["DAGSTER_PG_PASSWORD"].get_secret_value(),
            )
        ) as conn,
        conn.cursor() as cur,
    ):
        cur.execute("SELECT run_id FROM runs")
        return {row[0] for row in cur.fetchall()}


# Two `up`s (12 JVMs, 4 Python services), two scales, a replacement and a stop, under
# CPU load on 2 cores (the fixture's up counts too).
@pytest.mark.timeout(1500)
def test_deploy_scale_kill_stop_start_counts_exact_and_postgres_holds_the_runs(
    deployment: ProdLike, report: Any
) -> None:
    d = deployment
    topology = d.topology()
    source, sink = topology.source_topic, topology.sink_topics[0]
    with d.dagster.instance() as instance, RocketMQAdmin(d.admin_settings()) as admin:
        first = wait_until(lambda: _beating(instance, 2), 300, "instances 0 and 1 heartbeat")
        watch = LiveRunsPerIndex(instance, TOPOLOGY)
        watch.start()
        assert d.feeder.pid() is not None, "the feeder runs"
        # Its queues are on both broker groups, and it reads both.
        assert {q.broker_name for q in admin.queues(source)} == {"broker-a", "broker-b"}

        # 2 -> 3 under CPU load, and instance 0 (which stays) is killed -9 in the scale's
        # run phase.
        store = DesiredStateStore(instance)
        scaled: list[str] = []
        errors: list[BaseException] = []

        def scale() -> None:
            try:
                scaled.append(d.scale(3))
            except BaseException as exc:
                errors.append(exc)

        scaling = threading.Thread(target=scale)
        load = contextlib.ExitStack()
        # One busy core beside 12 JVMs and 3 instances: with two, the scale alone took
        # 340-670 s and this test a quarter of CI's hour (the up above runs with two).
        load.enter_context(cpu_hog(1))
        scale_began = time.monotonic()
        scaling.start()

        def in_run_phase() -> bool:
            state = store.get(TOPOLOGY)
            allocation = state.allocation if state is not None else None
            return bool(
                state is not None
                and state.phase == "run"
                and allocation
                and allocation.instances == 3
            )

        wait_until(
            lambda: in_run_phase() or not scaling.is_alive(), 600, "the scale's run phase", 0.1
        )
        victim = first["0"]
        os.kill(heartbeats(instance, [victim])[victim].pid, signal.SIGKILL)
        scaling.join(1200)
        scale_s = time.monotonic() - scale_began
        load.close()
        assert not errors and scaled, errors
        after = wait_until(
            lambda: (r := _beating(instance, 3)) and r["0"] != victim and r,
            600,
            "0 replaced, 1 and 2 up",
        )
        replacements = [
            r.run_id
            for r in instance_runs(instance, TOPOLOGY, list(dg.DagsterRunStatus))
            if r.tags[INSTANCE_INDEX_TAG] == "0" and r.run_id != victim
        ]
        assert replacements == [after["0"]], replacements
        killed = instance.get_run_by_id(victim)
        assert killed is not None and killed.status == dg.DagsterRunStatus.FAILURE
        # One executor each, on both workers: queues moved between machines.
        workers = (d.spark.master_state() or {}).get("workers", [])
        assert sorted(w["coresused"] for w in workers if w["state"] == "ALIVE") == [1, 2]

        # Each instance serves its metrics; lag is per queue of both groups.
        metrics = _scrape(f"http://{d.settings.host}:{d.settings.metrics_port + 1}/metrics")
        assert 'topology="wordcount"' in metrics and "stream_assets_lag_messages" in metrics

        d.feeder.stop()
        topics = [source, *topology.shuffle_topics]
        wait_until(lambda: _drained(admin, topics), 600, "every queue drained", 1.0)
        expected = _expected(admin, source)
        wait_until(
            lambda: final_counts(read_topic(admin, sink)) == expected, 120, "exact counts", 1.0
        )
        # No queue ever had two writers at once: each writer's commits are one block.
        for queue, writers in state_writers(admin, topology.state_topics[0]).items():
            turns = [w for i, w in enumerate(writers) if i == 0 or writers[i - 1] != w]
            assert len(turns) == len(set(turns)), f"queue {queue}: writers interleave: {turns}"
        most = watch.stop()
        assert most == 1, f"{most} live runs of one index at once"
        # Stop without the webserver, daemon or code server: every run ends SUCCESS and
        # the allocation is kept for a start (the start is test_supervision's and
        # tests/unit/test_cli_lifecycle.py's: a cold start costs minutes here).
        running = list(after.values())
        d.stop_topology(through_dagster=False)
        assert _runs(instance) == {}
        assert {r: instance.get_run_by_id(r).status for r in running} == dict.fromkeys(  # type: ignore[union-attr]
            running, dg.DagsterRunStatus.SUCCESS
        )
        state = store.get(TOPOLOGY)
        assert state is not None and state.target_instances == 0 and state.allocation is not None
        all_runs = {r.run_id for r in instance.get_runs()}
    assert all_runs and all_runs <= _postgres_run_ids(d)
    report(
        f"{sum(expected.values())} words over two broker groups with ACL, on 2 Spark workers: "
        f"exact through 2 -> 3 under CPU load in {scale_s:.0f} s with a kill -9 in the run "
        f"phase (at most one live run per index throughout), and a stop through the storage; "
        f"{len(all_runs)} runs in PostgreSQL"
    )
