"""Topologies against a real RocketMQ cluster of two broker groups (broker-a with a slave),
in controller mode.

A topic is the union of its queues on both groups: every source here has 4
queues on ``broker-a`` and 4 on ``broker-b``, and every answer is compared with
a reference computed from the input with plain Python. Failover: broker-a's
master killed mid-stream and its slave promoted, results resuming without an
instance restart, under a keyed WordCount (started again on
the promoted slave) and a windowed join; broker-b (no slave)
stopped for 3 minutes in real-time mode, broker-a's keys exact while it is
down, waited for and reported. Nothing is lost or doubled, and the job starts
again cleanly. (Windows over both groups are the join's; in micro-batch mode,
test_engine.py's on one broker.) Every test here runs in the default
(real-time) mode unless it names its mode.
Stateful logic on two Spark workers under CPU load, a worker killed: the
user's processors (de-duplication with a TTL, sessions closed by timers under a
TTL shorter than their gap). (A windowed join on two workers is
test_cluster.py's; the controller's promotion itself is
test_rocketmq_cluster.py's.)

The cluster is ``tests/integration/_rocketmq_cluster.py``'s (own ports and
stores); the instances share the session's SparkSession.
"""

from __future__ import annotations

import collections
import json
import random
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from stream_assets.broker.cluster import LocalCluster
from stream_assets.control.allocation import allocate, topology_queues
from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import ad_join, wordcount, wordcount_arrow
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer, OutgoingMessage
from stream_assets.rocketmq.errors import SendError
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.layout import TopicLayout, current_layout
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.roundtrip import run_roundtrip
from stream_assets.runtime.core.shuffle_codec import encode_key
from stream_assets.runtime.spark.instance import Instance
from stream_assets.serde import text_deserializer, text_serializer
from stream_assets.settings import RocketMQSettings
from stream_assets.state import layout as lay
from tests.consumer_rule import plain_copies, plain_counts
from tests.integration import _process_case as process_case
from tests.integration import _shuffle_audit as shuffle_audit
from tests.integration._cluster import SparkCluster, spark_cluster  # noqa: F401
from tests.integration._driver_process import DriverProcess
from tests.integration._engine_util import (
    BackgroundProducer,
    Message,
    await_readable,
    final_counts,
    latest_by_message_key,
    read_topic,
    unique,
    wait_until,
)
from tests.integration._faults import kill_before_an_end_site
from tests.integration._instance_process import build as build_crash_topology
from tests.integration._load import cpu_hog
from tests.integration._process_topologies import dedup_and_sessions
from tests.integration.conftest import EngineHarness
from tests.integration.test_cluster import (
    _driver_settings,
    ad_join_case,
    ad_join_reference,
    ad_join_results,
    stored_ad_events,
)
from tests.integration.test_engine import (
    _committed,
    _crash_input,
    _kill_session,
    _start_crash_instance,
)

pytestmark = pytest.mark.integration

CATCH_UP_S = 240.0
GROUPS = ("broker-a", "broker-b")
PER_GROUP = 4
#: How long broker-b has no master: the scenario (the issue's), not a wait for anything.
GROUP_OUTAGE_S = 180.0


@pytest.fixture(scope="module")
def cluster_settings(rocketmq_cluster: LocalCluster) -> RocketMQSettings:
    return rocketmq_cluster.client_settings()


@pytest.fixture
def cluster_admin(cluster_settings: RocketMQSettings) -> Iterator[RocketMQAdmin]:
    with RocketMQAdmin(cluster_settings) as admin:
        yield admin


@pytest.fixture
def cluster_engine(
    engine: EngineHarness, cluster_settings: RocketMQSettings
) -> Iterator[EngineHarness]:
    """Instances against the cluster, on the session's SparkSession (``engine`` owns it)."""
    harness = EngineHarness(cluster_settings)
    yield harness
    harness.stop_all()


def _source(admin: RocketMQAdmin, job: str) -> str:
    topic = f"{job}-src"
    admin.create_topic(topic, PER_GROUP)  # per master: 4 on each group
    route = admin.route(topic)
    assert {b: r.read_queues for b, r in route.brokers.items()} == dict.fromkeys(GROUPS, PER_GROUP)
    return topic


def _lines(seed: int, count: int) -> list[str]:
    rnd = random.Random(seed)
    vocab = [f"w{i:03d}" for i in range(400)]
    return [" ".join(rnd.choices(vocab, k=6)) for _ in range(count)]


def _send_lines(settings: RocketMQSettings, topic: str, lines: Sequence[str], tag: str) -> None:
    """Ten lines a message, keyed: the stable key hash spreads them over every writable
    queue. Returns once every message can be read."""
    messages = [
        OutgoingMessage(topic, "\n".join(lines[i : i + 10]).encode(), key=f"{tag}-{i}")
        for i in range(0, len(lines), 10)
    ]
    with BatchProducer(settings) as producer:
        for i in range(0, len(messages), 500):
            producer.send_all(messages[i : i + 500])
    with RocketMQAdmin(settings) as admin:  # references are read from the topic
        await_readable(admin, topic, [m.key for m in messages if m.key])


