"""State TTL, event-time timers and idleness agreeing, through TopologyTestDriver (the
engine's per-queue core, real RocksDB), unbatched and in random batch splits with
restores from the state topic between them.

References are computed from the input alone by the documented rules
(stream_assets/runtime/core/keyed/ttl.py, stream_assets/operators/processor.py,
docs/guarantees.md), never from the engine.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import defaultdict
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import activity_sessions, silence_alert
from stream_assets.operators.processor import ProcessContext, Processor, TimerContext
from stream_assets.rocketmq.records import Record
from stream_assets.serde import json_deserializer
from stream_assets.testing import TopologyTestDriver
from tests.consumer_rule import final_counts, version_of
from tests.session_reference import sessions

FLUSH_AT = 10**12  # an event time past every timer and expiry the tests set
GAP, TTL = 500, 300  # a session gap longer than the TTL: the expiry would beat the timer


class _CountThenReport(Processor):
    """The issue's smallest case: count records, report the count 5 s after each."""

    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        n = ctx.value("n")
        n.set(n.get(0) + 1)
        ctx.set_event_timer(ctx.timestamp + 5_000)

    def on_timer(self, key: Any, ctx: TimerContext) -> None:
        ctx.emit({"key": key, "n": ctx.value("n").get(), "at": ctx.timestamp})


@pytest.mark.parametrize("batched", [False, True])
def test_a_timer_before_the_expiry_sees_the_keys_state(batched: bool) -> None:
    """Key ``a`` at 0 (timer at 5 000, TTL 30 s), then at 31 000: the timer fires first and
    sees n = 1; the TTL counts from the timer, so the record at 31 000 finds n = 1 too."""
    b = StreamBuilder("smallest")
    (
        b.source("in", json_deserializer)
        .select_timestamp("ts")
        .key_by("k")
        .process(_CountThenReport(), ttl=30)
        .sink("out")
    )
    with TopologyTestDriver(b.build(), source_queues=1, shuffle_queues=1) as driver:
        driver.pipe({"k": "a", "ts": 0})
        if batched:
            driver.advance()
        driver.pipe({"k": "a", "ts": 31_000})
        driver.advance()
        assert driver.outputs() == [{"key": "a", "n": 1, "at": 5_000}]
        assert driver.state("a") == {"n": 2}
        # Quiet for the TTL past the last timer (36 000 + 30 000): the next record starts over.
        driver.pipe({"k": "a", "ts": 66_000})
        driver.advance()
        assert driver.outputs()[1:] == [{"key": "a", "n": 2, "at": 36_000}]
        assert driver.state("a") == {"n": 1}


def _session_events(rnd: random.Random, keys: int, per_key: int) -> list[dict[str, Any]]:
    """Per key, gaps that hit every boundary (the session gap and gap + TTL, each at, one
    before and one after) among random ones; all keys merged into one time order."""
    edges = [0, 1, GAP - 1, GAP, GAP + 1, GAP + TTL - 1, GAP + TTL, GAP + TTL + 1]
    events = []
    for k in range(keys):
        t = rnd.randrange(1_000)
        for i in range(per_key):
            t += rnd.choice(edges) if rnd.random() < 0.5 else rnd.randrange(3 * (GAP + TTL))
            events.append({"user": f"u{k}", "t": t, "i": i})
    events.sort(key=lambda e: (e["t"], e["user"], e["i"]))
    return events


def _run_split(
    driver: TopologyTestDriver,
    events: list[dict[str, Any]],
    rnd: random.Random | None,
    key_field: str,
) -> list[Record]:
    """Pipe ``events`` keyed by ``key_field`` (each key on one source queue, in order),
    all at once (``rnd`` None) or in random pieces with an advance after each and now
    and then a restore of every store from the state topic; the records piped."""
    piped: list[Record] = []
    cuts = [0, len(events)]
    if rnd is not None:
        cuts = sorted({0, len(events), *(rnd.randrange(len(events)) for _ in range(12))})
    for start, end in itertools.pairwise(cuts):
        piped += driver.pipe_many(
            events[start:end], event_time=lambda e: e["t"], key=lambda e: e[key_field]
        )
        driver.advance()
        if rnd is not None and rnd.random() < 0.3:
            driver.restore_state()
    return piped


