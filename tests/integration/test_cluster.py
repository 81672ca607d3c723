"""Stateful topologies on a real two-machine Spark cluster: results do not depend on the executor.

A standalone master and two workers run from the venv's PySpark; each worker has
its own ``SPARK_LOCAL_DIRS``, so neither executor can see the other's RocksDB
(two machines). The instance runs as a driver process of its own
(``_driver_process``) against that master, with its settings given in its spec
only, while every executor's environment holds *wrong* client settings
(``spark.executorEnv``): a task that read its environment would reach no broker.

References are computed from the generated input with plain Python; the state
topic is read back raw to check that each queue's valid history is one strictly
increasing sequence of commits (compare-and-append: no interleaved writers).
"""

from __future__ import annotations

import collections
import importlib
import json
import random
import re
import sys
import textwrap
import uuid
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest

from stream_assets.examples import ad_join, word_histogram, wordcount_arrow
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.runtime.core.shuffle_codec import encode_key
from stream_assets.settings import RocketMQSettings
from stream_assets.state.records import Delta, decode_record, is_void
from tests.consumer_rule import plain_copies, plain_counts, plain_windows
from tests.event_time_reference import Queues, window_join
from tests.integration._cluster import SparkCluster, spark_cluster  # noqa: F401
from tests.integration._driver_process import DriverProcess
from tests.integration._engine_util import (
    BackgroundProducer,
    Message,
    final_counts,
    produce,
    produce_per_queue,
    read_topic,
    unique,
    wait_until,
)

pytestmark = pytest.mark.integration

CATCH_UP_S = 300.0
#: What every executor's environment says: a name server nobody listens on, no retries.
POISONED_EXECUTOR_ENV = {
    "spark.executorEnv.STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR": "127.0.0.1:1",
    "spark.executorEnv.STREAM_ASSETS_ROCKETMQ_SEND_RETRIES": "0",
    "spark.executorEnv.STREAM_ASSETS_ROCKETMQ_REQUEST_TIMEOUT_S": "0.2",
}


def _driver_settings(client_settings: RocketMQSettings) -> RocketMQSettings:
    """Client settings given to the driver only: not the defaults, not the environment's."""
    return RocketMQSettings.model_validate(
        {
            **json.loads(client_settings.revealed_json()),
            "request_timeout_s": 4.5,
            "send_retries": 5,
            "producer_group": f"it-cluster-{uuid.uuid4().hex[:6]}",
        }
    )


def _spec(
    cluster: SparkCluster,
    settings: RocketMQSettings,
    topology: str,
    kwargs: dict[str, Any],
    sys_path: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "topology": topology,
        "topology_kwargs": kwargs,
        "sys_path": sys_path or [],
        "rocketmq": json.loads(settings.revealed_json()),
        "engine": {
            "spark_master": cluster.master_url,
            "spark_conf": {**cluster.spark_conf(), **POISONED_EXECUTOR_ENV},
            # state_dir unset: each executor keeps state on its own worker's disk.
            "shuffle_queues": 4,
            "sink_queues": 4,
            "trigger_interval_ms": 300,
            "tick_ms": 500,
            "snapshot_every": 8,
        },
    }


def _state_histories(admin: RocketMQAdmin, state_topic: str) -> dict[str, dict[str, Any]]:
    """Per state queue (``broker:id``): the seqs of its valid deltas in offset order,
    writers, void count."""
    reader = QueueReader(admin, group=unique("it-cluster-state"))
    out: dict[str, dict[str, Any]] = {}
    try:
        for queue in admin.queues(state_topic):
            seqs: list[int] = []
            writers: set[str] = set()
            voids = 0
            for record in reader.read(queue, admin.min_offset(queue)):
                decoded = decode_record(record.body)
                if is_void(decoded, record.queue_offset):
                    voids += 1
                    continue
                if isinstance(decoded, Delta) and decoded.part == 0:
                    seqs.append(decoded.seq)
                    if decoded.meta is not None:
                        writers.add(decoded.meta.writer)
            out[f"{queue.broker_name}:{queue.queue_id}"] = {
                "seqs": seqs,
                "writers": writers,
                "voids": voids,
            }
    finally:
        reader.close()
    return out


