"""The user's stateful logic (``process()``), state TTL and window emit modes, through
TopologyTestDriver (the same per-queue core as the engine, real RocksDB).

References are computed from the input alone (per key, in arrival order, by the
contract in stream_assets/operators/processor.py), never from the engine.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import dedup, silence_alert, top_words
from stream_assets.operators.processor import (
    MapState,
    ProcessContext,
    Processor,
    TimerContext,
    map_item,
    map_key,
)
from stream_assets.serde import json_deserializer
from stream_assets.testing import TopologyTestDriver
from stream_assets.windows import Time, TumblingWindow

FLUSH_AT = 10**12  # an event time past every timer the tests set


def _keyed_stream(rnd: random.Random, keys: int, n: int, gap_max: int) -> list[dict[str, Any]]:
    """``n`` events over ``keys`` keys, in time order (no record is late); a key's
    gaps vary from none to many times ``gap_max``."""
    clock = 0
    events = []
    for i in range(n):
        clock += rnd.randrange(gap_max)
        key = f"k{rnd.randrange(keys)}"
        events.append({"id": key, "device": key, "t": clock, "n": i})
    return events


def _pipe(driver: TopologyTestDriver, events: list[dict[str, Any]], key_field: str) -> None:
    """Each key from one source queue (as a producer keyed by it), in order; then a
    flush event per source queue far in the future moves the watermark past everything."""
    driver.pipe_many(events, event_time=lambda e: e["t"], key=lambda e: e[key_field])
    for q in range(driver.source_queues):
        flush = {"id": f"flush-{q}", "device": f"flush-{q}", "t": FLUSH_AT, "n": -1}
        driver.pipe(flush, event_time=FLUSH_AT, queue=q)


def _dedup_reference(events: list[dict[str, Any]], horizon: int) -> list[int]:
    passed_at: dict[str, int] = {}
    out = []
    for e in events:
        last = passed_at.get(e["id"])
        if last is None or e["t"] >= last + horizon:
            passed_at[e["id"]] = e["t"]
            out.append(e["n"])
    return sorted(out)


@pytest.mark.parametrize("batch", [None, 7])
def test_dedup_passes_the_first_event_of_each_horizon(batch: int | None) -> None:
    rnd = random.Random(11)
    horizon = 500
    events = _keyed_stream(rnd, keys=12, n=400, gap_max=120)
    topo = dedup.build(horizon_ms=horizon)
    with TopologyTestDriver(topo, source_queues=3, max_records_per_batch=batch) as driver:
        _pipe(driver, events, "id")
        driver.advance()
        got = sorted(v["n"] for v in driver.outputs() if v["n"] >= 0)
        assert got == _dedup_reference(events, horizon)
        assert not driver.dead_letters()


def _silence_reference(events: list[dict[str, Any]], silence: int) -> list[tuple[str, int]]:
    last: dict[str, int] = {}
    alerts = []
    for e in events:
        before = last.get(e["device"])
        if before is not None and e["t"] >= before + silence:
            alerts.append((e["device"], before))
        last[e["device"]] = e["t"]
    # The flush moves the watermark past every key's last timer.
    alerts += [(device, t) for device, t in last.items()]
    return sorted(alerts)


@pytest.mark.parametrize("batch", [None, 5])
def test_silence_alert_fires_once_per_silence(batch: int | None) -> None:
    rnd = random.Random(5)
    silence = 300
    events = _keyed_stream(rnd, keys=8, n=300, gap_max=200)
    topo = silence_alert.build(silence_ms=silence)
    with TopologyTestDriver(topo, source_queues=2, max_records_per_batch=batch) as driver:
        _pipe(driver, events, "device")
        driver.advance()
        alerts = [v for v in driver.outputs() if not v["device"].startswith("flush")]
        assert sorted((a["device"], a["last_seen"]) for a in alerts) == _silence_reference(
            events, silence
        )
        assert all(a["silent_at"] == a["last_seen"] + silence for a in alerts)


def test_top_words_per_window_and_key() -> None:
    rnd = random.Random(3)
    window = 1_000
    clock = [0, 0]
    entries = []
    for _ in range(600):
        q = rnd.randrange(2)
        clock[q] += rnd.randrange(40)
        lang = "en" if q == 0 else rnd.choice(["fr", "de"])  # each language from one queue
        entries.append({"lang": lang, "word": rnd.choice("abcdefg"), "t": clock[q], "q": q})
    reference: dict[tuple[str, int], Counter[str]] = defaultdict(Counter)
    for e in entries:
        reference[(e["lang"], e["t"] - e["t"] % window)][e["word"]] += 1
    topo = top_words.build(window_ms=window, n=3)
    with TopologyTestDriver(topo, source_queues=2, max_records_per_batch=11) as driver:
        for e in entries:
            driver.pipe(e, event_time=e["t"], queue=0 if e["lang"] == "en" else 1)
        for q in range(2):
            driver.pipe(
                {"lang": f"flush{q}", "word": "-", "t": FLUSH_AT}, queue=q, event_time=FLUSH_AT
            )
        driver.advance()
        got = {
            (v["key"], v["window_start"]): v["top"]
            for v in driver.outputs()
            if not v["key"].startswith("flush")
        }
    assert got == {k: top_words.top(dict(c), 3) for k, c in reference.items()}


class _Ping(Processor):
    """Emits on a processing-time timer 1 s after each key's first record."""

    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        if ctx.value("armed").get() is None:
            ctx.value("armed").set(True)
            ctx.set_processing_timer(ctx.processing_time + 1_000)

    def on_timer(self, key: Any, ctx: TimerContext) -> None:
        ctx.emit({"key": key, "timer": ctx.timer})


