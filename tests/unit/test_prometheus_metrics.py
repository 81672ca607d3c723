"""Each instance's Prometheus endpoint, scraped over HTTP: what it serves equals what was fed.

Batches go in the way Spark hands them to the instance (``Instance._record``
with the rows ``TaskStats`` turns into), so the Dagster observations
(``StageMetrics``) and Prometheus are fed by the same call. Every expected
value is summed here from the fed stats, independently of the exporter.
No broker, no Spark: lag polls go to a fake admin, query starts are stubbed.
"""

from __future__ import annotations

import random
import socket
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from stream_assets.control.metrics import instance_numbers
from stream_assets.examples import wordcount
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import MessageQueue, QueueOffsets
from stream_assets.runtime.core.context import TaskStats
from stream_assets.runtime.drive.prometheus import (
    BATCH_SECONDS_BUCKETS,
    MetricsEndpointError,
    endpoint_port,
)
from stream_assets.runtime.spark.instance import Instance, StageMetrics
from stream_assets.settings import EngineSettings, MetricsSettings, RocketMQSettings

#: Written out here, not imported: the label names are the endpoint's contract.
QUEUE_LABELS = {"topology", "instance", "generation", "stage", "input", "topic", "queue"}
STAGE_LABELS = {"topology", "instance", "generation", "stage"}

#: Counter name (as served, with _total) -> the TaskStats field it sums.
COUNTER_FIELDS = {
    "stream_assets_records_in_total": "records_in",
    "stream_assets_records_batched_total": "batched_in",
    "stream_assets_records_out_total": "outputs",
    "stream_assets_dead_letters_total": "dead_letters",
    "stream_assets_late_records_total": "late",
    "stream_assets_state_restores_total": "restores",
    "stream_assets_state_catch_ups_total": "catch_ups",
    "stream_assets_state_restore_seconds_total": "restore_s",
}

ACCESS_KEY, SECRET_KEY = "AK-prom-test-4711", "SK-prom-test-0815"

Labels = frozenset[tuple[str, str]]


# -- helpers -----------------------------------------------------------------------------


def _topology(job: str = "wc-prom") -> Topology:
    return wordcount.build(job, f"{job}-lines", f"{job}-counts")


def _instance(
    job: str = "wc-prom", index: int = 0, generation: int = 0, **engine: Any
) -> tuple[Instance, list[str]]:
    said: list[str] = []
    rocketmq = RocketMQSettings(
        namesrv_addr="127.0.0.1:1", access_key=ACCESS_KEY, secret_key=SECRET_KEY
    )
    inst = Instance(
        _topology(job),
        rocketmq=rocketmq,
        engine=EngineSettings(metrics_host="127.0.0.1", **engine),
        generation=generation,
        progress=said.append,
        index=index,
    )
    return inst, said


def _row(stats: TaskStats, digest: str) -> dict[str, Any]:
    """The stats row a Spark task returns for ``stats`` (what ``df.collect()`` yields)."""
    stats.settings_digest = digest
    row: dict[str, Any] = stats.to_batch().to_pylist()[0]
    return row


@dataclass
class Fed:
    """What a test fed, for the expected values."""

    stats: list[tuple[int, TaskStats]]  # (generation, stats)
    seconds: dict[tuple[int, int], list[float]]  # (generation, stage) -> batch seconds