def _assert_one_history_per_queue(admin: RocketMQAdmin, state_topic: str) -> int:
    """Every queue's valid deltas are seq 1, 2, 3, ... from one writer; returns void records."""
    histories = _state_histories(admin, state_topic)
    assert any(h["seqs"] for h in histories.values()), "no state was written at all"
    for queue_id, history in histories.items():
        seqs = history["seqs"]
        assert seqs == list(range(1, len(seqs) + 1)), (
            f"{state_topic}[{queue_id}]: valid commits are not one strictly increasing "
            f"sequence: {seqs}"
        )
        assert len(history["writers"]) <= 1, f"{state_topic}[{queue_id}]: {history['writers']}"
    return sum(h["voids"] for h in histories.values())


def _lines(rnd: random.Random, count: int) -> list[str]:
    vocab = [f"w{i:03d}" for i in range(500)]
    return [" ".join(rnd.choices(vocab, k=8)) for _ in range(count)]


def _messages(lines: list[str], tag: str) -> list[Message]:
    return [
        Message("\n".join(lines[i : i + 20]).encode(), key=f"{tag}-{i}")
        for i in range(0, len(lines), 20)
    ]


#: The real-time mode on the cluster, with an interval longer than the whole test: the
#: task Spark retries after its worker died finds a slot, and the worker's queues go on
#: on the one left, only because the driver sees the task fail and the slots fall and
#: ends the interval (``watch_interval``). The second key_by test below runs with the
#: default interval.
REAL_TIME = {"mode": "real-time", "interval_ms": 3_600_000, "step_max_records": 500}


def test_vectorised_wordcount_on_two_workers_with_a_worker_killed_mid_stream_counts_exactly(
    spark_cluster: SparkCluster,  # noqa: F811
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    """The vectorised WordCount (batch operators, counted a batch at a time) in real-time
    mode, its sink exactly once: the worker dies mid-interval, its task's steps half done
    (some perhaps between their delta and the end of their transaction). A plain reader
    of the sink sees each count once, in order. A worker killed in the other tests:
    the second key_by stage below (the default, real-time mode), and the processors
    over two broker groups (test_multi_broker.py, micro-batch); the per-record
    WordCount runs on this cluster in the production-shaped test."""
    job = unique("it-cwc")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 4)
    settings = _driver_settings(client_settings)
    rnd = random.Random(41)
    waves = [_lines(rnd, 8_000) for _ in range(3)]
    spec = _spec(
        spark_cluster,
        settings,
        "stream_assets.examples.wordcount_arrow:build",
        {"job_id": job, "source": source, "sink": sink, "exactly_once": True},
    )
    spec["engine"].update(REAL_TIME)
    with DriverProcess(spec, log_dir=tmp_path / "driver") as driver:  # starts it
        driver.wait_started(240)
        produce(settings, source, _messages(waves[0], "a"), threads=2)
        driver.await_caught_up(CATCH_UP_S)
        # Wave 2 arrives and worker 0 dies while the stages work on it: Spark
        # reruns its tasks on worker 1, whose RocksDB for those queues is stale.
        produce(settings, source, _messages(waves[1], "b"), threads=2)
        killed = spark_cluster.kill_worker(0)
        assert killed, "worker 0 had no processes to kill"
        spark_cluster.wait_ready(workers=1, timeout_s=60)
        driver.await_caught_up(CATCH_UP_S)
        # Worker 0 comes back with its old, now stale, state directory.
        spark_cluster.start_worker(0)
        spark_cluster.wait_ready(workers=2, timeout_s=120)
        produce(settings, source, _messages(waves[2], "c"), threads=2)
        driver.await_caught_up(CATCH_UP_S)
        expected = collections.Counter(w for wave in waves for line in wave for w in line.split())
        # A step killed between its delta and its commit, and never followed by one of its
        # queue with results, is committed by the broker's check-back: this driver answers.
        wait_until(
            lambda: final_counts(read_topic(admin, sink)) == dict(expected), 120, "every count"
        )
        metrics = driver.stop(180)["metrics"]

    assert plain_counts(read_topic(admin, sink)) == dict(expected)
    # Every task used the driver's settings (the executors' environment is wrong).
    for stage in ("0", "1"):
        assert metrics[stage]["settings_digests"] == [settings.digest()], metrics[stage]
    # Steps went the batch way (plain words, and a new group pre-combines from its first
    # offset), but a step redone after the worker died goes per record below the end its
    # first attempt planned (that attempt may have sent combined messages cut elsewhere).
    stage0 = metrics["0"]["totals"]
    assert 0 < stage0["batched_in"] <= stage0["records_in"]
    (state_topic,) = wordcount_arrow.build(job, source, sink).state_topics
    voids = _assert_one_history_per_queue(admin, state_topic)
    what = "vectorised wordcount (real-time), worker 0 killed mid-stream"
    _report_state_costs(report, what, metrics["1"], voids)