def test_processing_time_timers_fire_by_the_wall_clock() -> None:
    b = StreamBuilder("ping")
    b.source("in", json_deserializer).key_by("k").process(_Ping()).sink("out")
    with TopologyTestDriver(b.build(), source_queues=2) as driver:
        driver.advance_wall_clock(5_000)
        driver.pipe_many([{"k": "a"}, {"k": "b"}, {"k": "a"}], event_time=1)
        driver.advance()
        driver.advance_wall_clock(5_999)
        assert driver.outputs() == []
        driver.advance_wall_clock(6_000)
        assert sorted(v["key"] for v in driver.outputs()) == ["a", "b"]
        assert {v["timer"] for v in driver.outputs()} == {"processing"}
        driver.advance_wall_clock(60_000)
        assert len(driver.outputs()) == 2  # a timer fires once
        with pytest.raises(ValueError, match="only moves forward"):
            driver.advance_wall_clock(1)


class _Collect(Processor):
    """Keeps every value in list, map and value state; emits the count so far."""

    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        ctx.list("seen").append(value["v"])
        ctx.map("by_v").put(value["v"], ctx.timestamp)
        total = ctx.value("total").get(0) + 1
        ctx.value("total").set(total)
        if value["v"] == 13:
            raise RuntimeError("unlucky")  # none of this record's changes may stay
        ctx.emit({"key": key, "total": total})


def test_process_state_survives_a_restore_and_a_failure_leaves_nothing() -> None:
    b = StreamBuilder("collect")
    b.source("in", json_deserializer).key_by("k").process(_Collect()).sink("out")
    values = [{"k": "x" if i % 3 else "y", "v": i} for i in range(30)]
    with TopologyTestDriver(b.build(), source_queues=1, shuffle_queues=2) as driver:
        driver.pipe_many(values[:15], event_time=10)
        driver.advance()
        driver.restore_state()  # wipe RocksDB, rebuild from the state topic
        driver.pipe_many(values[15:], event_time=20)
        driver.advance()
        expected = {"x": [v["v"] for v in values if v["k"] == "x" and v["v"] != 13]}
        expected["y"] = [v["v"] for v in values if v["k"] == "y"]
        for key, seen in expected.items():
            state = driver.state(key)
            assert state["seen"] == seen and state["total"] == len(seen)
            assert sorted(state["by_v"]) == sorted(seen)
        totals = [v["total"] for v in driver.outputs() if v["key"] == "x"]
        assert totals == list(range(1, len(expected["x"]) + 1))
        (letter,) = driver.dead_letters()
        assert b"unlucky" in letter[0] or "unlucky" in str(letter[1])


def test_map_state_keys_sort_by_value_within_their_type() -> None:
    ints = [-(2**40), -3, 0, 5, 127, 128, 300, 2**40]
    assert sorted(ints, key=map_item) == ints
    assert [map_key(map_item(k)) for k in ints] == ints
    assert sorted(["b", "a", "ab"], key=map_item) == ["a", "ab", "b"]
    with pytest.raises(TypeError, match="ints, strings or bytes"):
        map_item(1.5)  # type: ignore[arg-type]