def _feed(
    inst: Instance,
    rnd: random.Random,
    batches: int,
    queues: Mapping[int, Sequence[int]],
    fed: Fed | None = None,
) -> Fed:
    """Random batches of every stage over ``queues`` (stage -> its queue ids)."""
    fed = fed or Fed([], defaultdict(list))
    digest = inst.rocketmq.digest()
    # Exact bucket bounds among them: a batch of exactly 0.5 s counts in le="0.5".
    durations = [*BATCH_SECONDS_BUCKETS[:4], 0.01, 0.7, 3.3, 42.0, 999.0]
    for _ in range(batches):
        stage = rnd.choice(sorted(queues))
        stateful = inst.topology.stages[stage].stateful
        rows = []
        for queue in rnd.sample(list(queues[stage]), rnd.randint(1, len(queues[stage]))):
            stats = TaskStats(
                stage=stage,
                queue_id=queue,
                end_offset=rnd.randint(0, 10_000),
                records_in=rnd.randint(0, 500),
                outputs=rnd.randint(0, 300) if stateful else 0,
                dead_letters=rnd.randint(0, 2),
                late=rnd.randint(0, 3) if stateful else 0,
                restores=int(stateful and rnd.random() < 0.1),
                catch_ups=int(stateful and rnd.random() < 0.2),
                restore_s=round(rnd.random(), 3) if stateful else 0.0,
                # 0 and 0: a batch that did not touch the store leaves its size as it was.
                state_keys=rnd.choice([0, rnd.randint(1, 900)]) if stateful else 0,
                state_bytes=rnd.randint(1, 10**6) if stateful else 0,
            )
            if stats.state_keys == 0:
                stats.state_bytes = 0
            fed.stats.append((inst.generation, stats))
            rows.append(_row(stats, digest))
        seconds = rnd.choice(durations)
        fed.seconds[(inst.generation, stage)].append(seconds)
        inst._record(stage, rows, seconds)
    return fed


def _scrape(url: str) -> tuple[dict[str, dict[Labels, float]], str]:
    """Every sample, by sample name, then by label set; and the raw text."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: dict[str, dict[Labels, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset(s.labels.items())
            assert labels not in samples[s.name], f"duplicate series {s.name}{s.labels}"
            samples[s.name][labels] = s.value
    return samples, text


def _queue_labels(inst: Instance, generation: int, stage: int, queue: int) -> Labels:
    st = inst.topology.stages[stage]
    return frozenset(
        {
            "topology": inst.topology.job_id,
            "instance": str(inst.index),
            "generation": str(generation),
            "stage": str(stage),
            "input": "source" if st.source is not None else "shuffle",
            "topic": st.input_topic,
            "queue": str(queue),
        }.items()
    )


def _stage_labels(inst: Instance, generation: int, stage: int) -> Labels:
    return frozenset(
        {
            "topology": inst.topology.job_id,
            "instance": str(inst.index),
            "generation": str(generation),
            "stage": str(stage),
        }.items()
    )


def _expected_counters(inst: Instance, fed: Fed) -> dict[str, dict[Labels, float]]:
    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    for generation, stats in fed.stats:
        labels = _queue_labels(inst, generation, stats.stage, stats.queue_id)
        for name, stat in COUNTER_FIELDS.items():
            out[name][labels] = out[name].get(labels, 0.0) + float(getattr(stats, stat))
    return out


def _expected_state(
    inst: Instance, fed: Fed, owned: Mapping[int, Iterable[int]] | None = None
) -> dict[Labels, tuple[int, int]]:
    """The latest non-empty size per (stage, queue), under the instance's current generation."""
    latest: dict[tuple[int, int], tuple[int, int]] = {}
    for _, stats in fed.stats:
        if stats.state_keys or stats.state_bytes:
            latest[(stats.stage, stats.queue_id)] = (stats.state_keys, stats.state_bytes)
    return {
        _queue_labels(inst, inst.generation, stage, queue): size
        for (stage, queue), size in latest.items()
        if owned is None or queue in set(owned.get(stage, ()))
    }


def _assert_counters(samples: dict[str, dict[Labels, float]], inst: Instance, fed: Fed) -> None:
    for name, series in _expected_counters(inst, fed).items():
        assert samples[name].keys() == series.keys(), name
        for labels, value in series.items():
            assert samples[name][labels] == pytest.approx(value), (name, dict(labels))