def _read_per_queue(admin: RocketMQAdmin, topic: str) -> list[list[bytes]]:
    """Every body stored in ``topic``, per queue in offset order."""
    reader = QueueReader(admin, group=unique("it-mb-read"))
    try:
        return [[r.body for r in reader.read(q, 0)] for q in admin.queues(topic)]
    finally:
        reader.close()


def _per_queue_counts(admin: RocketMQAdmin, topic: str) -> dict[MessageQueue, int]:
    return {q: o.max_offset for q, o in admin.topic_offsets(topic).items()}


def _assert_fully_committed(admin: RocketMQAdmin, group: str, topic: str) -> None:
    """The group committed every queue of ``topic``, on both groups, to its end."""
    ends = _per_queue_counts(admin, topic)
    assert {q.broker_name for q, end in ends.items() if end > 0} == set(GROUPS)
    committed = admin.group_offsets(group, topic)
    assert committed == ends, f"{topic}: committed {committed}, ends {ends}"


def _assert_spread(admin: RocketMQAdmin, topology: Topology, shuffle_queues: int) -> None:
    """Shuffle and state topics hold the configured total, half on each group."""
    for topic in (*topology.shuffle_topics, *topology.state_topics):
        route = admin.route(topic)
        assert {b: r.read_queues for b, r in route.brokers.items()} == dict.fromkeys(
            GROUPS, shuffle_queues // 2
        ), topic
        assert len(current_layout(admin, topic)) == shuffle_queues


# -- failover: a master killed, a whole group stopped ------------------------------------


def _words(admin: RocketMQAdmin, queues: Sequence[MessageQueue]) -> collections.Counter[str]:
    """The words of every line stored in ``queues``."""
    reader = QueueReader(admin, group=unique("it-mb-words"))
    try:
        return collections.Counter(
            w for q in queues for r in reader.read(q, 0) for w in r.body.decode().split()
        )
    finally:
        reader.close()


def test_a_group_without_a_master_for_three_minutes_the_other_groups_keys_keep_producing(
    cluster_engine: EngineHarness,
    cluster_admin: RocketMQAdmin,
    cluster_settings: RocketMQSettings,
    cluster_restored: LocalCluster,
    tmp_path: Path,
    report: Any,
) -> None:
    """Real-time mode, the CPUs busy: broker-b (a master alone, nothing to promote) stopped
    for 3 minutes. Stage 0 goes on reading broker-a's source queues and sending to
    broker-a's shuffle queues, holding broker-b's messages; the keys of broker-a's
    shuffle queues reach their exact counts while broker-b is still down. The instance
    waits and says so; everything is exact once broker-b is back."""
    cluster = cluster_restored
    job = unique("it-mb-down")
    source, sink = _source(cluster_admin, job), f"{job}-out"
    topology = wordcount.build(job, source, sink)
    engine = {"mode": "real-time", "interval_ms": 20_000, "step_max_records": 500}
    inst = cluster_engine.start(cluster_engine.instance(topology, tmp_path / "state", **engine))
    _send_lines(cluster_settings, source, _lines(31, 4_000), "pre")
    inst.await_caught_up(CATCH_UP_S)
    shuffle = current_layout(cluster_admin, topology.shuffle_topics[0])
    source_layout = current_layout(cluster_admin, source)
    # Unreadable while broker-b is down: read once, for the reference and the audit.
    source_on_b = shuffle_audit.read_source(cluster_admin, source_layout, {"broker-b"})
    words_on_b = collections.Counter(
        w for records in source_on_b.values() for words in records.values() for w in words
    )

    def shuffled_to_a(word: str) -> bool:
        target = queue_for_key(encode_key(word), len(shuffle))
        return shuffle.queue(target).broker_name == "broker-a"

    with cpu_hog(2):
        cluster.stop_group("broker-b")
        down_at = time.monotonic()
        # What the instance's loop puts in its log and heartbeat: the group it waits for.
        wait_until(
            lambda: set(inst.broker_outages().down) == {"broker-b"},
            60,
            "the instance reports broker-b without a master",
        )
        seen_s = time.monotonic() - down_at
        # Input while broker-b is down goes to broker-a's queues (the route lists no other).
        _send_lines(cluster_settings, source, _lines(33, 4_000), "during")
        on_a = cluster_admin.queues(source)
        assert {q.broker_name for q in on_a} == {"broker-a"}  # premise: broker-b is out
        expected = _words(cluster_admin, on_a) + words_on_b
        healthy = {w: n for w, n in expected.items() if shuffled_to_a(w)}
        assert 0 < len(healthy) < len(expected)  # premise: keys on both groups

        def healthy_keys_exact() -> bool:
            counts = final_counts(read_topic(cluster_admin, sink))
            past = {w: (n, expected[w]) for w, n in counts.items() if n > expected[w]}
            if past:
                sources = {
                    **source_on_b,
                    **shuffle_audit.read_source(cluster_admin, source_layout, {"broker-a"}),
                }
                found = shuffle_audit.overlapping_combines(
                    cluster_admin, shuffle, sources, {"broker-a"}
                )
                replayed, refused = shuffle_audit.replayed_counts(
                    cluster_admin, shuffle, {"broker-a"}
                )
                some = list(past)[:5]
                raise AssertionError(
                    f"a count past the input in {len(past)} words: "
                    f"{ {w: past[w] for w in some} } (count, input); the keyed rule over "
                    f"broker-a's shuffle queues makes { {w: replayed[w] for w in some} }, "
                    f"refusing {refused[:3]}; {found or 'no combined message overlaps its mark'}"
                )
            return all(counts.get(w) == n for w, n in healthy.items())

        left_s = GROUP_OUTAGE_S - (time.monotonic() - down_at)
        wait_until(healthy_keys_exact, left_s, "broker-a's keys exact during the outage", 1.0)
        results_s = time.monotonic() - down_at
        assert set(inst.broker_outages().down) == {"broker-b"}  # still down: the premise
        inst.check_failed()  # waiting for broker-b, not failed
        time.sleep(max(0.0, GROUP_OUTAGE_S - (time.monotonic() - down_at)))  # the scenario
        inst.check_failed()
        cluster.start_group("broker-b")
        back_s = time.monotonic() - down_at
        wait_until(lambda: not inst.broker_outages().down, CATCH_UP_S, "broker-b reported back")
        inst.await_caught_up(CATCH_UP_S)
        caught_up_s = time.monotonic() - down_at
    assert final_counts(read_topic(cluster_admin, sink)) == dict(expected)
    _assert_fully_committed(cluster_admin, job, source)
    everywhere = set(GROUPS)
    assert not shuffle_audit.overlapping_combines(
        cluster_admin,
        shuffle,
        shuffle_audit.read_source(cluster_admin, source_layout, everywhere),
        everywhere,
    )

    report(
        f"broker-b without a master for {back_s:.0f} s, real-time mode under load: reported "
        f"after {seen_s:.1f} s; {len(healthy)} of {len(expected)} keys (broker-a's) exact "
        f"{results_s:.0f} s into the outage; all exact {caught_up_s:.0f} s after it began"
    )


