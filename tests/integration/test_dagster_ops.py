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
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from stream_assets.control.desired_state import DesiredStateStore
from stream_assets.control.lineage import topic_asset_key
from stream_assets.control.registry import (
    GENERATION_TAG,
    INSTANCE_INDEX_TAG,
    REGISTRY,
    TOPOLOGY_TAG,
)
from stream_assets.jobs.supervisor import failure_message, instance_runs
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.settings import RocketMQSettings
from tests.integration._dagster_env import dagster_deployment
from tests.integration._engine_util import (
    Message,
    final_counts,
    produce,
    read_topic,
    state_writers,
    wait_until,
)
from tests.integration._faults import RESTART_LINE, arm, held_back, slow_query_start_site
from tests.integration._load import cpu_hog
from tests.integration._run_logs import run_log, spark_noise

pytestmark = pytest.mark.integration

#: How long each held query start takes (tests/integration/_faults.py): longer than
#: the deployment's heartbeat timeout (20 s), which used to get an instance killed
#: as hung in the middle of a rebalance.
SLOW_START_S = 25.0


@pytest.fixture(scope="module")
def dagster_env(
    client_settings: RocketMQSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """DAGSTER_HOME, env for the code location, a running dagster-daemon."""
    home = tmp_path_factory.mktemp("dagster_home")
    # Every process of the deployment loads a fault that can make an instance's query
    # starts slow (armed by a test; until then it does nothing).
    site, held = slow_query_start_site(home / "fault", hold_s=SLOW_START_S)
    with dagster_deployment(
        home,
        client_settings.namesrv_addr,
        PYTHONPATH=str(site),
        STREAM_ASSETS_SUPERVISOR_INTERVAL_S="3",
        STREAM_ASSETS_HEARTBEAT_TIMEOUT_S="20",
        # Up to 4 instances beside a CPU hog on 2 cores: every micro-batch has a
        # fixed cost, and a batch per second per stage leaves CPU for the work.
        STREAM_ASSETS_ENGINE_TRIGGER_INTERVAL_MS="1000",
    ) as deployment:
        yield {
            "home": home,
            "name": deployment.name,
            "instance": deployment.instance,
            "held": held,
        }


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


def _why_failed(result: dg.ExecuteInProcessResult, instance: dg.DagsterInstance, name: str) -> str:
    """The scale's failure, then the last lines of every instance run of ``name``.

    What an instance did is in its own run's logs, which a failing test run
    would otherwise lose with its temporary DAGSTER_HOME.
    """
    lines = [e.message or "" for e in result.all_events if e.is_failure]
    for run in reversed(instance_runs(instance, name, list(dg.DagsterRunStatus))[:20]):
        lines.append(f"--- instance run {run.run_id} ({run.status.value}), last lines:")
        logs = instance.all_logs(run.run_id)
        said = [e for e in logs if e.dagster_event_type != dg.DagsterEventType.ASSET_OBSERVATION]
        for entry in said[-15:]:
            at = time.strftime("%H:%M:%S", time.gmtime(entry.timestamp))
            lines.append(f"  {at} {entry.message[:300]}")
    return "\n".join(lines)


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
        (_scale(instance, -1, name), "target_instances must be 0 (stop) or more"),
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


class PacedInput:
    """Lines into the source topic every ``every_s`` until stopped: input flows while scaling."""

    def __init__(self, settings: RocketMQSettings, topic: str, every_s: float = 0.5) -> None:
        self.sent: list[str] = []
        self._settings, self._topic, self._every_s = settings, topic, every_s
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._work, daemon=True)

    def _work(self) -> None:
        seed = 100
        try:
            with Producer(self._settings) as producer:
                while not self._stop.wait(self._every_s):
                    seed += 1
                    lines = _lines(seed, 40)
                    for i in range(0, len(lines), 10):
                        body = "\n".join(lines[i : i + 10]).encode()
                        producer.send(self._topic, body, key=f"p{seed}-{i}")
                    self.sent.extend(lines)
        except BaseException as exc:
            self._errors.append(exc)

    def __enter__(self) -> PacedInput:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        if self._errors:
            raise self._errors[0]


#: Pause bound under CPU load (the idle-machine target, 10 s, is the benchmark's).
#: Under load the pause is mostly the new owners starting their queries on a starved
#: machine: 10-17 s here, even with 4 more busy processes beside the test's hog. The
#: CI machine runs this test about 2.5 times slower (its warm-ups take 135-185 s, ours
#: 55-93 s), and its 1 -> 3 pauses were 20-24 s. A handover that relaunches runs
#: instead, the behaviour this replaces, took minutes (190 s and 401 s).
PAUSE_UNDER_LOAD_S = 90.0


def _query_restarts(instance: dg.DagsterInstance, name: str) -> dict[str, int]:
    """Per instance run (``index:run id``), how often it started a stage query again
    because Spark's Python worker connected back too late."""
    out: dict[str, int] = {}
    for run in instance_runs(instance, name, list(dg.DagsterRunStatus)):
        said = sum(1 for e in instance.all_logs(run.run_id) if RESTART_LINE in (e.message or ""))
        if said:
            out[f"{run.tags[INSTANCE_INDEX_TAG]}:{run.run_id[:8]}"] = said
    return out