def _assert_durations(samples: dict[str, dict[Labels, float]], inst: Instance, fed: Fed) -> None:
    prefix = "stream_assets_batch_duration_seconds"
    assert {dict(k)["stage"] for k in samples[f"{prefix}_count"]} == {
        str(stage) for _, stage in fed.seconds
    }
    for (generation, stage), seconds in fed.seconds.items():
        labels = _stage_labels(inst, generation, stage)
        assert samples[f"{prefix}_count"][labels] == len(seconds)
        assert samples[f"{prefix}_sum"][labels] == pytest.approx(sum(seconds))
        for bound in (*BATCH_SECONDS_BUCKETS, float("inf")):
            le = "+Inf" if bound == float("inf") else str(bound)
            bucket = frozenset({*labels, ("le", le)})
            assert samples[f"{prefix}_bucket"][bucket] == sum(s <= bound for s in seconds), le


# -- what the endpoint serves ------------------------------------------------------------


def test_a_scrape_equals_the_sums_of_the_fed_stats_and_the_dagster_numbers() -> None:
    inst, said = _instance(index=2, generation=7, metrics_port=0)
    url = inst.prometheus.serve("127.0.0.1", 0)
    try:
        fed = _feed(inst, random.Random(20260101), 60, {0: range(4), 1: range(8)})
        samples, text = _scrape(url)
    finally:
        inst.prometheus.close()

    _assert_counters(samples, inst, fed)
    _assert_durations(samples, inst, fed)
    expected_state = _expected_state(inst, fed)
    assert expected_state, "the random batches reported no state size"
    assert samples["stream_assets_state_keys"] == {k: v[0] for k, v in expected_state.items()}
    assert samples["stream_assets_state_bytes"] == {k: v[1] for k, v in expected_state.items()}

    # Label sets: every per-queue series has exactly the queue labels, every stage series
    # the stage labels, with this instance's identity.
    for name in [*COUNTER_FIELDS, "stream_assets_state_keys", "stream_assets_state_bytes"]:
        for labels in samples[name]:
            got = dict(labels)
            assert set(got) == QUEUE_LABELS, name
            assert (got["topology"], got["instance"], got["generation"]) == ("wc-prom", "2", "7")
            assert got["input"] == ("source" if got["stage"] == "0" else "shuffle")
    for labels in samples["stream_assets_batch_duration_seconds_count"]:
        assert set(dict(labels)) == STAGE_LABELS

    # The Dagster observation's numbers (from StageMetrics) are the same counts.
    numbers = instance_numbers(
        inst.topology, {i: dict(m.totals) for i, m in inst.metrics.items()}, inst.state_size(), {}
    )

    def total(name: str, **where: str) -> float:
        return sum(
            v
            for labels, v in samples[name].items()
            if all(dict(labels)[k] == w for k, w in where.items())
        )

    assert total("stream_assets_records_in_total", input="source") == numbers.records_in
    assert total("stream_assets_records_out_total") == numbers.records_out
    assert total("stream_assets_dead_letters_total") == numbers.dead_letters
    assert total("stream_assets_late_records_total") == numbers.late
    assert total("stream_assets_state_keys") == numbers.state_keys
    assert total("stream_assets_state_bytes") == numbers.state_bytes
    # Nothing about the client settings reaches the endpoint.
    for secret in (ACCESS_KEY, SECRET_KEY, inst.rocketmq.digest(), "settings_digest"):
        assert secret not in text
    assert not any(ACCESS_KEY in line or SECRET_KEY in line for line in said)


def test_lag_is_what_the_instance_last_polled_for_the_queues_it_owns() -> None:
    inst, _ = _instance(index=1)
    source, shuffle = inst.topology.stages[0].input_topic, inst.topology.stages[1].input_topic
    inst.assignment = {source: [1, 3], shuffle: [0, 5, 6]}
    admin = FakeAdmin({source: 4, shuffle: 8}, random.Random(7))
    inst._admin_obj = admin  # type: ignore[assignment]
    url = inst.prometheus.serve("127.0.0.1", 0)
    try:
        before = time.time()
        polled = inst.lag_by_queue()
        samples, _ = _scrape(url)
    finally:
        inst.prometheus.close()

    expected = {}
    for stage, (topic, queues) in enumerate([(source, [1, 3]), (shuffle, [0, 5, 6])]):
        for q in queues:
            low, high, committed = admin.offsets[(topic, q)]
            lag = high - (low if committed is None else committed)
            expected[_queue_labels(inst, 0, stage, q)] = lag
    assert samples["stream_assets_lag_messages"] == expected
    assert sum(expected.values()) == sum(sum(qs.values()) for qs in polled.values())
    assert any(v > 0 for v in expected.values())
    [(labels, at)] = samples["stream_assets_lag_polled_timestamp_seconds"].items()
    assert dict(labels) == {"topology": "wc-prom", "instance": "1", "generation": "0"}
    assert before <= at <= time.time()


