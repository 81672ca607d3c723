"""The pure per-queue core (runtime/core/stage0/stateless.py, core/keyed/) operator by operator.

Runs through the public test driver where that is convenient, and calls
``run_source_batch`` / ``run_keyed_batch`` directly where a test needs to
control batches, contexts or stores. Every expected result is computed here
from the input in plain Python.
"""

from __future__ import annotations

import gc
import json
import random
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stream_assets.dsl.builder import AggregatedStream, GroupedStream, StreamBuilder
from stream_assets.examples import wordcount
from stream_assets.operators.aggregates import Accumulator
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.context import StageContext
from stream_assets.runtime.core.keyed import run_keyed_batch
from stream_assets.runtime.core.shuffle_codec import decode
from stream_assets.runtime.core.stage0.stateless import run_source_batch
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.state.errors import FencedError
from stream_assets.state.store import QueueStateStore
from stream_assets.testing import InMemoryBroker, TopologyTestDriver
from stream_assets.windows import SessionWindow, SlidingWindow, Time, TumblingWindow

Event = tuple[str, int, int]  # key, value, event time


def _events(seed: int, n: int, keys: str = "abcd", span: int = 60_000) -> list[Event]:
    rnd = random.Random(seed)
    return [(rnd.choice(keys), rnd.randint(-20, 100), rnd.randint(0, span)) for _ in range(n)]


def _pipe_events(driver: TopologyTestDriver, events: list[Event]) -> None:
    for key, value, ts in events:
        driver.pipe({"k": key, "v": value}, event_time=ts)