def _flush(driver: TopologyTestDriver, key_field: str) -> None:
    """One far-future event per source queue: the watermark passes every timer."""
    for q in range(driver.source_queues):
        driver.pipe({key_field: f"flush-{q}", "t": FLUSH_AT, "i": -1}, event_time=FLUSH_AT, queue=q)
    driver.advance()


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_sessions_closed_by_timers_under_a_short_ttl_equal_the_reference(
    seed: int | None,
) -> None:
    rnd = None if seed is None else random.Random(seed)
    events = _session_events(random.Random(7), keys=6, per_key=60)
    topo = activity_sessions.build(gap_ms=GAP, ttl_s=TTL / 1000)
    batch = None if rnd is None else rnd.choice([1, 3, 8])
    with TopologyTestDriver(topo, source_queues=2, max_records_per_batch=batch) as driver:
        _run_split(driver, events, rnd, "user")
        _flush(driver, "user")
        got: dict[str, list[tuple[int, ...]]] = defaultdict(list)
        for s in driver.outputs():
            if not s["key"].startswith("flush"):
                got[s["key"]].append((s["records"], s["first"], s["last"], s["total"]))
        reference = sessions([(e["user"], e["t"]) for e in events], GAP, TTL)
        assert dict(got) == reference
        assert not driver.dead_letters()
        # The reference's own premise: some totals restarted after an expiry, and some
        # timers fired between the TTL after a record and the expiry they hold back.
        summaries = [s for key in reference.values() for s in key]
        assert any(s[3] > s[0] for s in summaries) and any(s[3] == s[0] for s in summaries)
        # Every key expired after the flush, its expiry changelogged.
        driver.restore_state()
        assert all(driver.state(key) is None for key in reference)


def _table(records: list[Record]) -> dict[str, Any]:
    """The sink as a consumer following docs/guarantees.md sees it (deletions applied)."""
    return final_counts(records)


def _counts_reference(events: list[dict[str, Any]], ttl: int, watermark: int) -> dict[str, int]:
    """Per key, its count since its state last expired, for the keys alive at ``watermark``:
    a record at or after latest + ttl starts over; the watermark forgets keys whose
    latest + ttl it reached."""
    state: dict[str, tuple[int, int]] = {}
    for e in events:
        count, last = state.get(e["user"], (0, e["t"]))
        if e["t"] >= last + ttl:
            count = 0
        state[e["user"]] = (count + 1, max(last, e["t"]))
    return {k: c for k, (c, last) in state.items() if last + ttl > watermark}


def _ttl_count(tombstones: bool = True, then: Any = None) -> Any:
    b = StreamBuilder("ttl-count")
    counts = (
        b.source("in", json_deserializer)
        .key_by("user")
        .count()
        .ttl(TTL / 1000, tombstones=tombstones)
        .to_rstream()
    )
    (counts if then is None else counts.map(then)).sink("out")
    return b.build()


@pytest.mark.parametrize("seed", [None, 4, 5])
def test_expired_counts_are_deleted_for_a_consumer_that_keeps_the_highest_version(
    seed: int | None,
) -> None:
    rnd = None if seed is None else random.Random(seed)
    edges = [0, 1, TTL - 1, TTL, TTL + 1]
    events = _session_events(random.Random(9), keys=8, per_key=40)
    for e in events:  # reuse the merge; gaps around the TTL itself matter here
        e["t"] = e["t"] // 2 + random.Random(e["i"]).choice(edges)
    events.sort(key=lambda e: (e["t"], e["user"], e["i"]))
    batch = None if rnd is None else rnd.choice([1, 4, 9])
    with TopologyTestDriver(_ttl_count(), source_queues=2, max_records_per_batch=batch) as driver:
        piped = _run_split(driver, events, rnd, "user")
        queues = {r.queue_id for r in piped}
        assert queues == {0, 1}, "both source queues must hold the watermark"
        watermark = min(max(r.born_timestamp for r in piped if r.queue_id == q) for q in queues)
        records = driver.output_records()
        assert _table(records) == _counts_reference(events, TTL, watermark)
        deletions = [json.loads(r.body) for r in records if b"expired" in r.body]
        assert deletions and all(set(d) == {"key", "expired"} for d in deletions)
        # Versions of a result key only grow, in the order a sink queue holds them.
        seen: dict[str, int] = {}
        for r in records:
            result_key, version = version_of(r.keys[-1])
            assert version >= seen.get(result_key, 0)
            seen[result_key] = version
        _flush(driver, "user")
        assert _table(driver.output_records()) == {"flush-0": 1, "flush-1": 1}
        # After a restore, a key seen again starts over, newer than its deletion.
        driver.restore_state()
        driver.pipe({"user": "u0"}, event_time=FLUSH_AT, queue=0)
        driver.advance()
        assert _table(driver.output_records())["u0"] == 1
        assert not driver.dead_letters()