USER_PACKAGE = '''
"""A user's topology package that only the driver has on its sys.path."""

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.windows import Time, TumblingWindow

from .fields import describe, event_time, parse, the_key


def build(job_id, source, sink, idle_timeout_s, copies):
    builder = StreamBuilder(job_id, exactly_once_sinks=True)
    events = builder.source(source, parse).select_timestamp(event_time)
    events.sink(copies)
    windows = (
        events.key_by(the_key)
        .window(TumblingWindow.of(Time.seconds(10)))
        .sum("value", "sum")
        .water_mark(5)
        .idle_timeout(idle_timeout_s)
        .to_rstream()
    )
    windows.sink(sink)
    windows.map(describe).print()
    return builder.build()
'''

#: ``HELPERS`` is replaced by the name of a package beside the user's (not installed,
#: not a subpackage): only the driver has it, so it is shipped because fields imports it.
USER_FIELDS = """
import json

from HELPERS.keys import key_of


def parse(body):
    event = json.loads(body)
    # A user's print() in a task: reaches the instance's stdout, in order per queue.
    print(f"{__name__} parsed q{event['q']} #{event['n']}")
    return event


def event_time(event):
    return event["ts"]


def the_key(event):
    return key_of(event)


def describe(result):
    return f"{__name__} window {result['key']} {result['window_start']} {result['sum']}"
"""

#: The helper package; ``UTIL`` (a single-file module, imported only inside the
#: function, so the driver never imports it) is shipped because keys imports it.
USER_HELPER_KEYS = """
def key_of(event):
    from UTIL import field

    return field(event, "key")
"""

USER_UTIL = """
def field(event, name):
    return event[name]
"""

BASE_TS = 1_700_000_000_000  # window-aligned (multiple of 10 s)
WAVE_MS = 30_000  # three 10 s windows per wave


def _copied_event(body: bytes) -> tuple[int, int]:
    event = json.loads(body)
    return event["q"], event["n"]


