"""Dagster operations against a real Dagster instance, daemon, broker and Spark.

A temporary DAGSTER_HOME, the project's instance config, and a real
``dagster-daemon`` running the supervisor sensor over the real code location
(``stream_assets.definitions``, with a WordCount registered under a fresh name
through ``STREAM_ASSETS_TOPOLOGIES``). Instance runs are real runs launched by
the default run launcher, each with its own SparkSession. The scale job runs
in this process against the same instance.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from stream_assets.control.desired_state import DesiredStateStore, heartbeats
from stream_assets.control.lineage import topic_asset_key
from stream_assets.control.registry import INSTANCE_INDEX_TAG, REGISTRY, TOPOLOGY_TAG
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.settings import PROJECT_ROOT, RocketMQSettings
from tests.integration._engine_util import Message, final_counts, produce, read_topic, wait_until

pytestmark = pytest.mark.integration

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def dagster_env(
    client_settings: RocketMQSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """DAGSTER_HOME, env for the code location, a running dagster-daemon."""
    home = tmp_path_factory.mktemp("dagster_home")
    shutil.copy(PROJECT_ROOT / "infra" / "dagster" / "dagster.yaml", home / "dagster.yaml")
    workspace = home / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - python_module:\n      module_name: stream_assets.definitions\n"
        f"      working_directory: {PROJECT_ROOT}\n"
    )
    run_id = uuid.uuid4().hex[:8]
    env = {
        "DAGSTER_HOME": str(home),
        "STREAM_ASSETS_TOPOLOGIES": "tests.integration._dagster_topologies",
        "STREAM_ASSETS_TEST_RUN_ID": run_id,
        "STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR": client_settings.namesrv_addr,
        "STREAM_ASSETS_ENGINE_STATE_DIR": str(home / "state"),
        "STREAM_ASSETS_ENGINE_SHUFFLE_QUEUES": "4",
        "STREAM_ASSETS_ENGINE_SINK_QUEUES": "4",
        "STREAM_ASSETS_ENGINE_TRIGGER_INTERVAL_MS": "300",
        "STREAM_ASSETS_ENGINE_SPARK_CONF": json.dumps({"spark.ui.showConsoleProgress": "false"}),
        "STREAM_ASSETS_SUPERVISOR_INTERVAL_S": "3",
        "STREAM_ASSETS_HEARTBEAT_TIMEOUT_S": "20",
        "PYSPARK_PYTHON": sys.executable,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # This process imported the registry before the env was set: register here too.
    from tests.integration import _dagster_topologies as dt

    name = f"it-dg-{run_id}"
    dt.NAME = name
    REGISTRY[name] = type(dt.REGISTRATIONS[0])(name, dt.build)
    # Create the SQLite storage here, before the daemon opens the same home:
    # two processes initialising it at once can both stamp the alembic version
    # table, and every later open fails (dagster-io/dagster#27390).
    instance = dg.DagsterInstance.get()
    log = (home / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [str(VENV_BIN / "dagster-daemon"), "run", "-w", str(workspace)],
        cwd=PROJECT_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield {"home": home, "name": name, "instance": instance}
    finally:
        for run in instance.get_runs(filters=dg.RunsFilter(tags={TOPOLOGY_TAG: name})):
            if not run.is_finished:
                instance.run_coordinator.cancel_run(run.run_id)
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
        log.close()
        instance.dispose()
        REGISTRY.pop(name, None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _scale(
    instance: dg.DagsterInstance,
    target: int,
    topology: str,
    resources: dict[str, Any] | None = None,
) -> dg.ExecuteInProcessResult:
    from stream_assets.definitions import defs

    config: dict[str, Any] = {"topology": topology, "target_instances": target}
    run_config: dict[str, Any] = {"ops": {"scale": {"config": config}}}
    if resources:
        run_config["resources"] = resources
    return defs.get_job_def("scale_job").execute_in_process(
        run_config=run_config, instance=instance, raise_on_error=False
    )


def _metadata(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    outputs = [e for e in result.all_node_events if e.is_successful_output]
    assert outputs, "the scale op produced no output"
    return {k: v.value for k, v in outputs[0].step_output_data.metadata.items()}


def _lines(seed: int, count: int) -> list[str]:
    rnd = random.Random(seed)
    vocab = [f"w{i:03d}" for i in range(300)]
    return [" ".join(rnd.choices(vocab, k=6)) for _ in range(count)]


def _send(settings: RocketMQSettings, topic: str, lines: list[str], tag: str) -> None:
    messages = [
        Message("\n".join(lines[i : i + 10]).encode(), key=f"{tag}{i}")
        for i in range(0, len(lines), 10)
    ]
    produce(settings, topic, messages, threads=2)


def _instance_runs(instance: dg.DagsterInstance, name: str, status: Any) -> list[dg.DagsterRun]:
    return list(
        instance.get_runs(
            filters=dg.RunsFilter(
                job_name="instance_job", tags={TOPOLOGY_TAG: name}, statuses=[status]
            )
        )
    )


def _drained(admin: RocketMQAdmin, group: str, topics: list[str]) -> bool:
    for topic in topics:
        for q in admin.queues(topic):
            if (admin.query_consumer_offset(group, q) or 0) < admin.max_offset(q):
                return False
    return True


def test_bad_scale_requests_fail_clearly_and_change_nothing(
    dagster_env: dict[str, Any],
) -> None:
    name, instance = dagster_env["name"], dagster_env["instance"]
    store = DesiredStateStore(instance)
    before = store.get(name)
    unreachable = {"rocketmq": {"config": {"namesrv_addr": "127.0.0.1:1", "request_timeout_s": 1}}}
    cases = [
        (_scale(instance, 2, "no-such-topology"), "unknown topology 'no-such-topology'"),
        (_scale(instance, 0, name), "target_instances must be at least 1"),
        (
            _scale(instance, 1, name, resources=unreachable),
            "cannot reach RocketMQ name server at 127.0.0.1:1",
        ),
    ]
    for result, message in cases:
        assert not result.success
        failure = next(e for e in result.all_events if e.is_step_failure)
        assert message in str(failure.step_failure_data.error), failure.step_failure_data.error
    assert store.get(name) == before


def test_scale_1_3_2_with_crash_and_cancel_keeps_counts_exact(
    dagster_env: dict[str, Any], admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    name, instance = dagster_env["name"], dagster_env["instance"]
    source, sink = f"{name}-in", f"{name}-out"
    admin.create_topic(source, 4)
    topology = REGISTRY[name].topology()
    everything: list[str] = []

    def feed(seed: int, count: int) -> None:
        lines = _lines(seed, count)
        everything.extend(lines)
        _send(client_settings, source, lines, f"s{seed}-")

    feed(1, 1500)
    first = _scale(instance, 1, name)
    assert first.success, first.all_events
    md = _metadata(first)
    assert md["instances_after"] == 1 and md["runs_stopped"] == 0

    feed(2, 1500)
    out = _scale(instance, 3, name)
    assert out.success
    md = _metadata(out)
    moved = md["moves"]
    shuffle = topology.shuffle_topics[0]
    moved_shuffle = sorted(m["queue"] for m in moved if m["topic"] == shuffle)
    # Average allocation, 1 -> 3 instances of 4 shuffle queues: queues 2 and 3 move.
    assert moved_shuffle == [2, 3]
    assert sorted(r["queue"] for r in md["restores"]) == moved_shuffle
    assert md["runs_stopped"] == 1 and md["pause_s"] > 0

    feed(3, 1500)
    back = _scale(instance, 2, name)
    assert back.success
    md = _metadata(back)
    assert md["instances_after"] == 2
    assert {r["queue"] for r in md["restores"]} == {
        m["queue"] for m in md["moves"] if m["topic"] == shuffle
    }

    # kill -9 one instance's run process: the supervisor notices the silence and relaunches.
    started = _instance_runs(instance, name, dg.DagsterRunStatus.STARTED)
    assert len(started) == 2
    victim = started[0]
    beat = heartbeats(instance, [victim.run_id])[victim.run_id]
    os.kill(beat.pid, signal.SIGKILL)
    wait_until(
        lambda: instance.get_run_by_id(victim.run_id).status == dg.DagsterRunStatus.FAILURE,
        120,
        "the supervisor to mark the killed run failed",
    )
    index = victim.tags[INSTANCE_INDEX_TAG]
    wait_until(
        lambda: any(
            r.tags[INSTANCE_INDEX_TAG] == index and r.run_id != victim.run_id
            for r in _instance_runs(instance, name, dg.DagsterRunStatus.STARTED)
        ),
        240,
        "a relaunched run for the killed instance",
    )
    feed(4, 1500)

    # Cancel a running instance (one that heartbeats: past its Spark start-up) from
    # Dagster: it finishes its batch and ends CANCELED.
    def beating() -> list[dg.DagsterRun]:
        runs = _instance_runs(instance, name, dg.DagsterRunStatus.STARTED)
        beats = heartbeats(instance, [r.run_id for r in runs]) if runs else {}
        return [r for r in runs if r.run_id in beats and r.run_id != victim.run_id]

    target = wait_until(beating, 180, "a running instance")[0]
    instance.run_coordinator.cancel_run(target.run_id)
    wait_until(
        lambda: instance.get_run_by_id(target.run_id).status == dg.DagsterRunStatus.CANCELED,
        180,
        "the cancelled run to end CANCELED",
    )
    logs = [e.message for e in instance.all_logs(target.run_id)]
    assert any("instance stopped cleanly" in m for m in logs), logs[-10:]
    feed(5, 500)

    wait_until(
        lambda: _drained(admin, name, [source, shuffle]), 300, "every queue drained", poll_s=1.0
    )
    expected = collections.Counter(w for line in everything for w in line.split())
    wait_until(lambda: final_counts(read_topic(admin, sink)) == dict(expected), 120, "exact counts")
    observed = instance.fetch_observations(topic_asset_key(sink), limit=5).records
    assert observed, "instances report their sink topic as asset observations"