class FakeAdmin:
    """Offsets of every queue: ``(topic, queue) -> (min, max, committed or None)``."""

    def __init__(self, topics: Mapping[str, int], rnd: random.Random) -> None:
        self.offsets: dict[tuple[str, int], tuple[int, int, int | None]] = {}
        for topic, n in topics.items():
            for q in range(n):
                low = rnd.randint(0, 50)
                high = low + rnd.randint(0, 400)
                committed = rnd.choice([None, rnd.randint(low, high)])
                self.offsets[(topic, q)] = (low, high, committed)

    def queues(self, topic: str) -> list[MessageQueue]:
        return [MessageQueue(t, "broker-a", q) for t, q in sorted(self.offsets) if t == topic]

    def group_offsets(
        self, group: str, topic: str, queues: Iterable[MessageQueue]
    ) -> dict[MessageQueue, int | None]:
        return {q: self.offsets[(topic, q.queue_id)][2] for q in queues}

    def topic_offsets(
        self, topic: str, queues: Iterable[MessageQueue]
    ) -> dict[MessageQueue, QueueOffsets]:
        out = {}
        for q in queues:
            low, high, _ = self.offsets[(topic, q.queue_id)]
            out[q] = QueueOffsets(q, low, high)
        return out


class FakeQuery:
    def __init__(self, name: str, exc: str | None = None) -> None:
        self.name, self._exc = name, exc

    def exception(self) -> str | None:
        return self._exc

    def stop(self) -> None:
        pass


def test_query_restarts_are_counted_per_stage() -> None:
    inst, _ = _instance(query_per_stage=True, mode="micro-batch")
    inst._start_query = lambda stages: FakeQuery("restarted")  # type: ignore[method-assign]
    failed = "org.apache.spark.SparkException: Python worker failed to connect back."
    for _ in range(3):
        inst._queries = [FakeQuery("stage-0"), FakeQuery("stage-1", failed)]
        inst.check_failed()
    inst._queries = [FakeQuery("stage-0", failed), FakeQuery("stage-1")]
    inst.check_failed()
    assert _restarts(inst) == {_stage_labels(inst, 0, 0): 1.0, _stage_labels(inst, 0, 1): 3.0}


def test_a_restart_of_the_one_query_counts_for_every_stage_it_runs() -> None:
    inst, _ = _instance()
    inst._start_query = lambda stages: FakeQuery("restarted")  # type: ignore[method-assign]
    inst._queries = [FakeQuery("stages-0-1", "Python worker failed to connect back.")]
    inst.check_failed()
    assert _restarts(inst) == {_stage_labels(inst, 0, 0): 1.0, _stage_labels(inst, 0, 1): 1.0}


def _restarts(inst: Instance) -> Any:
    """The query restarts the instance's endpoint serves, by labels."""
    url = inst.prometheus.serve("127.0.0.1", 0)
    try:
        samples, _ = _scrape(url)
    finally:
        inst.prometheus.close()
    return samples["stream_assets_query_restarts_total"]