def _latest(outputs: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """Unwindowed results: the last one emitted per key, without the key."""
    latest: dict[Any, dict[str, Any]] = {}
    for out in outputs:
        latest[out["key"]] = {k: v for k, v in out.items() if k != "key"}
    return latest


def _fired(outputs: list[dict[str, Any]], field: str) -> dict[tuple[str, int, int], Any]:
    fired = {(o["key"], o["window_start"], o["window_end"]): o[field] for o in outputs}
    assert len(fired) == len(outputs), "a window fired twice"
    return fired


def _broker_for(topology: Topology, source_queues: int, shuffle_queues: int) -> InMemoryBroker:
    broker = InMemoryBroker()
    broker.create_topic(topology.source_topic, source_queues)
    for topic in (*topology.shuffle_topics, *topology.state_topics):
        broker.create_topic(topic, shuffle_queues)
    for topic in (*topology.sink_topics, *topology.late_topics, topology.dead_letter_topic):
        broker.create_topic(topic, 1)
    return broker


def _record(topic: str, queue: int, offset: int, value: Any, ts: int = 0) -> Record:
    return Record(topic, queue, offset, json.dumps(value).encode(), born_timestamp=ts)


# -- stateless operators -------------------------------------------------------


def test_map_flat_map_filter_foreach_per_source_record() -> None:
    seen: list[Any] = []

    def double(v: dict[str, int]) -> int:
        return v["n"] * 2

    def fan_out(x: int) -> list[int]:
        return [x, x + 1, x + 2] if x % 3 else []

    def keep(x: int) -> bool:
        return x % 5 != 0

    builder = StreamBuilder("stateless")
    (
        builder.source("in", json_deserializer)
        .map(double)
        .flat_map(fan_out)
        .filter(keep)
        .foreach(seen.append)
        .sink("out")
    )
    topology = builder.build()
    assert len(topology.stages) == 1
    sink_op = topology.stages[0].ops[-1].op_id
    rnd = random.Random(1)
    values = [{"n": rnd.randint(-50, 50)} for _ in range(200)]

    def reference(value: dict[str, int]) -> list[int]:
        return [x for x in fan_out(double(value)) if keep(x)]

    with TopologyTestDriver(topology, source_queues=3) as driver:
        piped = driver.pipe_many(values)
        driver.advance()
        by_origin = {
            (r.topic, r.queue_id, r.queue_offset): v for r, v in zip(piped, values, strict=True)
        }
        got: dict[tuple[str, int, int], list[tuple[int, Any]]] = defaultdict(list)
        for record, out in zip(driver.output_records(), driver.outputs(), strict=True):
            job, op, topic, queue, offset, seq = record.keys[0].split("/")
            assert (job, op) == ("stateless", sink_op)
            got[(topic, int(queue), int(offset))].append((int(seq), out))
        expected = {origin: reference(v) for origin, v in by_origin.items() if reference(v)}
        assert {o: [out for _, out in outs] for o, outs in got.items()} == expected
        assert all([s for s, _ in outs] == list(range(len(outs))) for outs in got.values())
        assert Counter(seen) == Counter(x for v in values for x in reference(v))


def test_print_writes_each_value() -> None:
    builder = StreamBuilder("printer")
    builder.source("in", text_deserializer).map(str.upper).filter(bool).print()
    lines = ["alpha", "beta", "gamma", "delta"]
    with TopologyTestDriver(builder.build(), source_queues=1) as driver:
        driver.pipe_many(lines)
        driver.advance()
        assert driver.printed() == [line.upper() for line in lines]


@pytest.mark.parametrize("selector", ["ts", lambda v: v["ts"] + 0])
def test_select_timestamp_sets_event_time(selector: str | Callable[[Any], int]) -> None:
    builder = StreamBuilder("selts")
    (
        builder.source("in", json_deserializer)
        .select_timestamp(selector)
        .key_by("k")
        .window(TumblingWindow.of(Time.seconds(10)))
        .count()
        .water_mark(1000)
        .to_rstream()
        .sink("out")
    )
    events = _events(4, 120)
    expected: Counter[tuple[str, int, int]] = Counter()
    for key, _value, ts in events:
        start = ts - ts % 10_000
        expected[(key, start, start + 10_000)] += 1
    rnd = random.Random(0)
    with TopologyTestDriver(builder.build(), source_queues=2) as driver:
        for key, _value, ts in events:
            # the born time is noise: select_timestamp must win
            driver.pipe({"k": key, "ts": ts}, event_time=rnd.randint(0, 10**12))
        driver.advance_idle()
        assert _fired(driver.outputs(), "count") == dict(expected)


# -- aggregates ----------------------------------------------------------------


class TopTwo(Accumulator):
    """A user accumulator: the two largest values (not decomposable: no pre-combine)."""

    kind = "top2"

    def zero(self) -> list[int]:
        return []

    def add(self, acc: list[int], value: Any) -> list[int]:
        return sorted([*acc, value["v"]], reverse=True)[:2]

    def merge(self, a: list[int], b: list[int]) -> list[int]:
        return sorted(a + b, reverse=True)[:2]


_AGGREGATES: dict[
    str, tuple[Callable[[GroupedStream], AggregatedStream], Callable[[list[int]], Any]]
] = {
    "count": (lambda g: g.count(), len),
    "sum": (lambda g: g.sum("v"), sum),
    "min": (lambda g: g.min("v"), min),
    "max": (lambda g: g.max(lambda r: r["v"]), max),
    "avg": (lambda g: g.avg("v"), lambda vs: sum(vs) / len(vs)),
    "top2": (lambda g: g.aggregate(TopTwo()), lambda vs: sorted(vs, reverse=True)[:2]),
}


@pytest.mark.parametrize("pre_combine", [True, False])
@pytest.mark.parametrize("kind", sorted(_AGGREGATES))
def test_keyed_aggregate(kind: str, pre_combine: bool) -> None:
    declare, reference = _AGGREGATES[kind]
    builder = StreamBuilder(f"agg-{kind}")
    grouped = builder.source("in", json_deserializer).key_by("k")
    declare(grouped).to_rstream().sink("out")
    topology = builder.build()
    assert topology.stages[0].combine == (kind != "top2")
    events = _events(len(kind), 300)
    values: dict[str, list[int]] = defaultdict(list)
    for key, value, _ts in events:
        values[key].append(value)
    with TopologyTestDriver(
        topology, source_queues=3, shuffle_queues=2, pre_combine=pre_combine
    ) as driver:
        for i in range(0, len(events), 50):
            _pipe_events(driver, events[i : i + 50])
            driver.advance()
        expected = {key: {kind: reference(vs)} for key, vs in values.items()}
        assert _latest(driver.outputs()) == expected
        assert {key: driver.state(key) for key in values} == expected


def test_several_aggregates_in_field_style() -> None:
    builder = StreamBuilder("fields")
    (
        builder.source("in", json_deserializer)
        .group_by("k")
        .count("n")
        .sum("v", "total")
        .min("v", "lo")
        .max("v", "hi")
        .avg("v", "mean")
        .to_rstream()
        .sink("out")
    )
    events = _events(12, 200)
    values: dict[str, list[int]] = defaultdict(list)
    for key, value, _ts in events:
        values[key].append(value)
    expected = {
        k: {"n": len(vs), "total": sum(vs), "lo": min(vs), "hi": max(vs), "mean": sum(vs) / len(vs)}
        for k, vs in values.items()
    }
    with TopologyTestDriver(builder.build(), max_records_per_batch=9) as driver:
        _pipe_events(driver, events)
        driver.advance()
        assert _latest(driver.outputs()) == expected


# -- windows -------------------------------------------------------------------


def _tumbling_ref(events: list[Event], size: int) -> dict[tuple[str, int, int], int]:
    sums: dict[tuple[str, int, int], int] = defaultdict(int)
    for key, value, ts in events:
        start = (ts // size) * size
        sums[(key, start, start + size)] += value
    return dict(sums)


def _sliding_ref(events: list[Event], size: int, slide: int) -> dict[tuple[str, int, int], int]:
    sums: dict[tuple[str, int, int], int] = defaultdict(int)
    for key, value, ts in events:
        first = ((ts - size) // slide + 1) * slide  # the first start with start + size > ts
        for start in range(first, ts + 1, slide):
            sums[(key, start, start + size)] += value
    return dict(sums)


def _session_ref(events: list[Event], gap: int) -> dict[tuple[str, int, int], int]:
    by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, value, ts in events:
        by_key[key].append((ts, value))
    sums: dict[tuple[str, int, int], int] = {}
    for key, items in by_key.items():
        items.sort()
        start, end, total = items[0][0], items[0][0] + gap, 0
        for ts, value in items:
            if ts > end:  # a gap: the session closes (touching sessions merge)
                sums[(key, start, end)] = total
                start, total = ts, 0
            end = max(end, ts + gap)
            total += value
        sums[(key, start, end)] = total
    return sums


_WINDOWS: dict[str, tuple[Any, Callable[[list[Event]], dict[tuple[str, int, int], int]]]] = {
    "tumbling": (TumblingWindow.of(Time.seconds(10)), lambda ev: _tumbling_ref(ev, 10_000)),
    "sliding": (
        SlidingWindow.of(Time.seconds(10), Time.seconds(4)),
        lambda ev: _sliding_ref(ev, 10_000, 4_000),
    ),
    "session": (
        SessionWindow.with_gap(Time.seconds(3)),
        lambda ev: _session_ref(ev, 3_000),
    ),
}


def _windowed_topology(job: str, spec: Any, lateness_s: float) -> Topology:
    builder = StreamBuilder(job)
    (
        builder.source("in", json_deserializer)
        .key_by("k")
        .window(spec)
        .sum("v", "sum")
        .water_mark(lateness_s)
        .to_rstream()
        .sink("out")
    )
    return builder.build()


@pytest.mark.parametrize("max_records", [None, 7])
@pytest.mark.parametrize("kind", sorted(_WINDOWS))
def test_windowed_sum(kind: str, max_records: int | None) -> None:
    spec, reference = _WINDOWS[kind]
    events = _events(7, 250, span=90_000)
    # Lateness covers the whole span: nothing is late, every window fires exactly once.
    topology = _windowed_topology(f"win-{kind}", spec, lateness_s=100)
    with TopologyTestDriver(topology, max_records_per_batch=max_records) as driver:
        _pipe_events(driver, events)
        driver.advance()
        driver.advance_idle()
        assert _fired(driver.outputs(), "sum") == reference(events)
        assert sum(s.late for s in driver.stats) == 0


def test_session_windows_merge_when_a_record_bridges_them() -> None:
    topology = _windowed_topology("bridge", SessionWindow.with_gap(Time.seconds(1)), 60)
    events = [("k", 1, 0), ("k", 2, 1_800), ("k", 4, 900), ("k", 8, 5_000)]
    with TopologyTestDriver(topology, source_queues=1, shuffle_queues=1) as driver:
        for event in events[:2]:
            _pipe_events(driver, [event])
            driver.advance()
        assert len(driver.state("k")) == 2  # [0, 1000) and [1800, 2800): apart
        _pipe_events(driver, events[2:3])
        driver.advance()
        assert len(driver.state("k")) == 1  # 900 bridges them into one session
        _pipe_events(driver, events[3:])
        driver.advance_idle()
        assert _fired(driver.outputs(), "sum") == _session_ref(events, 1_000)


@pytest.mark.parametrize("pre_combine", [True, False])
def test_a_record_inside_a_still_open_session_is_on_time(pre_combine: bool) -> None:
    """Judged by the session it merges into, not by its own [t, t + gap).

    Key ``b`` moves the watermark (lateness 0) past ``a``'s record's own window,
    but ``a``'s session, which that record falls into, is still open.
    """
    topology = _windowed_topology("open-session", SessionWindow.with_gap(Time.seconds(5)), 0)
    first = [("a", 1, 0), ("a", 1, 4_000), ("a", 1, 8_000), ("b", 1, 12_000)]
    inside = [("a", 1, 6_000)]
    with TopologyTestDriver(
        topology, source_queues=1, shuffle_queues=1, pre_combine=pre_combine
    ) as driver:
        _pipe_events(driver, first)
        driver.advance()
        assert driver.state("a") is not None, "a's session [0, 13000) must still be open"
        _pipe_events(driver, inside)
        driver.advance_idle()
        assert sum(s.late for s in driver.stats) == 0
        assert _fired(driver.outputs(), "sum") == _session_ref(first + inside, 5_000)


def test_a_record_that_only_reaches_a_closed_session_is_late() -> None:
    topology = _windowed_topology("closed-session", SessionWindow.with_gap(Time.seconds(1)), 0)
    with TopologyTestDriver(topology, source_queues=1, shuffle_queues=1) as driver:
        _pipe_events(driver, [("a", 1, 0), ("b", 1, 5_000)])
        driver.advance()  # a's [0, 1000) fired: the watermark is 5000
        _pipe_events(driver, [("a", 1, 500)])
        driver.advance_idle()
        assert sum(s.late for s in driver.stats) == 1
        assert _fired(driver.outputs(), "sum") == {("a", 0, 1_000): 1, ("b", 5_000, 6_000): 1}


# -- pre-combine ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tumbling", "sliding", "unwindowed"])
def test_pre_combine_gives_the_same_results(kind: str) -> None:
    builder = StreamBuilder(f"comb-{kind}")
    grouped = builder.source("in", json_deserializer).key_by("k")
    if kind != "unwindowed":
        grouped = grouped.window(_WINDOWS[kind][0])
    (
        grouped.count("n")
        .sum("v", "s")
        .min("v", "lo")
        .max("v", "hi")
        .avg("v", "mean")
        .water_mark(2)
        .to_rstream()
        .sink("out")
    )
    topology = builder.build()
    # Mostly in event-time order; a fifth pulled back by up to 3 s, beyond the 2 s
    # lateness for some: batches with such a record go per record, the rest combine.
    rnd = random.Random(22)
    events = [
        (k, v, max(0, ts - (rnd.randint(0, 3_000) if rnd.random() < 0.2 else 0)))
        for k, v, ts in sorted(_events(21, 400, keys="abc", span=80_000), key=lambda e: e[2])
    ]
    results = {}
    for pre_combine in (True, False):
        with TopologyTestDriver(
            topology,
            source_queues=2,
            shuffle_queues=3,
            pre_combine=pre_combine,
            max_records_per_batch=25,
        ) as driver:
            for i in range(0, len(events), 40):
                _pipe_events(driver, events[i : i + 40])
                driver.advance()
            driver.advance_idle()
            shuffle = driver.output_records(topology.shuffle_topics[0])
            combined = sum("comb" in decode(r.body) for r in shuffle)
            entries = sum(s.shuffle_records for s in driver.stats if s.stage == 0)
            late = sum(s.late for s in driver.stats)
            results[pre_combine] = (driver.outputs(), late, combined, entries)
    (on, late_on, combined_on, entries_on), (off, late_off, combined_off, entries_off) = (
        results[True],
        results[False],
    )
    assert on == off  # same results, same order
    assert late_on == late_off
    assert combined_off == 0 and combined_on > 0
    if kind != "sliding":
        # (sliding: one partial per window a record falls in, so sparse keys can make
        # more entries than records)
        assert entries_on < entries_off


def test_combining_starts_at_the_offset_the_query_started_from() -> None:
    builder = StreamBuilder("from")
    builder.source("in", json_deserializer).key_by("k").count().to_rstream().sink("out")
    topology = builder.build()
    records = [_record("in", 0, off, {"k": "ab"[off % 2]}) for off in range(6)]

    def shuffle_bodies(ctx: StageContext, start: int) -> list[dict[str, Any]]:
        broker = _broker_for(topology, 1, 1)
        batch = [r for r in records if r.queue_offset >= start]
        run_source_batch(ctx, 0, start, 6, batch, broker)
        return [decode(r.body) for r in broker.topic(topology.shuffle_topics[0]).log]

    base = StageContext.of(topology, 0, shuffle_queues=1, source_queues=(0,))
    started_at_3 = StageContext.of(
        topology, 0, shuffle_queues=1, source_queues=(0,), combine_from=((0, 3),)
    )
    assert ["recs" in b for b in shuffle_bodies(base, 0)] == [True]  # no combine_from: never
    assert ["recs" in b for b in shuffle_bodies(started_at_3, 0)] == [True]  # below the start
    [body] = shuffle_bodies(started_at_3, 3)
    assert body["end"][0] == 5 and body["n"] == 3
    counts = Counter("ab"[off % 2] for off in range(3, 6))
    assert {entry[0]: entry[3][0] for entry in body["comb"]} == dict(counts)
    off = StageContext.of(
        topology,
        0,
        shuffle_queues=1,
        source_queues=(0,),
        combine_from=((0, 0),),
        pre_combine=False,
    )
    assert ["recs" in b for b in shuffle_bodies(off, 0)] == [True]


# -- lateness against the per-origin watermark ----------------------------------


def test_a_fast_origin_does_not_make_a_slow_origins_records_late() -> None:
    size = 10_000
    fast = [(100_000, 1), (104_000, 1)]  # queue 0, far ahead
    slow_on_time = [(5_000, 10), (2_000, 20), (7_000, 40)]  # queue 1, behind
    slow_after_idle = (8_000, 80)
    topology = _windowed_topology("origins", TumblingWindow.of(Time.seconds(10)), 0)

    def run(source_queues: int) -> tuple[list[dict[str, Any]], int]:
        slow_queue = source_queues - 1
        with TopologyTestDriver(topology, source_queues=source_queues, shuffle_queues=1) as d:
            for ts, v in fast:
                d.pipe({"k": "k", "v": v}, event_time=ts, queue=0)
                d.advance()
            for ts, v in slow_on_time:
                d.pipe({"k": "k", "v": v}, event_time=ts, queue=slow_queue)
                d.advance()
            late_before_idle = sum(s.late for s in d.stats)
            d.advance_idle(queues=[slow_queue])
            ts, v = slow_after_idle
            d.pipe({"k": "k", "v": v}, event_time=ts, queue=slow_queue)
            d.advance()
            assert sum(s.late for s in d.stats) == late_before_idle + 1  # the window fired
            return d.outputs(), late_before_idle

    # Two source queues: the slow queue's records are on time until it is idle.
    outputs, late = run(source_queues=2)
    assert late == 0
    first_window = [v for ts, v in slow_on_time if ts < size]
    assert outputs == [
        {"key": "k", "sum": sum(first_window), "window_start": 0, "window_end": size}
    ]
    # One queue carrying both: the same records are late behind the fast ones.
    outputs, late = run(source_queues=1)
    assert late == len(slow_on_time)
    assert [o for o in outputs if o["window_start"] == 0] == []


# -- exactly once across the shuffle --------------------------------------------


@pytest.mark.parametrize("pre_combine", [True, False])
def test_resent_shuffle_messages_are_applied_once(tmp_path: Path, pre_combine: bool) -> None:
    builder = StreamBuilder("dedupe")
    builder.source("in", json_deserializer).key_by("k").sum("v").to_rstream().sink("out")
    topology = builder.build()
    broker = _broker_for(topology, 1, 1)
    ctx0 = StageContext.of(
        topology,
        0,
        shuffle_queues=1,
        source_queues=(0,),
        pre_combine=pre_combine,
        combine_from=((0, 0),),
    )
    ctx1 = StageContext.of(topology, 1, shuffle_queues=1, source_queues=(0,), writer="t")
    events = _events(3, 30)
    records = [_record("in", 0, i, {"k": k, "v": v}) for i, (k, v, _) in enumerate(events)]
    shuffle = broker.topic(topology.shuffle_topics[0])
    for start, end in ((0, 10), (10, 20)):
        run_source_batch(ctx0, 0, start, end, records[start:end], broker)
    assert all(("comb" in decode(r.body)) == pre_combine for r in shuffle.log)
    agg = topology.stages[1].aggregate
    assert agg is not None

    def expected_sums(n: int) -> dict[str, int]:
        sums: dict[str, int] = defaultdict(int)
        for k, v, _ in events[:n]:
            sums[k] += v
        return dict(sums)

    with QueueStateStore(tmp_path, topology.job_id, agg.op_id, 0) as store:
        first = run_keyed_batch(ctx1, 0, shuffle.end(0), shuffle.read(0, 0), store, broker)
        assert first.records_in == 20 and first.skipped_duplicates == 0
        seq = store.meta.seq
        # the same messages again (a replayed batch, or the shuffle read twice)
        again = run_keyed_batch(ctx1, 0, shuffle.end(0), shuffle.read(0, 0), store, broker)
        assert again.records_in == 0
        assert again.skipped_duplicates == sum(
            len(decode(r.body).get("recs") or decode(r.body)["comb"]) for r in shuffle.log
        )
        assert store.meta.seq == seq  # nothing to commit
        # a replay per record of a prefix plus new input: only the new input counts
        ctx0_restarted = StageContext.of(topology, 0, shuffle_queues=1, source_queues=(0,))
        mark = shuffle.end(0)
        run_source_batch(ctx0_restarted, 0, 15, 30, records[15:30], broker)
        third = run_keyed_batch(ctx1, 0, shuffle.end(0), shuffle.read(0, mark), store, broker)
        assert (third.records_in, third.skipped_duplicates) == (10, 5)
    sums = _latest([json.loads(r.body) for r in broker.topic("out").log])
    assert {k: v["sum"] for k, v in sums.items()} == expected_sums(30)


# -- fencing ----------------------------------------------------------------------


def test_an_older_generation_is_fenced_and_a_newer_one_claims(tmp_path: Path) -> None:
    builder = StreamBuilder("fence")
    builder.source("in", json_deserializer).key_by("k").count().to_rstream().sink("out")
    topology = builder.build()
    agg = topology.stages[1].aggregate
    assert agg is not None
    broker = _broker_for(topology, 1, 1)
    state_topic = broker.topic(topology.state_topics[0])
    ctx0 = StageContext.of(topology, 0, shuffle_queues=1, source_queues=(0,))
    run_source_batch(ctx0, 0, 0, 1, [_record("in", 0, 0, {"k": "a"})], broker)
    shuffle = broker.topic(topology.shuffle_topics[0])

    def ctx(generation: int, writer: str) -> StageContext:
        return StageContext.of(
            topology,
            1,
            shuffle_queues=1,
            source_queues=(0,),
            generation=generation,
            writer=writer,
        )

    with QueueStateStore(tmp_path, topology.job_id, agg.op_id, 0) as store:
        run_keyed_batch(ctx(5, "new-owner"), 0, 0, [], store, broker)  # claims, no input
        assert (store.meta.generation, store.meta.writer) == (5, "new-owner")
        assert state_topic.end(0) == 1  # the claim is in the state topic
        sent = len(broker.topic("out").log), state_topic.end(0)
        with pytest.raises(FencedError, match="generation 5"):
            run_keyed_batch(ctx(4, "old-owner"), 0, 1, shuffle.read(0, 0), store, broker)
        assert (len(broker.topic("out").log), state_topic.end(0)) == sent  # nothing sent
        assert store.meta.generation == 5 and store.get(b"k" + b"\xa1a") is None
        stats = run_keyed_batch(ctx(5, "new-owner"), 0, 1, shuffle.read(0, 0), store, broker)
        assert stats.records_in == 1


# -- values the shuffle cannot carry ---------------------------------------------


@pytest.mark.parametrize("pre_combine", [True, False])
def test_values_the_shuffle_cannot_encode_go_to_dead_letters(pre_combine: bool) -> None:
    def shape(v: dict[str, Any]) -> dict[str, Any]:
        if v["kind"] == "set":
            return {**v, "payload": {1, 2}}
        if v["kind"] == "huge":
            return {**v, "payload": 2**64 + v["n"]}
        return v

    builder = StreamBuilder("unencodable")
    (
        builder.source("in", json_deserializer)
        .map(shape)
        .key_by(lambda v: v["k"] if v["kind"] != "setkey" else frozenset(v["k"]))
        .count()
        .to_rstream()
        .sink("out")
    )
    topology = builder.build()
    key_op = topology.stages[0].exits[0].key_by.op_id
    rnd = random.Random(6)
    values = [
        {
            "kind": rnd.choice(["ok", "ok", "ok", "set", "huge", "setkey"]),
            "k": rnd.choice("xy"),
            "n": i,
        }
        for i in range(80)
    ]
    with TopologyTestDriver(topology, source_queues=2, pre_combine=pre_combine) as driver:
        piped = driver.pipe_many(values)
        driver.advance()
        bad = [r.body for r, v in zip(piped, values, strict=True) if v["kind"] != "ok"]
        dead = driver.dead_letters()
        assert sorted(body for body, _ in dead) == sorted(bad)
        assert {props["operator"] for _, props in dead} == {key_op}
        assert all("PackingError" in props["reason"] for _, props in dead)
        expected = Counter(v["k"] for v in values if v["kind"] == "ok")
        assert {k: v["count"] for k, v in _latest(driver.outputs()).items()} == dict(expected)


# -- regressions: defects found while writing these tests, now fixed -------------


def test_an_aggregate_that_overflows_the_codec_emits_only_committed_values() -> None:
    builder = StreamBuilder("overflow")
    builder.source("in", json_deserializer).key_by("k").sum("v").to_rstream().sink("out")
    values = [2**63, 2**63]  # each fits msgpack's uint64; their sum does not
    with TopologyTestDriver(builder.build(), source_queues=1, pre_combine=False) as driver:
        driver.pipe_many([{"k": "a", "v": v} for v in values])
        driver.advance()
        [(_body, props)] = driver.dead_letters()
        assert props["operator"] == "aggregate"
        committed = driver.state("a")
        assert committed == {"sum": values[0]}
        assert driver.outputs() == [{"key": "a", **committed}]


def test_partials_merged_per_key_overflow_as_folding_each_would() -> None:
    """A keyed step merges a key's partials from several source queues before folding
    them (keyed/partials.py); where the merged sum overflows the state codec, each
    partial is folded alone, so the state and the dead letter are what folding them
    one by one gives: the first two partials fit, the third does not."""
    builder = StreamBuilder("overflow-merged")
    builder.source("in", json_deserializer).key_by("k").sum("v").to_rstream().sink("out")
    values = [2**62, 2**62, 2**63]  # 2**63 fits msgpack's uint64; 2**64 does not
    with TopologyTestDriver(builder.build(), source_queues=3, pre_combine=True) as driver:
        for queue, v in enumerate(values):
            driver.pipe({"k": "a", "v": v}, queue=queue)
        driver.advance()
        [(_body, props)] = driver.dead_letters()
        assert props["operator"] == "aggregate"
        assert driver.state("a") == {"sum": values[0] + values[1]}
        assert driver.outputs() == [{"key": "a", "sum": values[0] + values[1]}]


def test_a_keyed_step_leaves_no_reference_cycle_behind() -> None:
    """A step's results are freed as it ends, not by the garbage collector: a cycle
    through the batch (its dead-letter callback was a method of the batch's runner)
    kept thousands of objects a step alive until a collection, and collections
    were a sixth of a real-time task's time."""
    words = [f"w{i}" for i in range(300)]
    rnd = random.Random(5)
    with TopologyTestDriver(wordcount.build(), source_queues=2, shuffle_queues=2) as driver:

        def step() -> None:
            for queue in range(2):
                lines = [" ".join(rnd.choices(words, k=8)) for _ in range(40)]
                driver.pipe_many(lines, queue=queue)
            driver.advance()

        step()  # caches and stores opened, once
        gc.collect()
        gc.disable()
        try:
            step()
            step()
            unreachable = gc.collect()
        finally:
            gc.enable()
        assert len(driver.outputs()) > 300  # the steps ran and emitted their counts
        assert unreachable == 0


def test_records_of_an_origin_that_just_became_idle_are_not_late(tmp_path: Path) -> None:
    topology = _windowed_topology("idle-race", TumblingWindow.of(Time.seconds(10)), 0)
    agg = topology.stages[1].aggregate
    assert agg is not None
    broker = _broker_for(topology, 2, 1)
    ctx0 = StageContext.of(topology, 0, shuffle_queues=1, source_queues=(0, 1))
    ctx1 = StageContext.of(topology, 1, shuffle_queues=1, source_queues=(0, 1))
    shuffle = broker.topic(topology.shuffle_topics[0])
    run_source_batch(ctx0, 0, 0, 1, [_record("in", 0, 0, {"k": "k", "v": 1}, 100_000)], broker)
    run_source_batch(ctx0, 1, 0, 1, [_record("in", 1, 0, {"k": "k", "v": 1}, 5_000)], broker)
    with QueueStateStore(tmp_path, topology.job_id, agg.op_id, 0) as store:
        first = run_keyed_batch(ctx1, 0, shuffle.end(0), shuffle.read(0, 0), store, broker)
        assert first.watermark == 5_000  # window [0, 10 s) is open
        mark = shuffle.end(0)
        # queue 1 sends an on-time record, then stays quiet past the idle timeout
        # before the stateful stage gets to read it
        run_source_batch(ctx0, 1, 1, 2, [_record("in", 1, 1, {"k": "k", "v": 1}, 6_000)], broker)
        second = run_keyed_batch(
            ctx1, 0, shuffle.end(0), shuffle.read(0, mark), store, broker, idle_origins=(1,)
        )
        assert second.late == 0
        assert json.loads(broker.topic("out").log[0].body)["sum"] == 2


def test_dead_letters_of_distinct_results_have_distinct_keys() -> None:
    def explode(result: dict[str, Any]) -> dict[str, Any]:
        raise ValueError(result["key"])

    builder = StreamBuilder("dlkeys")
    (
        builder.source("in", json_deserializer)
        .key_by("k")
        .count()
        .to_rstream()
        .map(explode)
        .sink("out")
    )
    keys = ["a", "b", "c"]
    with TopologyTestDriver(builder.build(), source_queues=1, shuffle_queues=1) as driver:
        driver.pipe_many([{"k": k} for k in keys])
        driver.advance()
        records = driver.output_records(driver.topology.dead_letter_topic)
        assert len(records) == len(keys)
        assert len({r.key for r in records}) == len(keys)


def test_a_result_key_with_a_space_stays_one_message_key() -> None:
    builder = StreamBuilder("spaces")
    builder.source("in", json_deserializer).key_by("k").count().to_rstream().sink("out")
    with TopologyTestDriver(builder.build(), source_queues=1) as driver:
        driver.pipe({"k": "new york"})
        driver.advance()
        [record] = driver.output_records()
        assert len(record.keys) == 1


def test_a_sink_body_the_broker_cannot_take_is_that_records_dead_letter() -> None:
    """A serializer returning text, or a body over the size limit, fails its record only."""
    limit = 1024

    def serialize(v: dict[str, Any]) -> Any:
        if v["kind"] == "text":
            return json.dumps(v)  # str, not bytes
        if v["kind"] == "huge":
            return b"x" * (limit + 1)
        return json.dumps(v).encode()

    builder = StreamBuilder("bodies")
    builder.source("in", json_deserializer).sink("out", serialize)
    topology = builder.build()
    values = [{"n": i, "kind": ["ok", "text", "huge"][i % 3]} for i in range(30)]
    with TopologyTestDriver(topology, source_queues=1, max_message_size=limit) as driver:
        driver.pipe_many(values)
        driver.advance()
        assert [json.loads(b)["n"] for b in driver.outputs("out")] == [
            v["n"] for v in values if v["kind"] == "ok"
        ]
        letters = driver.dead_letters()
    assert sorted(json.loads(body)["n"] for body, _ in letters) == [
        v["n"] for v in values if v["kind"] != "ok"
    ]
    sink_op = next(iter(topology.stages[0].nodes))
    reasons = {json.loads(body)["kind"]: props for body, props in letters}
    assert reasons["text"]["operator"] == sink_op and "bytes" in reasons["text"]["reason"]
    assert "MessageTooLarge" in reasons["huge"]["reason"]


def test_results_straight_to_sinks_fail_alone_naming_the_sink(capsys: Any) -> None:
    """An aggregate whose results go straight to a sink and a print (no operator between:
    OperatorGraph hands them over without its walk): a result the sink's serializer
    refuses is a dead letter naming the sink, and every other result reaches both."""
    words = [random.Random(3).choice(["ok", "no", "fine", "bad"]) for _ in range(40)]

    def serialize(result: dict[str, Any]) -> bytes:
        if result["key"] in ("no", "bad"):
            raise ValueError(f"refused {result['key']}")
        return json.dumps(result).encode()

    builder = StreamBuilder("direct")
    counted = builder.source("in", text_deserializer).key_by(str).count().to_rstream()
    counted.sink("out", serialize)
    counted.print()
    topology = builder.build()
    with TopologyTestDriver(topology, source_queues=1, shuffle_queues=1) as driver:
        driver.pipe_many(words)
        driver.advance()
        sent = {json.loads(b)["key"]: json.loads(b)["count"] for b in driver.outputs("out")}
        letters = driver.dead_letters()
    expected = Counter(words)
    assert sent == {w: c for w, c in expected.items() if w not in ("no", "bad")}
    sink_op = next(op for op, node in topology.stages[1].nodes.items() if op.startswith("sink"))
    assert sorted(json.loads(body)["key"] for body, _ in letters) == sorted(
        w for w in expected if w in ("no", "bad")
    )
    assert {props["operator"] for _, props in letters} == {sink_op}
    assert all("ValueError: refused" in props["reason"] for _, props in letters)
    printed = capsys.readouterr().out
    # The print comes after the sink: a result the sink refused never reached it.
    assert sorted(printed.split("\n")[:-1]) == sorted(
        str({"key": w, "count": c}) for w, c in expected.items() if w not in ("no", "bad")
    )


@pytest.mark.parametrize("restore", [False, True])
def test_a_keyed_stage_sends_its_committed_outbox_after_a_crash(
    monkeypatch: pytest.MonkeyPatch, restore: bool
) -> None:
    """Crash after the commit, before the outbox went: the next batch (or a restore
    elsewhere) sends it, and the next stage applies every result exactly once."""
    from stream_assets.runtime.core.keyed import emit as keyed_emit
    from stream_assets.windows import Time, TumblingWindow

    builder = StreamBuilder("outbox")
    (
        builder.source("in", text_deserializer)
        .flat_map(str.split)
        .key_by(lambda w: w)
        .window(TumblingWindow.of(Time.seconds(60)))
        .count()
        .to_rstream()
        .key_by(lambda r: r["count"])
        .count("words")
        .to_rstream()
        .sink("hist")
    )
    rnd = random.Random(4)
    lines = [" ".join(rnd.choices("abcdefghij", k=5)) for _ in range(40)]
    reference = Counter(Counter(w for line in lines for w in line.split()).values())
    real_send = keyed_emit.send_outbox
    crashes = []

    def crash_once(*args: Any, **kwargs: Any) -> None:
        entries = args[4]  # an outbox with results (not only this queue's progress)
        if entries and not crashes:
            crashes.append(1)
            raise RuntimeError("executor lost after the commit")
        real_send(*args, **kwargs)

    monkeypatch.setattr(keyed_emit, "send_outbox", crash_once)
    with TopologyTestDriver(builder.build(), source_queues=2, shuffle_queues=1) as driver:
        driver.pipe_many(lines, event_time=1_000)
        driver.advance()
        with pytest.raises(RuntimeError, match="executor lost"):
            driver.advance_idle()  # the window fires; its results are committed, not sent
        if restore:
            driver.restore_state()
        driver.advance_idle()
        hist = {v["key"]: v["words"] for v in driver.outputs("hist")}
        assert crashes and hist == dict(reference)
        head = driver.topology.stages[2].head
        assert head is not None
        for count, words in reference.items():
            assert driver.state(count, operator=head.op_id) == {"words": words}