class _LiveLines:
    """Sends ``lines`` (ten a message, 20 messages a call) from a thread, as an
    application would: a failed call is sent again until stored (a resend may store
    a message twice; references are computed from what the topic holds)."""

    def __init__(self, settings: RocketMQSettings, topic: str, lines: Sequence[str]) -> None:
        self.sent = self.resends = 0
        self._messages = [
            OutgoingMessage(topic, "\n".join(lines[i : i + 10]).encode(), key=f"live-{i}")
            for i in range(0, len(lines), 10)
        ]
        self._settings = settings
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with BatchProducer(self._settings) as producer:
                for i in range(0, len(self._messages), 20):
                    while True:
                        try:
                            producer.send_all(self._messages[i : i + 20])
                            break
                        except SendError:
                            self.resends += 1
                            time.sleep(0.2)  # pacing the retries of a failed call
                    self.sent = i + 20
                    time.sleep(0.4)  # a live stream (500 lines/s), not one burst
        except BaseException as exc:
            self._error = exc

    @property
    def total(self) -> int:
        return len(self._messages)

    @property
    def keys(self) -> list[str]:
        """The message keys of every line message."""
        return [m.key for m in self._messages if m.key]

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the producer did not finish"
        if self._error is not None:
            raise self._error


def test_wordcount_over_two_broker_groups_rides_a_master_failover_and_starts_again(
    cluster_engine: EngineHarness,
    cluster_admin: RocketMQAdmin,
    cluster_settings: RocketMQSettings,
    cluster_restored: LocalCluster,
    tmp_path: Path,
    report: Any,
) -> None:
    """A keyed WordCount reading every queue of both groups, and kill -9 of broker-a's
    master mid-stream (controller mode), the CPUs busy. The controller promotes the
    in-sync slave; the running instance follows the group to its new master (reads,
    shuffle and state writes, offset commits) with no restart. Then a second start runs
    on (once it failed with "16 queues but configured for 8")."""
    cluster = cluster_restored
    job = unique("it-mb-failover")
    source, sink = _source(cluster_admin, job), f"{job}-out"
    topology = wordcount.build(job, source, sink)
    inst = cluster_engine.start(
        cluster_engine.instance(
            topology, tmp_path / "state", shuffle_queues=8, max_records_per_batch=100
        )
    )
    _send_lines(cluster_settings, source, _lines(60, 2_000), "pre")
    inst.await_caught_up(CATCH_UP_S)  # running, with state on both groups
    with cpu_hog(2):  # the machine busy, as where failovers went wrong before
        live = _LiveLines(cluster_settings, source, _lines(61, 8_000))
        wait_until(lambda: live.sent >= live.total // 3, 120, "a third of the stream sent")
        killed_at, sent_at_kill = time.monotonic(), live.sent
        cluster.kill("broker-a", "master")
        # Results for input sent after the kill, on every source queue of both groups.
        marker = "failover-marker"
        layout = TopicLayout.of(cluster_admin.queues(source))
        queues = len(layout)
        with BatchProducer(cluster_settings) as producer:
            producer.pin([layout])  # queue i stays on its group through the failover
            for q in range(queues):  # one at a time: a failed send is sent again alone
                message = OutgoingMessage(source, marker.encode(), queue_id=q)
                wait_until(lambda m=message: _sent_ok(producer, [m]), 60, f"the marker to {q}")

        def marker_counted() -> bool:
            return final_counts(read_topic(cluster_admin, sink)).get(marker, 0) >= queues

        wait_until(marker_counted, CATCH_UP_S, "the marker's count in the sink", poll_s=0.5)
        resumed_s = time.monotonic() - killed_at
    live.join(CATCH_UP_S)
    await_readable(cluster_admin, source, live.keys)
    inst.check_failed()  # the same instance all along, never failed
    inst.await_caught_up(CATCH_UP_S)

    stored = [r.body.decode() for r in read_topic(cluster_admin, source)]
    words = collections.Counter(
        w for body in stored for line in body.split("\n") for w in line.split()
    )
    assert words[marker] == queues  # premise: the marker went to each queue once
    assert final_counts(read_topic(cluster_admin, sink)) == dict(words)
    _assert_fully_committed(cluster_admin, job, source)
    for state_topic in topology.state_topics:
        histories = process_case.state_histories(cluster_admin, state_topic)
        for queue, (seqs, writers) in histories.items():
            assert seqs == list(range(1, len(seqs) + 1)), f"{state_topic}[{queue}]: {seqs}"
            assert len(writers) <= 1, f"{state_topic}[{queue}]: {writers}"
    assert resumed_s < 30, f"results resumed only {resumed_s:.1f} s after the kill"
    _assert_spread(cluster_admin, topology, 8)

    cluster_engine.stop(inst)
    again = cluster_engine.start(
        cluster_engine.instance(topology, tmp_path / "state", shuffle_queues=8)
    )
    after = _lines(3, 2_000)
    _send_lines(cluster_settings, source, after, "after")
    again.await_caught_up(CATCH_UP_S)
    words.update(w for line in after for w in line.split())
    assert final_counts(read_topic(cluster_admin, sink)) == dict(words)
    _assert_fully_committed(cluster_admin, job, source)
    report(
        f"broker-a's master killed mid-stream under load ({sent_at_kill}/{live.total} sent), "
        f"slave promoted: results for input sent after the kill {resumed_s:.1f} s after it, no "
        f"instance restart; {sum(words.values())} words exact over two starts "
        f"({live.resends} resent calls)"
    )


def test_a_windowed_join_in_real_time_mode_rides_a_master_failover(
    cluster_engine: EngineHarness,
    cluster_admin: RocketMQAdmin,
    cluster_settings: RocketMQSettings,
    cluster_restored: LocalCluster,
    tmp_path: Path,
    report: Any,
) -> None:
    """A windowed left join of two topics, each with queues on both groups, in real-time
    mode with the CPUs busy: kill -9 of broker-a's master between the two halves of every
    queue's input (controller mode). The join's results for the second half come with no
    instance restart, they equal the reference computed from what the topics hold, and
    each state queue's history is one strictly increasing sequence from one writer."""
    cluster = cluster_restored
    job = unique("it-mb-join")
    shown, clicked = _source(cluster_admin, f"{job}-imp"), _source(cluster_admin, f"{job}-clk")
    sink, window = f"{job}-out", 10_000
    topology = ad_join.build(
        job, shown, clicked, sink, window_s=window // 1000, lateness_s=5, idle_timeout_s=3
    )
    queues = 2 * PER_GROUP
    impressions, clicks, _ = ad_join_case(67, queues=queues, window_ms=window)
    for side, per_queue in (("i", impressions), ("c", clicks)):
        for q, events in per_queue.items():
            for n, e in enumerate(events):
                e["id"] = f"{side}{q}.{n}"
    layouts = [TopicLayout.of(cluster_admin.queues(t)) for t in (shown, clicked)]

    def send(half: int) -> None:
        """Each queue's first (0) or second (1) half, in order; a failed call again."""
        with BatchProducer(cluster_settings) as producer:
            producer.pin(layouts)  # queue i stays on its group through the failover
            for topic, per_queue in ((shown, impressions), (clicked, clicks)):
                for q, events in per_queue.items():
                    cut = len(events) // 2
                    part = events[:cut] if half == 0 else events[cut:]
                    messages = [
                        OutgoingMessage(topic, json.dumps(e).encode(), queue_id=q) for e in part
                    ]
                    wait_until(lambda m=messages: _sent_ok(producer, m), 60, f"{topic}[{q}]")

    inst = cluster_engine.start(
        cluster_engine.instance(
            topology,
            tmp_path / "state",
            shuffle_queues=8,
            mode="real-time",
            interval_ms=20_000,
            step_max_records=500,
        )
    )
    send(0)
    with cpu_hog(2):
        killed_at = time.monotonic()
        cluster.kill("broker-a", "master")
        send(1)

        def shown_at(part: slice) -> set[tuple[Any, ...]]:
            return {
                (e["ad"], e["user"], e["ts"])
                for events in impressions.values()
                for e in events[part]
            }

        cut = len(impressions[0]) // 2
        second_half = shown_at(slice(cut, None)) - shown_at(slice(0, cut))

        def second_half_joined() -> bool:
            return any(r[:3] in second_half for r in ad_join_results(cluster_admin, sink))

        wait_until(second_half_joined, CATCH_UP_S, "a result for the second half", 0.5)
        resumed_s = time.monotonic() - killed_at
        stored = {t: stored_ad_events(cluster_admin, t) for t in (shown, clicked)}
        ids = [e["id"] for q in stored.values() for evs in q.values() for e in evs]
        assert len(ids) == len(set(ids)) == 800  # premise: each event stored once
        expected, late = ad_join_reference(stored[shown], stored[clicked], window)

        wait_until(
            lambda: sum(ad_join_results(cluster_admin, sink).values()) >= sum(expected.values()),
            CATCH_UP_S,
            "every impression joined",
            1.0,
        )
        inst.await_caught_up(CATCH_UP_S)
    inst.check_failed()  # the same instance all along
    assert ad_join_results(cluster_admin, sink) == expected
    for state_topic in topology.state_topics:
        histories = process_case.state_histories(cluster_admin, state_topic)
        for queue, (seqs, writers) in histories.items():
            assert seqs == list(range(1, len(seqs) + 1)), f"{state_topic}[{queue}]: {seqs}"
            assert len(writers) <= 1, f"{state_topic}[{queue}]: {writers}"
    assert resumed_s < 30, f"results resumed only {resumed_s:.1f} s after the kill"
    report(
        f"windowed join, real-time mode under load, broker-a's master killed mid-stream: a "
        f"result for input sent after the kill {resumed_s:.1f} s after it, no instance "
        f"restart; {sum(expected.values())} results exact ({len(late)} late events)"
    )


def _sent_ok(producer: BatchProducer, messages: list[OutgoingMessage]) -> bool:
    """Whether ``messages`` were stored now (False: a failover under way, try again)."""
    try:
        producer.send_all(messages)
    except SendError:
        return False
    return True


# -- scale 1 -> 3 -> 2 over two broker groups ----------------------------------------


def test_scale_1_3_2_over_two_broker_groups_keeps_counts_exact(
    cluster_engine: EngineHarness,
    cluster_admin: RocketMQAdmin,
    cluster_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    """Queues move with their state at each step; the sinks are exactly once, their queues
    on both groups: a plain reader sees each count once, in order, and each message of a
    second source copied once, in order per source queue (a stateless stage's step log
    moves with its source queue), through every move."""
    job = unique("it-mb-scale")
    source, sink = _source(cluster_admin, job), f"{job}-out"
    copied, copies = _source(cluster_admin, f"{job}-c"), f"{job}-copies"
    # The vectorised WordCount (wordcount_arrow): the per-record one runs over both groups
    # in the tests above.
    builder = StreamBuilder(job, exactly_once_sinks=True)
    wordcount_arrow.count_words(builder, source, sink)
    builder.source(copied, text_deserializer).sink(copies, text_serializer)
    topology = builder.build()
    parts = [_lines(40 + i, 3_000) for i in range(3)]
    words: collections.Counter[str] = collections.Counter()
    running: list[Instance] = []
    allocation = None
    every_source = list(range(2 * PER_GROUP))
    queues = topology_queues(topology, {source: every_source, copied: every_source}, 4)
    for step, count in enumerate((1, 3, 2)):
        allocation = allocate(queues, count, previous=allocation)
        for inst in running:  # the old generation stops (final checkpoint) first
            cluster_engine.stop(inst)
        running = [
            cluster_engine.start(
                Instance(
                    topology,
                    rocketmq=cluster_settings,
                    engine=cluster_engine.instance(topology, tmp_path / "state").engine,
                    assignment=allocation.assignment[i],
                    generation=allocation.generation,
                    progress=lambda _m: None,
                )
            )
            for i in range(count)
        ]
        _send_lines(cluster_settings, source, parts[step], f"s{step}")
        _send_lines(cluster_settings, copied, parts[step], f"c{step}")
        words.update(w for line in parts[step] for w in line.split())
        for inst in running:
            inst.await_caught_up(CATCH_UP_S)
        # Caught up is the input committed: a step whose end came past its window (a
        # loaded machine) is the broker's check-back's to commit, within 25 s.
        wait_until(
            lambda: final_counts(read_topic(cluster_admin, sink)) == dict(words),
            120,
            f"every count after {count}",
        )
        assert plain_counts(read_topic(cluster_admin, sink)) == dict(words), f"after {count}"
        assert sum(inst.metrics[0].totals["batched_in"] for inst in running) > 0
        sent = _read_per_queue(cluster_admin, copied)
        total = sum(map(len, sent))
        wait_until(
            lambda n=total: len(read_topic(cluster_admin, copies)) >= n,
            120,
            f"every copy after {count}",
        )
        plain_copies(read_topic(cluster_admin, copies), sent, lambda r: r.body)
    _assert_fully_committed(cluster_admin, job, source)
    _assert_fully_committed(cluster_admin, job, copied)


# -- a kill -9 at a step's end while queues move, over two broker groups --------


def test_a_kill_9_just_after_queues_moved_over_two_broker_groups_keeps_sinks_exact(
    cluster_engine: EngineHarness,
    cluster_admin: RocketMQAdmin,
    cluster_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    """A kill during a rebalance over two broker groups: a running instance gives the
    queues of one group (of every topic) to a new instance on a disk of its own, which
    restores their state and is killed -9 at one of its first five steps' ends (after
    the state commit, before the transaction's end); a third instance, on a third disk,
    takes those queues over. A plain reader of the sinks sees each count once, rising,
    each window once with the reference's sum, and each event's copy once."""
    job = unique("it-kill-move")
    crash = _crash_input(cluster_admin, job)
    # Split on a window's boundary (1 000 events = 50 s): the pause while the queues move
    # outlasts the idle timeout, which fires every open window; the second half opens
    # new ones.
    first_half, second_half = slice(0, 1_000), slice(1_000, None)
    crash.produce(cluster_settings, first_half)
    topology = build_crash_topology(job)
    every_topic = [crash.topics.lines, crash.topics.events, *topology.shuffle_topics]
    kept = {topic: [0, 1] for topic in every_topic}
    moved = {topic: [2, 3] for topic in every_topic}
    first = cluster_engine.start(
        cluster_engine.instance(
            topology, tmp_path / "a", assignment={t: [0, 1, 2, 3] for t in every_topic}
        )
    )
    first.await_caught_up(CATCH_UP_S)
    for topic in every_topic:  # the moved queues are the other group's (created by now)
        layout = current_layout(cluster_admin, topic)
        groups = [{layout.queue(q).broker_name for q in qs} for qs in (kept[topic], moved[topic])]
        assert len(groups[0]) == len(groups[1]) == 1 and groups[0] != groups[1], topic

    # The new owner takes its queues with input coming: killed at one of its first
    # five steps with results (restore and currency checks behind it or not).
    first.reassign(kept, generation=1)
    at = random.Random("kill-move").randint(1, 5)
    site, counter = kill_before_an_end_site(tmp_path / "kill", at)
    second = _start_crash_instance(
        job, tmp_path / "b", cluster_settings.namesrv_addr, "micro-batch", site, moved, 1
    )
    try:
        crash.produce(cluster_settings, second_half)
        assert second.wait(180) == -signal.SIGKILL
    finally:
        _kill_session(second)
    assert counter.read_text() == str(at), "not killed before a step's end"
    moved_at = _committed(cluster_admin, job, crash.topics.lines)

    first.reassign(kept, generation=2)
    third = cluster_engine.start(
        cluster_engine.instance(topology, tmp_path / "c", assignment=moved, generation=2)
    )
    for inst in (first, third):
        inst.await_caught_up(CATCH_UP_S)
    counts, windows, copies, by_check = crash.assert_sinks_exact(cluster_admin)
    report(
        f"queues moved at 1 000 of {crash.messages} messages; the new owner killed -9 at "
        f"its step end {at} ({moved_at} committed): {counts} counts, {windows} windows and "
        f"{copies} copies, each seen once, in order; {by_check} committed by the broker's "
        "check-back"
    )
    assert by_check > 0, "a step killed before its end, and none of its results checked"


# -- process(): de-duplication and sessions under TTLs, 2 workers, under load ---


# Micro-batch only, for CI's hour: the micro-batch mode's share of the cluster with a
# worker killed. The real-time mode (the default) is proven on two workers with a worker
# killed by test_cluster.py, and over two broker groups by every other test here.
@pytest.mark.parametrize("mode", ["micro-batch"])
def test_processors_on_two_workers_over_two_broker_groups_under_load_with_a_worker_killed(
    spark_cluster: SparkCluster,  # noqa: F811
    cluster_admin: RocketMQAdmin,
    cluster_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
    mode: str,
) -> None:
    """The user's stateful logic where it is hardest: one source on both broker groups,
    two Spark workers that cannot see each other's disks, the CPUs busy, and worker 0
    killed mid-stream. One stage 0 feeds two processors
    (``_process_topologies.dedup_and_sessions``): FirstWithin keyed by ``id`` (an
    event-time timer and a state TTL) and ActivitySessions keyed by ``device``
    (sessions closed by an event-time timer that reads the session's state, under
    a TTL shorter than the gap: the timer must still see it). Both outputs equal
    the references from the input (``_process_case``). In real-time mode the worker dies
    mid-interval; the interval is short so that Spark's retry of its task finds a slot."""
    if not spark_cluster.worker_processes(0):  # the other mode's case killed it
        spark_cluster.start_worker(0)
        spark_cluster.wait_ready(workers=2, timeout_s=120)
    began = time.monotonic()
    job = unique("it-mb-proc")
    source, unique_sink, session_sink = f"{job}-src", f"{job}-unique", f"{job}-sessions"
    cluster_admin.create_topic(source, 2)  # 2 per group: 4 queues
    queues = len(cluster_admin.queues(source))
    assert queues == 4
    settings = _driver_settings(cluster_settings)
    base_ts, horizon_ms, gap_ms, session_ttl_ms, lateness_s = (
        1_700_000_000_000,
        1_500,
        1_000,
        400,
        1.0,
    )
    flush_ts = base_ts + 10**9  # past every timer the stream sets
    kwargs = {
        "job_id": job,
        "source": source,
        "unique_sink": unique_sink,
        "session_sink": session_sink,
        "horizon_ms": horizon_ms,
        "gap_ms": gap_ms,
        "session_ttl_s": session_ttl_ms / 1000,
        "lateness_s": lateness_s,
    }
    topology = dedup_and_sessions(**kwargs)  # type: ignore[arg-type]
    events = process_case.events(random.Random(29), 2_400, base_ts)
    # Keyed by device: a device (and each of its ids) on one source queue, in order;
    # then one flush event per queue (a queue index per write queue of both groups).
    messages = [Message(json.dumps(e).encode(), key=e["device"]) for e in events]
    flush = {"t": flush_ts, "n": -1}
    messages += [
        Message(json.dumps({**flush, "id": f"f{q}", "device": f"f{q}"}).encode(), queue_id=q)
        for q in range(queues)
    ]

    def outputs(topic: str) -> list[dict[str, Any]]:
        return list(latest_by_message_key(read_topic(cluster_admin, topic)).values())

    spec = {
        "topology": "tests.integration._process_topologies:dedup_and_sessions",
        "topology_kwargs": kwargs,
        "rocketmq": json.loads(settings.revealed_json()),
        "engine": {
            "spark_master": spark_cluster.master_url,
            "spark_conf": spark_cluster.spark_conf(),
            # state_dir unset: each executor keeps state on its own worker's disk.
            "shuffle_queues": 4,
            "sink_queues": 4,
            "trigger_interval_ms": 300,
            "tick_ms": 500,
            "snapshot_every": 8,
            "mode": mode,
            "interval_ms": 5_000,
        },
    }
    live_from = 900  # events before the kill; the rest are produced around it
    # One busy core, not two: the load is the premise; a second hog cost CI ~100 s.
    with cpu_hog(1), DriverProcess(spec, log_dir=tmp_path / "driver") as driver:
        driver.wait_started(300)
        started_s = time.monotonic() - began
        # One thread: every queue gets its events in clock order. It holds back after
        # live_from until the instance caught up, so both workers hold state.
        producer = BackgroundProducer(settings, source, messages, threads=1, pause_after=live_from)
        producer.start()
        wait_until(lambda: producer.sent >= live_from, 60, "the first events sent")
        driver.await_caught_up(CATCH_UP_S)
        producer.resume()
        killed = spark_cluster.kill_worker(0)  # mid-stream: the rest is still being sent
        sent_at_kill = producer.sent
        assert killed, "worker 0 had no processes to kill"
        assert sent_at_kill < len(messages), "the stream was over before the kill"
        spark_cluster.wait_ready(workers=1, timeout_s=60)
        producer.join(120)
        sent_ids = [json.loads(m.body)["id"] for m in messages]
        await_readable(cluster_admin, source, sent_ids, ids=lambda r: [json.loads(r.body)["id"]])
        stored = process_case.stored_events(cluster_admin, source)
        expected_unique = process_case.dedup_reference(stored, horizon_ms)
        final_watermark = flush_ts - int(lateness_s * 1000)
        expected_sessions = process_case.sessions_reference(
            stored, gap_ms, session_ttl_ms, final_watermark
        )
        wait_until(
            lambda: (
                len(outputs(unique_sink)) >= len(expected_unique)
                and len(outputs(session_sink)) >= len(expected_sessions)
            ),
            CATCH_UP_S,
            "every unique event and every session",
            poll_s=1.0,
        )
        driver.await_caught_up(CATCH_UP_S)
        metrics = driver.stop(180)["metrics"]

    # The reference's premises: every event stored, on both groups; each key from one
    # source queue; event time rising within each queue.
    assert sorted(e["n"] for evs in stored.values() for e in evs if e["n"] >= 0) == list(
        range(len(events))
    )
    assert {q.split(":")[0] for q, evs in stored.items() if evs} == set(GROUPS)
    for key in ("id", "device"):
        homes = collections.defaultdict(set)
        for q, evs in stored.items():
            for e in evs:
                homes[e[key]].add(q)
        assert all(len(qs) == 1 for qs in homes.values()), key
    for q, evs in stored.items():
        assert [e["t"] for e in evs] == sorted(e["t"] for e in evs), f"queue {q}"

    uniques = outputs(unique_sink)
    assert sorted(e["n"] for e in uniques) == expected_unique
    summaries = outputs(session_sink)
    assert (
        sorted((s["key"], s["records"], s["first"], s["last"], s["total"]) for s in summaries)
        == expected_sessions
    )
    # The reference's premise: keys came back both within and past the TTL after a
    # session's timer (totals went on, and restarted).
    assert any(s[4] > s[1] for s in expected_sessions)
    assert metrics["2"]["totals"]["expired"] > 0, "the session state's TTL never expired"
    assert read_topic(cluster_admin, topology.dead_letter_topic) == []
    for stage in ("1", "2"):
        assert metrics[stage]["totals"]["late"] == 0, metrics[stage]
        assert metrics[stage]["totals"]["dead_letters"] == 0, metrics[stage]
    assert metrics["1"]["totals"]["expired"] > 0, "the dedup state's TTL never expired a key"
    # Restored from the state topic (a kill's aftermath), the dedup store holds exactly
    # the ids the TTL keeps alive at the final watermark: the expiry was changelogged.
    dedup = topology.stages[1]
    assert dedup.head is not None and dedup.state_topic is not None and dedup.head.ttl_ms
    held = process_case.restored_keys(
        cluster_admin, job, dedup.head.op_id, dedup.state_topic, tmp_path / "restored"
    )
    alive = process_case.live_ids(stored, dedup.head.ttl_ms, final_watermark)
    assert alive and alive != {e["id"] for e in events}, "the case keeps too few or all ids"
    assert held[lay.USER] == alive and held[lay.EXPIRY] == alive, (held, alive)
    # Each state queue's valid history: commits 1, 2, 3, ... from one writer.
    for state_topic in topology.state_topics:
        histories = process_case.state_histories(cluster_admin, state_topic)
        assert any(seqs for seqs, _ in histories.values()), f"{state_topic}: no state written"
        for queue, (seqs, writers) in histories.items():
            assert seqs == list(range(1, len(seqs) + 1)), f"{state_topic}[{queue}]: {seqs}"
            assert len(writers) <= 1, f"{state_topic}[{queue}]: {writers}"

    totals = {s: metrics[s]["totals"] for s in ("1", "2")}
    report(
        f"dedup + sessions ({mode}) over 2 broker groups on 2 workers under load, worker 0 killed "
        f"after {sent_at_kill}/{len(messages)} sent: {len(expected_unique)} unique of "
        f"{len(events)} events, {len(expected_sessions)} sessions; expired "
        f"{int(totals['1']['expired'])}+{int(totals['2']['expired'])} keys; "
        f"restores {int(totals['1']['restores'])}"
        f"+{int(totals['2']['restores'])}, catch-ups {int(totals['1']['catch_ups'])}"
        f"+{int(totals['2']['catch_ups'])}; driver up in {started_s:.1f} s, "
        f"{time.monotonic() - began:.1f} s in all"
    )


def test_a_round_trip_over_two_broker_groups_leaves_no_topic_or_group_behind(
    cluster_settings: RocketMQSettings, cluster_admin: RocketMQAdmin
) -> None:
    """The round-trip check makes a topic and a reader group on every node (slaves
    too) each time it runs, and deletes both: a scheduled check must not pile them
    up on the brokers."""
    report = run_roundtrip(400, 8, settings=cluster_settings)
    assert report.ok, report.describe()
    assert report.topic not in cluster_admin.topic_names()
    assert not [g for g in cluster_admin.group_names() if g.startswith(report.topic)]
    assert not cluster_admin.topic_exists(report.topic)