def test_a_rebalance_in_place_starts_the_new_generations_series_and_drops_moved_gauges() -> None:
    inst, _ = _instance(generation=3)
    source, shuffle = inst.topology.stages[0].input_topic, inst.topology.stages[1].input_topic
    inst.assignment = {source: [0, 1, 2, 3], shuffle: list(range(8))}
    inst._start_query = lambda stages: FakeQuery("stages")  # type: ignore[method-assign]
    rnd = random.Random(99)
    fed = _feed(inst, rnd, 30, {0: range(4), 1: range(8)})
    inst.prometheus.record_lag({source: {0: 5}, shuffle: {7: 2}})

    kept = {source: [1, 2], shuffle: [0, 2, 4, 6]}
    inst.reassign(kept, 4)
    fed = _feed(inst, rnd, 20, {0: kept[source], 1: kept[shuffle]}, fed)
    url = inst.prometheus.serve("127.0.0.1", 0)
    try:
        samples, _ = _scrape(url)
    finally:
        inst.prometheus.close()

    # Generation 3's counters stay as they were; generation 4's count only its own batches.
    _assert_counters(samples, inst, fed)
    _assert_durations(samples, inst, fed)
    generations = {dict(k)["generation"] for k in samples["stream_assets_records_in_total"]}
    assert generations == {"3", "4"}
    # Gauges: only the queues generation 4 owns, under generation 4.
    owned = {0: kept[source], 1: kept[shuffle]}
    expected_state = _expected_state(inst, fed, owned)
    assert samples["stream_assets_state_bytes"] == {k: v[1] for k, v in expected_state.items()}
    assert "stream_assets_lag_messages" not in samples  # not polled since the rebalance
    # The Dagster observation's state size is the same: the stores handed back are not ours.
    assert inst.state_size() == (
        sum(v[0] for v in expected_state.values()),
        sum(v[1] for v in expected_state.values()),
    )


def test_two_instances_in_one_process_serve_only_their_own_numbers() -> None:
    a, _ = _instance("wc-prom-a", index=0)
    b, _ = _instance("wc-prom-a", index=1)
    c, _ = _instance("wc-prom-c", index=0)  # another topology's instance 0
    rnd = random.Random(5)
    fed = {inst: _feed(inst, rnd, 15, {0: range(4), 1: range(8)}) for inst in (a, b, c)}
    urls = {inst: inst.prometheus.serve("127.0.0.1", 0) for inst in (a, b, c)}
    try:
        assert len(set(urls.values())) == 3
        for inst, url in urls.items():
            samples, _ = _scrape(url)
            _assert_counters(samples, inst, fed[inst])
            _assert_durations(samples, inst, fed[inst])
    finally:
        for inst in (a, b, c):
            inst.prometheus.close()
    # The process-wide default registry is left alone.
    assert not [m for m in REGISTRY.collect() if m.name.startswith("stream_assets_")]


def test_scrapes_while_batches_land_are_consistent() -> None:
    inst, _ = _instance()
    url = inst.prometheus.serve("127.0.0.1", 0)
    per_thread, threads = 150, 4

    def feed(seed: int) -> None:
        for _ in range(per_thread):
            stats = TaskStats(stage=0, queue_id=seed, records_in=2, dead_letters=1)
            inst._record(0, [_row(stats, "")], 0.2)

    workers = [threading.Thread(target=feed, args=(i,)) for i in range(threads)]
    try:
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            samples, _ = _scrape(url)
            # One snapshot: the batch count and the records of the same batches.
            count = sum(samples["stream_assets_batch_duration_seconds_count"].values())
            records = sum(samples["stream_assets_records_in_total"].values())
            assert records == 2 * count
        for w in workers:
            w.join()
        samples, _ = _scrape(url)
    finally:
        inst.prometheus.close()
    assert sum(samples["stream_assets_records_in_total"].values()) == 2 * per_thread * threads
    assert inst.metrics[0].totals["records_in"] == 2 * per_thread * threads


# -- the endpoint's port, start and stop ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_endpoint_serves_on_base_port_plus_index_and_says_where_once() -> None:
    base = _free_port()
    inst, said = _instance(index=0, metrics_port=base)
    try:
        url = inst.serve_metrics()
        assert url == f"http://127.0.0.1:{base}/metrics" == inst.metrics_url
        assert inst.serve_metrics() == url
        assert [line for line in said if url in line] == [
            f"Prometheus metrics of wc-prom instance 0: {url}"
        ]
        samples, _ = _scrape(url)
        assert "stream_assets_records_in_total" not in samples  # no batch yet: no series
    finally:
        inst.prometheus.close()
    assert inst.metrics_url is None
    # Closed: the process's next instance with this index has the port.
    again, _ = _instance(index=0, metrics_port=base)
    try:
        assert again.serve_metrics() == url
    finally:
        again.prometheus.close()