def test_the_ttl_boundary_is_exclusive() -> None:
    """A record one ms before latest + ttl counts on; one at latest + ttl starts over."""
    with TopologyTestDriver(_ttl_count(), source_queues=1, shuffle_queues=1) as driver:
        for t in (0, TTL - 1, 2 * TTL - 2, 3 * TTL - 2):
            driver.pipe({"user": "a"}, event_time=t)
            driver.advance()
        updates = [v["count"] for v in driver.outputs()]
        assert updates == [1, 2, 3, 1]  # 3 * TTL - 2 is exactly TTL after 2 * TTL - 2


def test_silent_expiry_and_deletions_past_the_stages_functions() -> None:
    """``tombstones=False`` forgets silently; with deletions on, a ``map`` written for
    results never sees one (it would fail on it), and the sink gets it as it is."""
    events = [{"user": "a", "t": 0}, {"user": "b", "t": 10}, {"user": "b", "t": 2 * TTL}]

    def shown(result: dict[str, Any]) -> dict[str, Any]:
        return {"key": result["key"], "count": result["count"] * 10}

    for tombstones, expected in ((False, []), (True, [{"key": "a", "expired": True}])):
        with TopologyTestDriver(
            _ttl_count(tombstones, then=shown), source_queues=1, shuffle_queues=1
        ) as driver:
            for e in events:
                driver.pipe(e, event_time=e["t"])
                driver.advance()
            outputs = driver.outputs()
            assert [o for o in outputs if "expired" in o] == expected
            assert [o["count"] for o in outputs if "count" in o] == [10, 10, 10]
            assert not driver.dead_letters()


@pytest.mark.parametrize("fire_when_idle", [True, False])
def test_pending_timers_fire_when_every_source_is_idle(fire_when_idle: bool) -> None:
    silence = 1_000
    b = StreamBuilder("idle-silence")
    (
        b.source("in", json_deserializer)
        .select_timestamp("t")
        .key_by("device")
        .process(
            silence_alert.SilenceAlert(silence),
            fire_timers_when_idle=fire_when_idle,
            late_records_to="late",
        )
        .sink("out")
    )
    rnd = random.Random(12)
    events, clock = [], 0
    for _ in range(120):
        clock += rnd.randrange(150)
        events.append({"device": f"d{rnd.randrange(5)}", "t": clock})
    last: dict[str, int] = {}
    within = []  # (device, last seen) of silences the input itself shows
    for e in events:
        if e["device"] in last and e["t"] >= last[e["device"]] + silence:
            within.append((e["device"], last[e["device"]]))
        last[e["device"]] = e["t"]
    with TopologyTestDriver(b.build(), source_queues=2) as driver:
        driver.pipe_many(events, event_time=lambda e: e["t"], key=lambda e: e["device"])
        driver.advance()
        before = {(a["device"], a["last_seen"]) for a in driver.outputs("out")}
        driver.advance_idle()
        alerts = sorted((a["device"], a["last_seen"]) for a in driver.outputs("out"))
        trailing = [(d, t) for d, t in last.items() if (d, t) not in before]
        # With every source idle the watermark is the latest event time read (as for
        # windows): timers up to it fire either way; with the option, every other too.
        passed = [(d, t) for d, t in last.items() if t + silence <= clock]
        assert len(passed) < len(trailing), "the case must leave timers past the input"
        assert alerts == sorted(within + (list(last.items()) if fire_when_idle else passed))
        # A record behind the latest timer fired, ahead of the watermark: late only once
        # every timer fired by idleness.
        driver.pipe({"device": "d0", "t": clock + 1})
        driver.advance()
        assert len(driver.late("late")) == (1 if fire_when_idle else 0)


class _Heartbeat(Processor):
    """A timer every 100 ms of event time after a key's record, each setting the next."""

    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        ctx.set_event_timer(ctx.timestamp + 100)

    def on_timer(self, key: Any, ctx: TimerContext) -> None:
        ctx.emit({"key": key, "at": ctx.timestamp})
        ctx.set_event_timer(ctx.timestamp + 100)


def test_timers_set_by_timers_fire_within_reach_and_idleness_ends() -> None:
    """Chained timers the watermark reached fire in the same round; with every source
    idle, the timers pending then fire once, and the ones they set wait."""
    b = StreamBuilder("heartbeat")
    b.source("in", json_deserializer).key_by("k").process(_Heartbeat()).sink("out")
    with TopologyTestDriver(b.build(), source_queues=1, shuffle_queues=1) as driver:
        driver.pipe({"k": "a"}, event_time=0)
        driver.pipe({"k": "b"}, event_time=1_000)
        driver.advance()
        assert [(o["key"], o["at"]) for o in driver.outputs()] == [
            ("a", t) for t in range(100, 1_001, 100)
        ]
        driver.advance_idle()
        assert sorted((o["key"], o["at"]) for o in driver.outputs()[10:]) == [
            ("a", 1_100),
            ("b", 1_100),
        ]