class _RangeReader(Processor):
    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        scores: MapState = ctx.map("scores")
        scores.put(value["score"], value["who"])
        if value["who"] == "query":
            ctx.emit([k for k, _ in scores.items(10, 100)])


def test_map_state_reads_a_range_in_order_including_this_batchs_writes() -> None:
    b = StreamBuilder("range")
    b.source("in", json_deserializer).key_by(lambda v: "all").process(_RangeReader()).sink("out")
    scores = [150, 5, 99, 10, 42, 100, 77]
    with TopologyTestDriver(b.build(), source_queues=1, max_records_per_batch=3) as driver:
        driver.pipe_many([{"score": s, "who": "p"} for s in scores], event_time=1)
        driver.advance()  # part of them committed in RocksDB, part in the batch
        driver.pipe({"score": 1000, "who": "query"}, event_time=1)
        driver.advance()
        assert driver.outputs() == [sorted(s for s in scores if 10 <= s < 100)]


def test_process_rejects_a_window_and_a_non_processor() -> None:
    b = StreamBuilder("bad")
    stream = b.source("in", json_deserializer)
    with pytest.raises(TypeError, match="Processor instance"):
        stream.key_by("k").process(lambda k, v, c: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="takes no window"):
        stream.key_by("k").window(TumblingWindow.of(Time.seconds(1))).process(_Ping())


def test_ttl_keeps_the_store_bounded_over_many_keys() -> None:
    """20 000 distinct keys over a moving clock: the store holds about one TTL's worth."""
    ttl = 1_000
    b = StreamBuilder("bounded")
    b.source("in", json_deserializer).key_by("id").count().ttl(ttl / 1000).to_rstream().sink("out")
    per_ms = 5  # keys per ms of event time: one TTL holds ~5 000 keys
    with TopologyTestDriver(b.build(), source_queues=1, shuffle_queues=1) as driver:
        peak = 0
        for chunk in range(20):
            base = chunk * 1_000
            for i in range(1_000):
                driver.pipe({"id": base + i}, event_time=(base + i) // per_ms)
            driver.advance()
            peak = max(peak, driver.stats[-1].state_keys)
        # Each live key is held by its value, its expiry time and its expiry index
        # entry; one TTL of keys is ~ttl * per_ms.
        assert peak <= 3 * (ttl * per_ms + 1_000) + 10
        assert peak < 3 * 20_000 / 2


def test_ttl_needs_an_unwindowed_aggregate() -> None:
    b = StreamBuilder("bad-ttl")
    grouped = b.source("in", json_deserializer).key_by("k")
    with pytest.raises(ValueError, match="unwindowed"):
        grouped.window(TumblingWindow.of(Time.seconds(1))).count().ttl(5)
    with pytest.raises(ValueError, match="> 0 seconds"):
        grouped.count().ttl(0)


def _windowed_counts(emit_every: float) -> StreamBuilder:
    b = StreamBuilder(f"early-{emit_every}")
    (
        b.source("in", json_deserializer)
        .key_by("k")
        .window(TumblingWindow.of(Time.seconds(1)))
        .count()
        .emit_early(every=emit_every)
        .to_rstream()
        .sink("out")
    )
    return b


def test_early_results_update_open_windows_and_the_latest_version_is_final() -> None:
    rnd = random.Random(2)
    events = sorted(
        ({"k": rnd.choice("ab"), "t": rnd.randrange(5_000)} for _ in range(200)),
        key=lambda e: e["t"],
    )
    reference = Counter((e["k"], e["t"] - e["t"] % 1_000) for e in events)
    with TopologyTestDriver(
        _windowed_counts(0).build(), source_queues=1, max_records_per_batch=10
    ) as driver:
        driver.pipe_many(events, event_time=lambda e: e["t"])
        driver.advance()
        driver.advance_idle()
        records = driver.output_records()
        latest: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}
        import json

        for r in records:
            value = json.loads(r.body)
            version = int(r.key.split("/v")[-1].split("/")[0])
            window = (value["key"], value["window_start"])
            if window not in latest or version > latest[window][0]:
                latest[window] = (version, value)
        assert {w: v["count"] for w, (_ver, v) in latest.items()} == dict(reference)
        assert all(v["final"] for _ver, v in latest.values())
        early = [json.loads(r.body) for r in records if not json.loads(r.body)["final"]]
        assert early, "open windows emitted no early result"
        assert len(records) > len(reference)