# Two scales, launching Spark JVMs beside the hog: on 2 busy cores this can outlast the
# suite's 15-minute default. (A kill -9 in a scale's run phase, and a queue never having
# two writers through it, are tests/integration/test_prod_like.py's.)
@pytest.mark.timeout(1500)
def test_scale_under_load_with_slow_starts_keeps_counts_exact(
    dagster_env: dict[str, Any],
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    report: Any,
) -> None:
    """Beside a CPU hog, 1 -> 3 with query starts slower than the heartbeat timeout: the
    scale completes, no instance is terminated as hung, instance 0 keeps its run (in
    place), no queue ever has two writers; counts exact."""
    name, instance = dagster_env["name"], dagster_env["instance"]
    source, sink = f"{name}-in", f"{name}-out"
    admin.create_topic(source, 4)
    topology = REGISTRY[name].topology()
    shuffle = topology.shuffle_topics[0]
    everything = _lines(1, 1500)
    _send(client_settings, source, everything, "s1-")
    first = _scale(instance, 1, name)
    assert first.success, first.all_events
    assert _metadata(first)["instances_after"] == 1
    with cpu_hog(2), PacedInput(client_settings, source) as paced:
        # 1 -> 3: the next two query starts each take longer than the heartbeat timeout.
        before = _runs_by_index(instance, name)
        arm(dagster_env["held"], 2)
        grown = _scale(instance, 3, name)
        assert grown.success, _why_failed(grown, instance, name)
        assert held_back(dagster_env["held"]) == 2, "the fault did not slow two query starts"
        md = _metadata(grown)
        assert md["instances_after"] == 3
        bound = PAUSE_UNDER_LOAD_S + 2 * SLOW_START_S
        assert 0 < md["pause_s"] <= bound, f"{md}\n" + _why_failed(grown, instance, name)
        after = _runs_by_index(instance, name)
        assert sorted(after) == ["0", "1", "2"] and after["0"] == before["0"], (before, after)
    everything += paced.sent
    # Nothing was judged hung: no run failed, none was replaced.
    failed = instance_runs(instance, name, [dg.DagsterRunStatus.FAILURE])
    assert failed == [], [(r.run_id, failure_message(instance, r.run_id)) for r in failed]
    assert sorted(
        r.run_id for r in instance_runs(instance, name, list(dg.DagsterRunStatus))
    ) == sorted(after.values())
    # Runs say which generation they serve; the scale runs which topology they changed.
    generation = md["generation"]
    for run in instance_runs(instance, name):
        assert run.tags[GENERATION_TAG] == str(generation), (run.run_id, run.tags)
    scale_run = instance.get_run_by_id(grown.run_id)
    assert scale_run is not None and scale_run.tags.get(TOPOLOGY_TAG) == name
    said = [e.user_message for e in instance.all_logs(grown.run_id)]
    assert any("phase 'run': instance 0 runs the new allocation" in m for m in said), said
    wait_until(
        lambda: _drained(admin, name, [source, shuffle]), 600, "every queue drained", poll_s=1.0
    )
    expected = collections.Counter(w for line in everything for w in line.split())
    wait_until(lambda: final_counts(read_topic(admin, sink)) == dict(expected), 120, "exact counts")
    # No two instances ever owned a queue at once: its writers take turns, each one
    # contiguous block of commits (a killed run's replacement is a new writer after it).
    for queue, writers in state_writers(admin, topology.state_topics[0]).items():
        turns = [w for i, w in enumerate(writers) if i == 0 or writers[i - 1] != w]
        assert len(turns) == len(set(turns)), f"queue {queue}: writers interleave: {turns}"
    observed = instance.fetch_observations(topic_asset_key(sink), limit=5).records
    assert observed, "instances report their sink topic as asset observations"
    # Instance 0 ran all along (a minute or more of input, a release and restart of its
    # queries) with the engine's own Spark configuration: its log is its own lines.
    messages, captured = run_log(instance, after["0"])
    assert "run_instance" in captured, captured[-2000:]
    record = instance.get_run_record_by_id(after["0"])
    assert record is not None and record.start_time is not None
    assert time.time() - record.start_time >= 60, "instance 0 ran less than a minute"
    noise = spark_noise(messages) + spark_noise(captured)
    assert not noise, f"{len(noise)} lines of Spark noise, first ones:\n" + "\n".join(noise[:40])
    report(
        f"scale under a 2-process CPU hog: 1 -> 3 with two query starts of {SLOW_START_S:.0f} s "
        f"(heartbeat timeout 20 s): pause {md['pause_s']} s, scale {md['scale_s']} s; query "
        "restarts per run (Spark's Python worker late): "
        f"{_query_restarts(instance, name) or 'none'}"
    )


def _runs_by_index(instance: dg.DagsterInstance, name: str) -> dict[str, str]:
    """The unfinished instance run of each index of ``name`` (index as tagged, run id)."""
    return {r.tags[INSTANCE_INDEX_TAG]: r.run_id for r in instance_runs(instance, name)}
