"""The public test driver (stream_assets.testing): real core, real RocksDB, in-memory topics.

Every expected result is computed here from the input in plain Python, never
taken from the engine.
"""

from __future__ import annotations

import doctest
import json
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

import stream_assets.testing as testing_module
from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import wordcount
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.keyed import batch as keyed_batch
from stream_assets.runtime.core.ports import Sender
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.testing import InMemoryBroker, TopologyTestDriver, encode_input
from stream_assets.windows import SessionWindow, SlidingWindow, Time, TumblingWindow, Window
from tests.consumer_rule import final_counts, version_of

_VOCABULARY = ["stream", "queue", "topic", "broker", "state", "window", "Key", "COUNT", "é"]
_SIZE = 10_000  # tumbling window size, ms


def _lines(rnd: random.Random, n: int) -> list[str]:
    return [" ".join(rnd.choices(_VOCABULARY, k=rnd.randint(0, 9))) for _ in range(n)]


def _latest_by_key(outputs: list[dict[str, Any]], field: str) -> dict[Any, Any]:
    """Unwindowed aggregates emit the new value of each changed key: the last one wins."""
    latest: dict[Any, Any] = {}
    for out in outputs:
        latest[out["key"]] = out[field]
    return latest


def _windowed_sum(job: str = "wsum", lateness_s: float = 3) -> Topology:
    builder = StreamBuilder(job)
    (
        builder.source("events", json_deserializer)
        .key_by("key")
        .window(TumblingWindow.of(Time.milliseconds(_SIZE)))
        .sum("v", "sum")
        .water_mark(lateness_s)
        .late_records_to(f"{job}-late")
        .to_rstream()
        .sink(f"{job}-out")
    )
    return builder.build()


def _window_of(ts: int) -> tuple[int, int]:
    start = ts - ts % _SIZE
    return start, start + _SIZE


# -- the module's own documentation ------------------------------------------