def _wave_events(rnd: random.Random, wave: int, queues: int) -> dict[int, list[dict[str, Any]]]:
    """Per source queue, events of one wave in event-time order (within 3 s jitter)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for q in range(queues):
        events = []
        for i in range(150):
            ts = BASE_TS + wave * WAVE_MS + i * (WAVE_MS // 150)
            ts = max(BASE_TS + wave * WAVE_MS, ts - rnd.randint(0, 3_000))
            events.append({"key": f"k{rnd.randint(0, 7)}", "value": rnd.randint(1, 50), "ts": ts})
        out[q] = events
    return out


def test_windowed_sum_from_a_user_package_on_two_workers_fires_each_window_once(
    spark_cluster: SparkCluster,  # noqa: F811
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    """A windowed sum from a user's package that only the driver has, its sink exactly
    once, on the 2-worker cluster: a plain consumer sees each window once, with the
    reference's sum, and each event's copy (an exactly-once sink before the aggregate,
    its step log's queues on either worker's disk) once, in order per source queue; what
    the tasks printed reached the driver."""
    package = f"ituser_{uuid.uuid4().hex[:8]}"
    helpers, util = f"{package}_helpers", f"{package}_util"
    user_src = tmp_path / "user-src"
    (user_src / package).mkdir(parents=True)
    (user_src / package / "__init__.py").write_text(textwrap.dedent(USER_PACKAGE))
    (user_src / package / "fields.py").write_text(
        textwrap.dedent(USER_FIELDS).replace("HELPERS", helpers)
    )
    (user_src / helpers).mkdir()
    (user_src / helpers / "__init__.py").write_text("")
    (user_src / helpers / "keys.py").write_text(
        textwrap.dedent(USER_HELPER_KEYS).replace("UTIL", util)
    )
    (user_src / f"{util}.py").write_text(textwrap.dedent(USER_UTIL))
    job = unique("it-cws")
    source, sink, copies = f"{job}-src", f"{job}-out", f"{job}-copies"
    admin.create_topic(source, 2)
    settings = _driver_settings(client_settings)
    rnd = random.Random(43)
    spec = _spec(
        spark_cluster,
        settings,
        f"{package}:build",
        {"job_id": job, "source": source, "sink": sink, "idle_timeout_s": 3, "copies": copies},
        sys_path=[str(user_src)],
    )
    reference: dict[tuple[str, int, int], int] = collections.defaultdict(int)
    sent: list[list[tuple[int, int]]] = [[], []]  # per source queue: (q, n) in order
    with DriverProcess(spec, log_dir=tmp_path / "driver") as driver:  # starts it
        driver.wait_started(240)
        for wave in range(3):
            per_queue = _wave_events(rnd, wave, queues=2)
            for q, events in per_queue.items():
                for i, e in enumerate(events):
                    e["q"], e["n"] = q, wave * len(events) + i  # what parse() prints
                    sent[q].append((q, e["n"]))
                for e in events:
                    start = e["ts"] - (e["ts"] - BASE_TS) % 10_000
                    reference[(e["key"], start, start + 10_000)] += e["value"]
            produce_per_queue(
                settings,
                source,
                {q: [json.dumps(e).encode() for e in evs] for q, evs in per_queue.items()},
            )

            # The wave's last windows fire when both source queues are idle by offsets.
            def wave_fired(n: int = len(reference)) -> bool:
                return len(plain_windows(read_topic(admin, sink))) >= n

            wait_until(
                wave_fired,
                CATCH_UP_S,
                f"the windows of wave {wave}",
                poll_s=1.0,
            )
        metrics = driver.stop(180)["metrics"]

    assert plain_windows(read_topic(admin, sink)) == dict(reference)
    wait_until(lambda: len(read_topic(admin, copies)) >= 2 * 3 * 150, 120, "every copy")
    plain_copies(read_topic(admin, copies), sent, lambda r: _copied_event(r.body))
    _assert_printed_on_the_driver(spark_cluster, driver.stderr_path, package, reference, 3 * 150)
    assert metrics["1"]["totals"]["late"] == 0
    for stage in ("0", "1"):
        assert metrics[stage]["settings_digests"] == [settings.digest()], metrics[stage]
    sys.path.insert(0, str(user_src))
    try:
        topology = importlib.import_module(package).build(job, source, sink, 3, copies)
    finally:
        sys.path.remove(str(user_src))
    # The copies' step log and the sum's state: each queue one history.
    voids = sum(_assert_one_history_per_queue(admin, t) for t in topology.state_topics)
    _report_state_costs(report, f"windowed sum from {package}", metrics["1"], voids)


def _assert_printed_on_the_driver(
    cluster: SparkCluster,
    driver_log: Path,
    package: str,
    reference: dict[tuple[str, int, int], int],
    per_queue: int,
) -> None:
    """The closure of the user's modules was shipped, and what its tasks printed (a
    user's print(), a Print operator) reached the driver's stdout, in order per queue.

    The driver process sends its stdout to this log (tests/integration/_driver_process).
    Without the engine carrying them back, these lines would be in the executors' own
    stderr files on the workers, never in the driver's.
    """
    log = driver_log.read_text(errors="replace")
    helpers, util = f"{package}_helpers", f"{package}_util"
    shipping = [line for line in log.splitlines() if "shipping topology modules" in line]
    assert shipping and all(name in shipping[0] for name in (package, helpers, util)), shipping
    parsed: dict[int, list[int]] = collections.defaultdict(list)
    for q, n in re.findall(rf"^{package}\.fields parsed q(\d+) #(\d+)$", log, re.MULTILINE):
        parsed[int(q)].append(int(n))
    for q in (0, 1):
        # Print is at-least-once: a replayed batch may print again, after what it printed.
        assert list(dict.fromkeys(parsed[q])) == list(range(per_queue)), f"queue {q}"
    windows = re.findall(rf"^{package}\.fields window (\S+) (\d+) (\d+)$", log, re.MULTILINE)
    assert set(windows) == {(k, str(start), str(s)) for (k, start, _), s in reference.items()}
    executor_logs = [path for i in (0, 1) for path in cluster.worker_dir(i).glob("work/*/*/stderr")]
    assert executor_logs
    for path in executor_logs:
        assert f"{package}.fields" not in path.read_text(errors="replace"), path


def ad_join_case(
    seed: int, queues: int, window_ms: int
) -> tuple[
    dict[int, list[dict[str, Any]]],
    dict[int, list[dict[str, Any]]],
    collections.Counter[tuple[Any, ...]],
]:
    """Impressions and clicks per source queue, in time order but for a jitter below the
    5 s lateness, and the left join's reference: (ad, user, shown_at, clicked_at or None)."""
    rnd = random.Random(seed)
    ads, users = [f"ad{i}" for i in range(5)], [f"u{i}" for i in range(8)]

    def events(count: int, step_ms: int) -> dict[int, list[dict[str, Any]]]:
        out: dict[int, list[dict[str, Any]]] = {q: [] for q in range(queues)}
        for i in range(count):
            ts = BASE_TS + i * step_ms - rnd.randint(0, 2_000)
            out[i % queues].append({"ad": rnd.choice(ads), "user": rnd.choice(users), "ts": ts})
        return out

    impressions, clicks = events(600, 100), events(200, 300)
    clicks_at: dict[tuple[str, str, int], list[int]] = collections.defaultdict(list)
    for c in (c for q in clicks.values() for c in q):
        clicks_at[(c["ad"], c["user"], c["ts"] - c["ts"] % window_ms)].append(c["ts"])
    expected: collections.Counter[tuple[Any, ...]] = collections.Counter()
    for imp in (i for q in impressions.values() for i in q):
        matches = clicks_at.get((imp["ad"], imp["user"], imp["ts"] - imp["ts"] % window_ms), [])
        unmatched: list[int | None] = [None]
        for at in matches or unmatched:
            expected[(imp["ad"], imp["user"], imp["ts"], at)] += 1
    return impressions, clicks, expected