def test_a_port_in_use_names_the_port_and_the_settings_and_the_instance_goes_on() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        inst, said = _instance(index=1, metrics_port=port - 1)
        assert inst.serve_metrics() is None
        assert inst.metrics_url is None
    [warning] = said
    assert warning.startswith("warning: no Prometheus endpoint for wc-prom instance 1")
    assert f"127.0.0.1:{port}" in warning
    assert "STREAM_ASSETS_ENGINE_METRICS_PORTS" in warning
    assert "STREAM_ASSETS_ENGINE_METRICS_PORT=0" in warning
    # Still counting for the Dagster observations and for a later endpoint.
    inst._record(0, [_row(TaskStats(stage=0, queue_id=0, records_in=3), "")], 0.1)
    assert inst.metrics[0].totals["records_in"] == 3
    url = inst.prometheus.serve("127.0.0.1", 0)
    try:
        samples, _ = _scrape(url)
    finally:
        inst.prometheus.close()
    assert sum(samples["stream_assets_records_in_total"].values()) == 3


def test_port_zero_turns_the_endpoint_off() -> None:
    inst, said = _instance(metrics_port=0)
    assert inst.serve_metrics() is None and said == []
    inst, said = _instance(metrics_port=9450, metrics_ports={"wc-prom": 0})
    assert inst.serve_metrics() is None and said == []


def test_endpoint_ports_per_topology_and_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = EngineSettings()
    assert engine.metrics_port == 9450 and engine.metrics_host == "0.0.0.0"
    assert [endpoint_port(engine, "wordcount", i) for i in range(3)] == [9450, 9451, 9452]
    monkeypatch.setenv("STREAM_ASSETS_ENGINE_METRICS_PORT", "19000")
    monkeypatch.setenv("STREAM_ASSETS_ENGINE_METRICS_PORTS", '{"clicks": 19500, "quiet": 0}')
    engine = EngineSettings()
    assert endpoint_port(engine, "wordcount", 3) == 19003
    assert endpoint_port(engine, "clicks", 3) == 19503
    assert endpoint_port(engine, "quiet", 3) is None
    with pytest.raises(MetricsEndpointError, match=r"65530 \+ 7 = 65537.*METRICS_PORT"):
        endpoint_port(EngineSettings(metrics_port=65530), "wordcount", 7)
    monkeypatch.setenv("STREAM_ASSETS_ENGINE_METRICS_PORT", "70000")
    with pytest.raises(ValidationError, match="metrics_port"):
        EngineSettings()


# -- the URL in the Dagster observation --------------------------------------------------


class _Context:
    """What ``_observe`` uses of an op's context: its run id and the instance's runless
    events (an instance's observations are runless, labelled with the run)."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.run_id = "run-1"
        self.instance = self

    def report_runless_asset_event(self, event: Any) -> None:
        self.events.append(event)


class _Observed:
    """What ``_observe`` reads of an Instance."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.generation = 2
        self.metrics = {s.index: StageMetrics() for s in topology.stages}

    def state_size(self) -> tuple[int, int]:
        return 0, 0


def test_the_instance_observation_carries_the_endpoint_url() -> None:
    from stream_assets.jobs.instance_job import InstanceConfig, _observe

    config = InstanceConfig(topology="wc-prom", instance_index=1)
    context, observed = _Context(), _Observed(_topology())
    url = "http://host-7:9451/metrics"
    window_s = MetricsSettings().rate_window_s
    _observe(context, config, observed, {}, window_s, url)  # type: ignore[arg-type]
    _observe(context, config, observed, {}, window_s)  # type: ignore[arg-type]
    with_url, without = (e.metadata for e in context.events)
    assert with_url["instance_1.metrics_url"].value == url
    assert "instance_1.metrics_url" not in without
    assert with_url["run"].value == without["run"].value == "run-1"
