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
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from jobs.supervisor import instance_runs
from stream_assets.control.desired_state import DesiredStateStore, heartbeats
from stream_assets.control.lineage import topic_asset_key
from stream_assets.control.registry import INSTANCE_INDEX_TAG, REGISTRY
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.settings import RocketMQSettings
from stream_assets.state.records import Delta, decode_record, is_void
from tests.integration._dagster_env import dagster_deployment
from tests.integration._engine_util import Message, final_counts, produce, read_topic, wait_until
from tests.integration._faults import RESTART_LINE
from tests.integration._load import cpu_hog

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dagster_env(
    client_settings: RocketMQSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """DAGSTER_HOME, env for the code location, a running dagster-daemon."""
    home = tmp_path_factory.mktemp("dagster_home")
    with dagster_deployment(
        home,
        client_settings.namesrv_addr,
        STREAM_ASSETS_SUPERVISOR_INTERVAL_S="3",
        STREAM_ASSETS_HEARTBEAT_TIMEOUT_S="20",
        # Up to 4 instances beside a CPU hog on 2 cores: every micro-batch has a
        # fixed cost, and a batch per second per stage leaves CPU for the work.
        STREAM_ASSETS_ENGINE_TRIGGER_INTERVAL_MS="1000",
    ) as deployment:
        yield {"home": home, "name": deployment.name, "instance": deployment.instance}


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


def _state_writers(admin: RocketMQAdmin, state_topic: str) -> dict[int, list[str]]:
    """Per state queue, the writer of each valid commit, in commit order."""
    reader = QueueReader(admin, group=f"it-dg-writers-{uuid.uuid4().hex[:6]}")
    out: dict[int, list[str]] = {}
    try:
        for queue in admin.queues(state_topic):
            writers: list[str] = []
            for record in reader.read(queue, admin.min_offset(queue)):
                decoded = decode_record(record.body)
                if is_void(decoded, record.queue_offset):
                    continue
                if isinstance(decoded, Delta) and decoded.part == 0 and decoded.meta is not None:
                    writers.append(decoded.meta.writer)
            out[queue.queue_id] = writers
    finally:
        reader.close()
    return out


# Four scales, each launching Spark JVMs beside the hog, then a kill -9 and its
# replacement: on 2 busy cores this can outlast the suite's 15-minute default.
@pytest.mark.timeout(1500)
def test_scale_in_place_1_3_2_4_under_load_keeps_counts_exact(
    dagster_env: dict[str, Any],
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    report: Any,
) -> None:
    """Every scale succeeds while input flows beside a CPU hog; surviving instances keep
    their run (in place); no queue ever has two writers at once; counts exact."""
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
    pauses: dict[str, float] = {}
    with cpu_hog(2), PacedInput(client_settings, source) as paced:
        for target in (3, 2, 4):
            before = {r.tags[INSTANCE_INDEX_TAG]: r.run_id for r in instance_runs(instance, name)}
            result = _scale(instance, target, name)
            assert result.success, _why_failed(result, instance, name)
            md = _metadata(result)
            assert md["instances_after"] == target
            pauses[f"{len(before)}->{target}"] = md["pause_s"]
            assert 0 < md["pause_s"] <= PAUSE_UNDER_LOAD_S, (
                f"{md}; query restarts per run: {_query_restarts(instance, name)}\n"
                + _why_failed(result, instance, name)
            )
            after = {r.tags[INSTANCE_INDEX_TAG]: r.run_id for r in instance_runs(instance, name)}
            assert len(after) == target
            # In place: every instance that stays keeps its run (process, SparkSession).
            for index in range(min(len(before), target)):
                assert after[str(index)] == before[str(index)], (index, before, after)
    everything += paced.sent
    with cpu_hog(2):
        # kill -9 an instance with input waiting: the supervisor relaunches exactly one
        # run for its index, and the topology catches up.
        wait_until(lambda: _drained(admin, name, [source, shuffle]), 300, "caught up", poll_s=1.0)
        victim = instance_runs(instance, name)[0]
        pid = heartbeats(instance, [victim.run_id])[victim.run_id].pid
        burst = _lines(7, 1000)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        _send(client_settings, source, burst, "k-")
        everything += burst
        wait_until(lambda: _drained(admin, name, [source, shuffle]), 600, "caught up after kill -9")
        caught_up_s = time.monotonic() - killed_at
    index = victim.tags[INSTANCE_INDEX_TAG]
    replacements = [
        r
        for r in instance_runs(instance, name)
        if r.tags[INSTANCE_INDEX_TAG] == index and r.run_id != victim.run_id
    ]
    assert len(replacements) == 1, replacements
    wait_until(
        lambda: _drained(admin, name, [source, shuffle]), 300, "every queue drained", poll_s=1.0
    )
    expected = collections.Counter(w for line in everything for w in line.split())
    wait_until(lambda: final_counts(read_topic(admin, sink)) == dict(expected), 120, "exact counts")
    # No two instances ever owned a queue at once: its writers take turns, each one
    # contiguous block of commits (a killed run's replacement is a new writer after it).
    for queue, writers in _state_writers(admin, topology.state_topics[0]).items():
        turns = [w for i, w in enumerate(writers) if i == 0 or writers[i - 1] != w]
        assert len(turns) == len(set(turns)), f"queue {queue}: writers interleave: {turns}"
    observed = instance.fetch_observations(topic_asset_key(sink), limit=5).records
    assert observed, "instances report their sink topic as asset observations"
    report(
        f"in-place scale pauses under a 2-process CPU hog: {pauses}; kill -9 of an instance "
        f"with 1000 lines arriving to caught up: {caught_up_s:.1f} s; query restarts per run "
        f"(Spark's Python worker late): {_query_restarts(instance, name) or 'none'}"
    )