def ad_join_results(admin: RocketMQAdmin, sink: str) -> collections.Counter[tuple[Any, ...]]:
    """The join's results in ``sink``, the last copy under each de-duplication key."""
    seen = {r.keys[-1]: json.loads(r.body) for r in read_topic(admin, sink)}
    return collections.Counter(
        (v["ad"], v["user"], v["shown_at"], v["clicked_at"]) for v in seen.values()
    )


def _report_state_costs(report: Any, what: str, stage: dict[str, Any], voids: int) -> None:
    totals, tasks = stage["totals"], max(1, stage["tasks"])
    report(
        f"{what}: {tasks} stateful queue tasks in {stage['batches']} batches, "
        f"{int(totals['restores'])} restored in full ({100 * totals['restores'] / tasks:.1f} %), "
        f"{int(totals['catch_ups'])} caught up on another executor's deltas "
        f"({100 * totals['catch_ups'] / tasks:.1f} %); "
        f"currency check {1000 * totals['currency_s'] / tasks:.1f} ms per task, restores and "
        f"catch-ups {totals['restore_s']:.2f} s in all; "
        f"{voids} void state records"
    )


def test_a_second_key_by_stage_on_two_workers_with_a_worker_killed_counts_exactly(
    spark_cluster: SparkCluster,  # noqa: F811
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    """Windowed word counts feed a second key_by through the outbox: exactly once, whichever
    executor runs a queue, with an executor lost mid-stream."""
    job = unique("it-chist")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 4)
    settings = _driver_settings(client_settings)
    lines = _lines(random.Random(47), 12_000)
    spec = _spec(
        spark_cluster,
        settings,
        "stream_assets.examples.word_histogram:build",
        {"job_id": job, "source": source, "sink": sink, "window_s": 60, "idle_timeout_s": 3},
    )
    with DriverProcess(spec, log_dir=tmp_path / "driver") as driver:  # starts it
        driver.wait_started(240)
        # One producer thread: each queue's born times (the event time) only grow, so
        # no record is late and every window fires once, when the sources go idle.
        produce(settings, source, _messages(lines, "h"))
        killed = spark_cluster.kill_worker(0)
        assert killed, "worker 0 had no processes to kill"
        spark_cluster.wait_ready(workers=1, timeout_s=60)
        # Windows are counted by the born time the broker stored with each message.
        per_window: collections.Counter[tuple[str, int]] = collections.Counter()
        for record in read_topic(admin, source):
            start = record.born_timestamp - record.born_timestamp % 60_000
            per_window.update((w, start) for w in record.body.decode().split())
        expected = collections.Counter(per_window.values())
        spark_cluster.start_worker(0)
        spark_cluster.wait_ready(workers=2, timeout_s=120)

        def histogram() -> dict[Any, Any]:
            return final_counts(read_topic(admin, sink), field="words")

        wait_until(lambda: histogram() == dict(expected), CATCH_UP_S, "the histogram", poll_s=1.0)
        driver.await_caught_up(CATCH_UP_S)
        metrics = driver.stop(180)["metrics"]

    assert histogram() == dict(expected)
    assert metrics["1"]["totals"]["late"] == 0
    for stage in ("0", "1", "2"):
        assert metrics[stage]["settings_digests"] == [settings.digest()], metrics[stage]
    voids = 0
    for state_topic in word_histogram.build(job, source, sink).state_topics:
        voids += _assert_one_history_per_queue(admin, state_topic)
    _report_state_costs(report, "word histogram (two keyed stages)", metrics["2"], voids)