def test_periodic_early_results_go_by_the_wall_clock() -> None:
    with TopologyTestDriver(_windowed_counts(10).build(), source_queues=1) as driver:
        driver.advance_wall_clock(100_000)
        driver.pipe_many([{"k": "a", "t": 5}] * 3, event_time=5)
        driver.advance()
        first = [v for v in driver.outputs() if not v["final"]]
        assert [v["count"] for v in first] == [3]
        driver.pipe({"k": "a", "t": 6}, event_time=6)
        driver.advance_wall_clock(105_000)  # same 10 s period: no new early result
        assert len(driver.outputs()) == 1
        driver.advance_wall_clock(110_000)
        assert [v["count"] for v in driver.outputs()] == [3, 4]
        driver.advance_idle()
        assert driver.outputs()[-1] == {
            "key": "a",
            "count": 4,
            "window_start": 0,
            "window_end": 1_000,
            "final": True,
        }


def test_emit_early_needs_a_window() -> None:
    b = StreamBuilder("bad-early")
    with pytest.raises(ValueError, match="for windows"):
        b.source("in", json_deserializer).key_by("k").count().emit_early()


def test_a_table_keys_versions_expire_after_its_ttl() -> None:
    """A customer not updated for the TTL is forgotten: a later order meets no table value
    (left join: None); one updated within the TTL is still met."""
    b = StreamBuilder("table-ttl")
    customers = b.table("customers", json_deserializer, "id", "t")
    orders = b.source("orders", json_deserializer).select_timestamp("t")
    (
        orders.join_table(customers, "customer", lambda o, c: [o["n"], c and c["name"]], left=True)
        .ttl(1)
        .to_rstream()
        .sink("out")
    )
    with TopologyTestDriver(b.build(), source_queues=1, shuffle_queues=1) as driver:
        driver.pipe({"id": "a", "name": "Ann", "t": 0}, topic="customers", event_time=0)
        driver.pipe({"id": "b", "name": "Bob", "t": 0}, topic="customers", event_time=0)
        driver.pipe({"customer": "a", "n": 1, "t": 500}, topic="orders", event_time=500)
        driver.advance()
        driver.pipe({"id": "b", "name": "Bob", "t": 800}, topic="customers", event_time=800)
        # 1.5 s: "a" was last updated 1.5 s ago (expired), "b" 0.7 s ago (alive).
        driver.pipe({"customer": "a", "n": 2, "t": 1_500}, topic="orders", event_time=1_500)
        driver.pipe({"customer": "b", "n": 3, "t": 1_500}, topic="orders", event_time=1_500)
        for topic in ("customers", "orders"):
            driver.pipe(
                {"id": "z", "customer": "z", "n": 0, "t": 9_000}, topic=topic, event_time=9_000
            )
        driver.advance()
        joined = sorted(v for v in driver.outputs() if v[0] > 0)
    assert joined == [[1, "Ann"], [2, None], [3, "Bob"]]


def test_early_results_of_session_windows_end_with_the_final_one() -> None:
    from stream_assets.windows import SessionWindow

    b = StreamBuilder("early-sessions")
    (
        b.source("in", json_deserializer)
        .key_by("k")
        .window(SessionWindow.with_gap(Time.milliseconds(100)))
        .count()
        .emit_early()
        .to_rstream()
        .sink("out")
    )
    times = [0, 50, 120, 400, 450]  # sessions [0, 220) with 3, [400, 550) with 2
    with TopologyTestDriver(b.build(), source_queues=1, max_records_per_batch=1) as driver:
        driver.pipe_many([{"k": "a", "t": t} for t in times], event_time=lambda v: v["t"])
        driver.advance()
        driver.advance_idle()
        outs = driver.outputs()
    finals = [(v["window_start"], v["window_end"], v["count"]) for v in outs if v["final"]]
    assert finals == [(0, 220, 3), (400, 550, 2)]
    early = [v["count"] for v in outs if not v["final"]]
    assert early == [1, 2, 3, 1, 2]  # one update per batch, each session growing