def test_the_module_doctests_run() -> None:
    result = doctest.testmod(testing_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10
    assert result.failed == 0


# -- WordCount ---------------------------------------------------------------


@pytest.mark.parametrize("pre_combine", [True, False])
@pytest.mark.parametrize("max_records", [None, 3])
def test_wordcount_equals_a_counter_of_the_lines(
    pre_combine: bool, max_records: int | None
) -> None:
    rnd = random.Random(11)
    lines = _lines(rnd, 300)
    lines = [line for line in lines if line]  # RocketMQ rejects an empty body
    expected = Counter(w for line in lines for w in wordcount.split_words(line))
    with TopologyTestDriver(
        wordcount.build(),
        source_queues=3,
        shuffle_queues=5,
        pre_combine=pre_combine,
        max_records_per_batch=max_records,
    ) as driver:
        for i, line in enumerate(lines):
            driver.pipe(line)
            if i % 37 == 0:
                driver.advance()
        driver.advance()
        assert _latest_by_key(driver.outputs(), "count") == dict(expected)
        for word, count in expected.items():
            assert driver.state(word) == {"count": count}
        assert driver.state("never-seen") is None
        assert driver.committed() == [driver.broker.topic("sourceTopic").end(q) for q in range(3)]
        # sink keys are deterministic: job/operator/result key/version/position, and
        # every update of a key has a new, higher version
        sink_op = driver.topology.stages[1].ops[-1].op_id
        versions: dict[str, list[int]] = defaultdict(list)
        for record, out in zip(driver.output_records(), driver.outputs(), strict=True):
            [key] = record.keys
            prefix, version, position = key.rsplit("/", 2)
            assert (prefix, version[0], position) == (f"wordcount/{sink_op}/{out['key']}", "v", "0")
            versions[out["key"]].append(int(version[1:]))
        assert all(vs == sorted(set(vs)) for vs in versions.values())


def test_wordcount_is_deterministic() -> None:
    lines = [line for line in _lines(random.Random(5), 80) if line]

    def run() -> tuple[list[Any], list[Any], list[bytes]]:
        with TopologyTestDriver(wordcount.build(), max_records_per_batch=7) as driver:
            driver.pipe_many(lines)
            driver.advance()
            shuffle = driver.output_records(driver.topology.shuffle_topics[0])
            return (
                driver.outputs(),
                [r.keys for r in driver.output_records()],
                [r.body for r in shuffle],
            )

    assert run() == run()


# -- event time, lateness and late records -----------------------------------


def _lateness_reference(
    events: list[tuple[str, int, int]], lateness_ms: int
) -> tuple[dict[tuple[str, int], int], list[tuple[str, int, int]]]:
    """One source queue: a record is late when its window ended at or before (max event
    time of the records before it, whatever their keys) - lateness."""
    progress: int | None = None
    sums: dict[tuple[str, int], int] = defaultdict(int)
    late: list[tuple[str, int, int]] = []
    for key, value, ts in events:
        start, end = _window_of(ts)
        if progress is not None and end <= progress - lateness_ms:
            late.append((key, value, end))
        else:
            sums[(key, start)] += value
        progress = ts if progress is None else max(progress, ts)
    return dict(sums), late


@pytest.mark.parametrize("shuffle_queues", [1, 3])
def test_tumbling_sum_with_out_of_order_and_late_events(shuffle_queues: int) -> None:
    rnd = random.Random(23)
    lateness_ms = 3_000
    events = []
    for i in range(250):
        ts = i * 400 + rnd.randint(-7_000, 500)  # mostly forward, some far behind
        events.append((rnd.choice("abc"), rnd.randint(-50, 100), max(ts, 0)))
    sums, late = _lateness_reference(events, lateness_ms)
    # The input exercises every case: late events, and events out of order yet on time.
    assert late
    on_time_out_of_order = [
        e for i, e in enumerate(events) if e[2] < max(x[2] for x in events[: i + 1])
    ]
    assert len(on_time_out_of_order) > len(late)

    topology = _windowed_sum(lateness_s=lateness_ms / 1000)
    with TopologyTestDriver(topology, source_queues=1, shuffle_queues=shuffle_queues) as driver:
        for key, value, ts in events:
            driver.pipe({"key": key, "v": value}, event_time=ts)
            driver.advance()
        driver.advance_idle()
        fired = {(o["key"], o["window_start"]): o["sum"] for o in driver.outputs()}
        assert len(fired) == len(driver.outputs())  # each window fires once
        assert fired == sums
        assert all(o["window_end"] == o["window_start"] + _SIZE for o in driver.outputs())
        got_late = sorted((r["key"], r["value"]["v"], r["window_end"]) for r in driver.late())
        assert got_late == sorted(late)
        assert sum(s.late for s in driver.stats) == len(late)


def test_windows_fire_only_when_every_source_queue_is_idle() -> None:
    rnd = random.Random(3)
    events = [(rnd.choice("xyz"), rnd.randint(1, 9), rnd.randint(0, 39_999)) for _ in range(60)]
    expected: dict[tuple[str, int], int] = defaultdict(int)
    for key, value, ts in events:
        expected[(key, _window_of(ts)[0])] += value
    topology = _windowed_sum(lateness_s=60)  # nothing is late: only idleness fires
    with TopologyTestDriver(topology, source_queues=4, shuffle_queues=2) as driver:
        for key, value, ts in events:
            driver.pipe({"key": key, "v": value}, event_time=ts)
        driver.advance()
        assert driver.outputs() == []
        assert driver.state(events[0][0])  # open windows are in RocksDB
        driver.advance_idle()
        fired = {(o["key"], o["window_start"]): o["sum"] for o in driver.outputs()}
        assert len(fired) == len(driver.outputs())
        assert fired == dict(expected)
        assert driver.state(events[0][0]) == {}  # fired windows leave the state
        # A window that fired is closed: a record for it is late now.
        key, _, ts = events[0]
        driver.pipe({"key": key, "v": 1}, event_time=ts)
        driver.advance()
        assert [(r["key"], r["window_end"]) for r in driver.late()] == [(key, _window_of(ts)[1])]
        assert len(driver.outputs()) == len(expected)


def test_a_partly_idle_source_lets_the_watermark_pass_the_idle_queues() -> None:
    topology = _windowed_sum(lateness_s=0)
    with TopologyTestDriver(topology, source_queues=2, shuffle_queues=1) as driver:
        driver.pipe({"key": "k", "v": 1}, event_time=1_000, queue=0)
        driver.pipe({"key": "k", "v": 2}, event_time=25_000, queue=0)
        driver.advance()
        assert driver.outputs() == []  # queue 1 never spoke: it holds the watermark
        driver.advance_idle(queues=[1])
        # Only queue 0 counts now: its max (25 s) closes [0, 10 s) but not [20 s, 30 s).
        assert driver.outputs() == [{"key": "k", "sum": 1, "window_start": 0, "window_end": _SIZE}]
        assert driver.state("k") == {Window(20_000, 30_000): {"sum": 2}}


# -- dead letters ------------------------------------------------------------


def test_dead_letters_name_the_failing_operator_and_keep_the_bytes() -> None:
    def parse(value: dict[str, Any]) -> int:
        return 100 // int(value["n"])  # ZeroDivisionError for n == 0

    builder = StreamBuilder("dl")
    (
        builder.source("in", json_deserializer)
        .map(parse)
        .key_by(lambda v: v % 3)
        .count()
        .to_rstream()
        .sink("out")
    )
    topology = builder.build()
    map_op = topology.stages[0].ops[0].op_id
    source_op = topology.stages[0].source.op_id  # type: ignore[union-attr]
    rnd = random.Random(8)
    inputs: list[bytes] = []
    for _ in range(40):
        roll = rnd.random()
        if roll < 0.2:
            inputs.append(b"\xff\xfe not json")
        elif roll < 0.4:
            inputs.append(b'{"n": 0}')
        else:
            inputs.append(json.dumps({"n": rnd.randint(1, 30)}).encode())
    expected: Counter[int] = Counter()
    expected_dead: list[tuple[bytes, str]] = []
    for body in inputs:
        try:
            value = json.loads(body)
        except ValueError:
            expected_dead.append((body, source_op))
            continue
        if value["n"] == 0:
            expected_dead.append((body, map_op))
            continue
        expected[(100 // value["n"]) % 3] += 1

    with TopologyTestDriver(topology, source_queues=1, shuffle_queues=2) as driver:
        driver.pipe_many(inputs)
        driver.advance()
        dead = driver.dead_letters()
        assert [(body, props["operator"]) for body, props in dead] == expected_dead
        for body, props in dead:
            reason = "ZeroDivisionError" if props["operator"] == map_op else "Decode"
            assert reason in props["reason"]
            assert props["source_topic"] == "in"
            assert inputs[int(props["source_offset"])] == body
        assert _latest_by_key(driver.outputs(), "count") == dict(expected)
        assert sum(s.dead_letters for s in driver.stats) == len(expected_dead)


def test_undecodable_text_goes_to_dead_letters() -> None:
    builder = StreamBuilder("txt")
    builder.source("in", text_deserializer).key_by(str).count().to_rstream().sink("out")
    with TopologyTestDriver(builder.build(), source_queues=1) as driver:
        driver.pipe(b"ok")
        driver.pipe(b"\xc3\x28")  # invalid UTF-8
        driver.advance()
        assert driver.outputs() == [{"key": "ok", "count": 1}]
        [(body, props)] = driver.dead_letters()
        assert body == b"\xc3\x28"
        assert props["operator"] == "source-0"
        assert "UnicodeDecodeError" in props["reason"]


# -- exactly once across the shuffle -----------------------------------------


@pytest.mark.parametrize("pre_combine", [True, False])
def test_replayed_source_batches_are_skipped_by_the_stateful_stage(pre_combine: bool) -> None:
    lines = [line for line in _lines(random.Random(2), 50) if line]
    expected = Counter(w for line in lines for w in wordcount.split_words(line))
    with TopologyTestDriver(wordcount.build(), pre_combine=pre_combine) as driver:
        driver.pipe_many(lines)
        driver.advance()
        outputs = driver.outputs()
        shuffle_topic = driver.topology.shuffle_topics[0]
        sent = len(driver.output_records(shuffle_topic))
        # A crash after the shuffle send, before the offset commit: stage 0 runs again
        # and sends every record again (per record: the restart never combines old input).
        driver.rewind()
        stats = driver.advance()
        assert len(driver.output_records(shuffle_topic)) > sent
        words = sum(expected.values())
        assert sum(s.skipped_duplicates for s in stats if s.stage == 1) == words
        assert sum(s.records_in for s in stats if s.stage == 1) == 0
        assert driver.outputs() == outputs  # nothing changed, nothing emitted
        assert {w: driver.state(w)["count"] for w in expected} == dict(expected)


def test_resent_shuffle_messages_are_skipped() -> None:
    lines = [line for line in _lines(random.Random(4), 30) if line]
    expected = Counter(w for line in lines for w in wordcount.split_words(line))
    with TopologyTestDriver(wordcount.build(), pre_combine=False) as driver:
        driver.pipe_many(lines)
        driver.advance()
        shuffle = driver.topology.shuffle_topics[0]
        state_records = len(driver.output_records(driver.topology.state_topics[0]))
        for record in list(driver.output_records(shuffle)):
            driver.broker.send(shuffle, record.body, queue_id=record.queue_id, key=record.key)
        stats = driver.advance()
        assert sum(s.skipped_duplicates for s in stats) == sum(expected.values())
        # nothing applied: no state commit, so nothing written to the state topic
        assert len(driver.output_records(driver.topology.state_topics[0])) == state_records
        # and re-reading the shuffle topic itself changes nothing either
        driver.rewind(shuffle)
        stats = driver.advance()
        assert sum(s.skipped_duplicates for s in stats) == 2 * sum(expected.values())
        assert _latest_by_key(driver.outputs(), "count") == dict(expected)


# -- state durability ---------------------------------------------------------


def test_state_restored_from_the_state_topic_continues_exactly() -> None:
    rnd = random.Random(9)
    first = [line for line in _lines(rnd, 60) if line]
    second = [line for line in _lines(rnd, 60) if line]
    expected = Counter(w for line in first + second for w in wordcount.split_words(line))
    with TopologyTestDriver(wordcount.build(), snapshot_every=3, max_records_per_batch=4) as d:
        d.pipe_many(first)
        d.advance()
        before = {w: d.state(w) for w in expected}
        results = d.restore_state()  # a lost disk: every queue rebuilt from the changelog
        assert len(results) == d.shuffle_queues
        assert any(r.snapshot_offset is not None for r in results)
        assert {w: d.state(w) for w in expected} == before
        d.pipe_many(second)
        d.advance()
        assert _latest_by_key(d.outputs(), "count") == dict(expected)


# -- sink keys that de-duplicate -----------------------------------------------


def _crash_before_commit_after_output(
    monkeypatch: pytest.MonkeyPatch, driver: TopologyTestDriver, sink: str
) -> list[int]:
    """Arm one crash: the first stateful commit after ``sink`` received output fails.

    As an executor lost between a batch's sink flush and its changelog write:
    the outputs are out, the state and the offset are not committed, and the
    batch runs again. Returns a list that holds the sink's length at the crash.
    """
    real = keyed_batch.commit_with_changelog
    before = len(driver.output_records(sink))
    crashed_at: list[int] = []

    def commit(*args: Any, **kwargs: Any) -> Any:
        now = len(driver.output_records(sink))
        if not crashed_at and now > before:
            crashed_at.append(now)
            raise RuntimeError("executor lost before the commit")
        return real(*args, **kwargs)

    monkeypatch.setattr(keyed_batch, "commit_with_changelog", commit)
    return crashed_at


def _version(record: Record) -> tuple[str, int]:
    return version_of(record.keys[-1])


def test_unwindowed_updates_get_new_keys_and_a_replay_repeats_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with TopologyTestDriver(wordcount.build(), source_queues=1, shuffle_queues=1) as driver:
        shuffle = driver.topology.shuffle_topics[0]
        driver.pipe("a b a")
        driver.advance()
        first = {json.loads(r.body)["key"]: _version(r)[1] for r in driver.output_records()}
        crashed_at = _crash_before_commit_after_output(monkeypatch, driver, "wordcount-out")
        driver.pipe("a c")
        with pytest.raises(RuntimeError, match="executor lost"):
            driver.advance()
        crashed = driver.output_records()[len(first) :]
        assert crashed_at == [len(first) + 2]
        driver.rewind(shuffle, 0)  # the shuffle queue is read again from its start
        driver.advance()
        replayed = driver.output_records()[len(first) + len(crashed) :]
        # The replayed batch, from the same state: the same messages under the same keys.
        assert [(r.keys, r.body) for r in replayed] == [(r.keys, r.body) for r in crashed]
        second = {json.loads(r.body)["key"]: _version(r)[1] for r in replayed}
        assert second.keys() == {"a", "c"} and second["a"] > first["a"]
        # A new update of a key: a new, higher version; a restore keeps counting.
        driver.restore_state()
        driver.pipe("a")
        driver.advance()
        [third] = driver.output_records()[len(first) + 2 * len(crashed) :]
        assert json.loads(third.body) == {"key": "a", "count": 4}
        assert _version(third)[1] > second["a"]
        records = driver.output_records()
        assert len({r.keys for r in records}) == len(records) - len(crashed)
        assert final_counts(records) == {"a": 4, "b": 1, "c": 1}


def test_a_replay_over_more_input_repeats_a_key_with_the_committed_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replay may read further than the attempt that died: the same update key then
    carries a newer value, which the consumer's "last copy per key" rule keeps."""
    rnd = random.Random(3)
    lines = [line for line in _lines(rnd, 40) if line]
    expected = Counter(w for line in lines for w in wordcount.split_words(line))
    with TopologyTestDriver(wordcount.build(), source_queues=1, shuffle_queues=2) as driver:
        driver.pipe_many(lines[:10])
        driver.advance()
        _crash_before_commit_after_output(monkeypatch, driver, "wordcount-out")
        driver.pipe_many(lines[10:20])
        with pytest.raises(RuntimeError, match="executor lost"):
            driver.advance()
        driver.pipe_many(lines[20:])  # the replay reads these too
        driver.advance()
        records = driver.output_records()
        repeated = Counter(r.keys for r in records)
        assert max(repeated.values()) == 2  # the crashed attempt's keys came again
        assert final_counts(records) == dict(expected)


@pytest.mark.parametrize("pre_combine", [True, False])
def test_late_records_have_a_key_per_record_window_and_key(pre_combine: bool) -> None:
    b = StreamBuilder("slide")
    (
        b.source("events", json_deserializer)
        .key_by("key")
        .window(SlidingWindow.of(Time.seconds(10), Time.seconds(5)))
        .count()
        .water_mark(0)
        .late_records_to("slide-late")
        .to_rstream()
        .sink("out")
    )
    with TopologyTestDriver(
        b.build(), source_queues=1, shuffle_queues=1, pre_combine=pre_combine
    ) as driver:
        driver.pipe({"key": "a"}, event_time=1_000)
        driver.pipe({"key": "b"}, event_time=60_000)
        driver.advance()
        # Late in both sliding windows it belongs to ([0, 10 s), [5 s, 15 s)), for two keys.
        driver.pipe_many([{"key": "a"}, {"key": "b"}], event_time=7_000)
        driver.advance()
        records = driver.output_records("slide-late")
        assert sorted((r["key"], r["window_end"]) for r in driver.late("slide-late")) == [
            ("a", 10_000),
            ("a", 15_000),
            ("b", 10_000),
            ("b", 15_000),
        ]
        assert len({r.keys for r in records}) == len(records) == 4


def _keyed_topologies() -> dict[str, tuple[Topology, str]]:
    """A topology per stateful head with results: (topology, sink topic)."""
    out: dict[str, tuple[Topology, str]] = {}
    for name, window in (
        ("tumbling", TumblingWindow.of(Time.milliseconds(_SIZE))),
        ("session", SessionWindow.with_gap(Time.milliseconds(_SIZE))),
    ):
        b = StreamBuilder(name)
        (
            b.source("events", json_deserializer)
            .key_by("key")
            .window(window)
            .sum("v", "sum")
            .to_rstream()
            .flat_map(lambda r: [r, r])  # two outputs of one result: the position tells
            .sink("out")
        )
        out[name] = (b.build(), "out")
    b = StreamBuilder("wjoin")
    left, right = b.source("events", json_deserializer), b.source("more", json_deserializer)
    (
        left.join(right)
        .where("key")
        .equal_to("key")
        .window(TumblingWindow.of(Time.milliseconds(_SIZE)))
        .apply(lambda a, c: {"l": a["v"], "r": c["v"]})
        .sink("out")
    )
    out["join"] = (b.build(), "out")
    b = StreamBuilder("tjoin")
    table = b.table("more", json_deserializer, key="key", timestamp="ts")
    (
        b.source("events", json_deserializer)
        .select_timestamp("ts")
        .join_table(table, key="key", joiner=lambda a, c: {"l": a["v"], "r": c["v"]}, left=True)
        .to_rstream()
        .sink("out")
    )
    out["table-join"] = (b.build(), "out")
    return out


@pytest.mark.parametrize("head", ["tumbling", "session", "join", "table-join"])
def test_every_stateful_result_has_its_own_key_and_a_replay_repeats_it(
    head: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    topology, sink = _keyed_topologies()[head]
    rnd = random.Random(8)
    with TopologyTestDriver(topology, source_queues=2, shuffle_queues=2) as driver:
        for i in range(60):
            topic = "more" if "join" in head and i % 3 == 0 else "events"
            ts = 1_000 * i + rnd.randrange(500)
            value = {"key": rnd.choice("abc"), "v": i, "ts": ts}
            driver.pipe(value, topic=topic, event_time=ts)
        driver.advance()
        crashed_at = _crash_before_commit_after_output(monkeypatch, driver, sink)
        before = len(driver.output_records(sink))
        with pytest.raises(RuntimeError, match="executor lost"):
            driver.advance_idle()  # every open window (every waiting record) fires
        crashed = driver.output_records(sink)[before : crashed_at[0]]
        driver.advance_idle()
        records = driver.output_records(sink)
        replayed = records[crashed_at[0] : crashed_at[0] + len(crashed)]
        assert crashed and [(r.keys, r.body) for r in replayed] == [
            (r.keys, r.body) for r in crashed
        ]
        # Apart from the replayed copies, no two outputs share a key.
        assert len({r.keys for r in records}) == len(records) - len(crashed)


def test_source_stage_outputs_are_keyed_by_their_record() -> None:
    b = StreamBuilder("plain")
    b.source("events", text_deserializer).flat_map(str.split).sink("out")
    with TopologyTestDriver(b.build(), source_queues=2) as driver:
        driver.pipe_many(["a b", "a", "c a b"])
        driver.advance()
        first = [(r.keys, r.body) for r in driver.output_records()]
        driver.rewind()  # a crash before the offset commit: the batch runs again
        driver.advance()
        records = driver.output_records()
        assert [(r.keys, r.body) for r in records[len(first) :]] == first
        assert len({r.keys for r in records}) == len(first) == 6


# -- the in-memory broker and the driver's plumbing ---------------------------


def test_in_memory_broker_picks_queues_like_the_producer() -> None:
    broker = InMemoryBroker()
    assert isinstance(broker, Sender)
    broker.create_topic("t", 5)
    assert broker.send("t", b"a", queue_id=3).queue_id == 3
    for key in ("user-1", "user-2", "user 3"):
        assert broker.send("t", b"a", key=key).queue_id == queue_for_key(key, 5)
    assert [broker.send("t", b"x").queue_id for _ in range(6)] == [0, 1, 2, 3, 4, 0]
    topic = broker.topic("t")
    for q in range(5):
        assert [r.queue_offset for r in topic.queues[q]] == list(range(topic.end(q)))
    assert broker.topic("t").log[3].keys == ("user", "3")  # the wire splits keys on spaces
    with pytest.raises(ValueError, match="empty body"):
        broker.send("t", b"")
    with pytest.raises(ValueError, match="outside"):
        broker.send("t", b"a", queue_id=5)
    with pytest.raises(RocketMQError, match="'nope' does not exist"):
        broker.send("nope", b"a")


def test_pipe_encodes_values_and_sets_born_time() -> None:
    assert encode_input(b"\x00\x01") == b"\x00\x01"
    assert encode_input("ü") == "ü".encode()
    assert json.loads(encode_input({"a": [1, None, "é"]})) == {"a": [1, None, "é"]}
    with pytest.raises(TypeError):
        encode_input({1, 2})
    with TopologyTestDriver(wordcount.build(), source_queues=2) as driver:
        r1 = driver.pipe("a", event_time=500)
        r2 = driver.pipe("b")  # time stands still
        r3 = driver.pipe("c", queue=1, event_time=900)
        r4 = driver.pipe("d", key="k")
        assert [r.born_timestamp for r in (r1, r2, r3, r4)] == [500, 500, 900, 900]
        assert (r1.queue_id, r2.queue_id, r3.queue_id) == (0, 1, 1)
        assert r4.queue_id == queue_for_key("k", 2)
        with pytest.raises(TypeError):
            driver.pipe("x", event_time=1.5)  # type: ignore[arg-type]


def test_close_removes_the_state_directory(tmp_path: Path) -> None:
    driver = TopologyTestDriver(wordcount.build(), state_dir=tmp_path)
    driver.pipe("a b")
    driver.advance()
    directory = driver.state_dir
    assert directory.parent == tmp_path and any(directory.rglob("CURRENT"))
    driver.close()
    driver.close()
    assert not directory.exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        driver.advance()


def test_outputs_needs_a_topic_name_without_exactly_one_sink() -> None:
    builder = StreamBuilder("printer")
    builder.source("in", text_deserializer).map(str.upper).print()
    with TopologyTestDriver(builder.build()) as driver:
        driver.pipe_many(["a", "b"])
        driver.advance()
        with pytest.raises(ValueError, match="printed"):
            driver.outputs()
        assert sorted(driver.printed()) == ["A", "B"]