HOUR_MS = 3_600_000
JOIN_LATENESS_MS = 5_000  # ad_join's water_mark
SHUFFLE_QUEUES = 4  # _spec's


def _ad_route(event: dict[str, Any]) -> int:
    """The shuffle queue of an ad-join event (ad_join keys by ``[ad, user]``)."""
    return queue_for_key(encode_key([event["ad"], event["user"]]), SHUFFLE_QUEUES)


def _with_hour_late(
    rnd: random.Random, per_queue: dict[int, list[dict[str, Any]]], side: str
) -> None:
    """Ids for the reference, and hour-late events among the on-time ones: about one in
    ten, and each queue's second, with an (ad, user) whose shuffle queue the queue's
    first event did not go to, so only a progress mark tells that stateful queue."""
    pairs = sorted({(e["ad"], e["user"]) for events in per_queue.values() for e in events})
    for q, events in per_queue.items():
        for i, e in enumerate(events):
            e["id"] = f"{side}{q}.{i}"
            if i == 1:
                e["ad"], e["user"] = rnd.choice(
                    [
                        (ad, user)
                        for ad, user in pairs
                        if _ad_route({"ad": ad, "user": user}) != _ad_route(events[0])
                    ]
                )
                e["ts"] -= HOUR_MS
            elif i > 1 and rnd.random() < 0.1:
                e["ts"] -= HOUR_MS + rnd.randint(0, 30_000)


def stored_ad_events(admin: RocketMQAdmin, topic: str) -> Queues:
    """A topic's events per queue (of every broker group) in offset order (the order the
    engine read), keyed by (ad, user) for the reference."""
    reader = QueueReader(admin, group=unique("it-ad-events"))
    try:
        out: dict[Hashable, list[dict[str, Any]]] = {}
        for queue in admin.queues(topic):
            out[queue] = [json.loads(r.body) for r in reader.read(queue, 0)]
            for event in out[queue]:
                event["key"] = (event["ad"], event["user"])
        return out
    finally:
        reader.close()


def ad_join_reference(
    shown: Queues, clicked: Queues, window_ms: int
) -> tuple[collections.Counter[tuple[Any, ...]], list[dict[str, Any]]]:
    """The left join's results (as :func:`ad_join_results` reads them) and its late
    events, from what the two topics hold (:func:`stored_ad_events`)."""
    pairs, late = window_join(shown, clicked, window_ms, JOIN_LATENESS_MS, "left")
    by_id = {e["id"]: e for q in (shown, clicked) for evs in q.values() for e in evs}
    expected = collections.Counter(
        (
            by_id[i]["ad"],
            by_id[i]["user"],
            by_id[i]["ts"],
            None if c is None else by_id[c]["ts"],
        )
        for i, c in pairs
    )
    return expected, late


def _unseen_route_lates(queues: Queues, late: list[dict[str, Any]]) -> int:
    """Late events whose queue sent nothing before them to their key's shuffle queue."""
    late_ids = {id(e) for e in late}
    count = 0
    for events in queues.values():
        reached: set[int] = set()
        for e in events:
            count += id(e) in late_ids and _ad_route(e) not in reached
            reached.add(_ad_route(e))
    return count


def test_a_windowed_left_join_of_two_topics_on_two_workers_equals_the_reference(
    spark_cluster: SparkCluster,  # noqa: F811
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    """With hour-late events: each is late by its own source queue's progress (issue 18),
    whichever executor holds the stateful queue its key goes to."""
    job = unique("it-cjoin")
    shown, clicked, sink = f"{job}-imp", f"{job}-clk", f"{job}-out"
    for topic in (shown, clicked):
        admin.create_topic(topic, 2)
    settings = _driver_settings(client_settings)
    window = 10_000
    impressions, clicks, _without_late = ad_join_case(53, queues=2, window_ms=window)
    rnd = random.Random(59)
    _with_hour_late(rnd, impressions, "i")
    _with_hour_late(rnd, clicks, "c")
    spec = _spec(
        spark_cluster,
        settings,
        "stream_assets.examples.ad_join:build",
        {
            "job_id": job,
            "impressions": shown,
            "clicks": clicked,
            "sink": sink,
            "window_s": window // 1000,
            "lateness_s": JOIN_LATENESS_MS / 1000,
            "idle_timeout_s": 3,
        },
    )

    def joined() -> collections.Counter[tuple[Any, ...]]:
        return ad_join_results(admin, sink)

    with DriverProcess(spec, log_dir=tmp_path / "driver") as driver:  # starts it
        driver.wait_started(240)
        # Both topics at once, one producer per queue (each queue's order is as generated):
        # a topic still silent when the other's windows are due would be idle and left out.
        producers = [
            BackgroundProducer(
                settings,
                topic,
                [Message(json.dumps(e).encode(), queue_id=q) for e in events],
                threads=1,
            ).start()
            for topic, per_queue in ((shown, impressions), (clicked, clicks))
            for q, events in per_queue.items()
        ]
        for producer in producers:
            producer.join()
        stored = {topic: stored_ad_events(admin, topic) for topic in (shown, clicked)}
        expected, late = ad_join_reference(stored[shown], stored[clicked], window)
        assert {e["id"][0] for e in late} == {"i", "c"}, "late events on both sides"
        unseen = _unseen_route_lates(stored[shown], late)
        unseen += _unseen_route_lates(stored[clicked], late)
        assert unseen > 0
        wait_until(
            lambda: sum(joined().values()) >= sum(expected.values()),
            CATCH_UP_S,
            "every impression joined",
            poll_s=1.0,
        )
        driver.await_caught_up(CATCH_UP_S)
        metrics = driver.stop(180)["metrics"]

    assert joined() == expected
    assert metrics["2"]["totals"]["late"] == len(late)
    (state_topic,) = ad_join.build(job, shown, clicked, sink).state_topics
    voids = _assert_one_history_per_queue(admin, state_topic)
    _report_state_costs(report, "ad join (two topics)", metrics["2"], voids)
    events = sum(len(evs) for q in stored.values() for evs in q.values())
    report(f"ad join: {events} events, {len(late)} late ({unseen} by unseen routes)")
