"""Late records judged by their own origin's progress; poison records never stop a stage.

Through the public test driver (the engine's real core on in-memory topics).
Which events are late is decided here from the input alone: an event is late
when an earlier event of the same source queue that went to the same shuffle
queue (the same key here) is more than the allowed lateness ahead of its window's end.
"""

from __future__ import annotations

import collections
import json
import random
from typing import Any

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer
from stream_assets.testing import TopologyTestDriver
from stream_assets.windows import Time, TumblingWindow

WINDOW_MS = 10_000
LATENESS_MS = 5_000
HOUR_MS = 3_600_000
BASE = 1_700_000_000_000  # window-aligned


def _topology(pre_combine_safe: bool = True) -> Topology:
    builder = StreamBuilder("late")
    stream = (
        builder.source("events", json_deserializer)
        .select_timestamp("ts")
        .key_by("key")
        .window(TumblingWindow.of(Time.seconds(10)))
        .sum("value", "sum")
        .water_mark(LATENESS_MS / 1000)
        .idle_timeout(60)
    )
    if not pre_combine_safe:
        stream = stream.late_records_to("late-out")
    stream.to_rstream().sink("out")
    return builder.build()


def _reference(
    per_queue: dict[int, list[dict[str, Any]]],
) -> tuple[dict[tuple[str, int], int], list[dict[str, Any]]]:
    """Window sums of on-time events, and the late events, from the input alone."""
    sums: dict[tuple[str, int], int] = collections.defaultdict(int)
    late: list[dict[str, Any]] = []
    for events in per_queue.values():
        progress: dict[str, int] = {}  # per key (one key -> one shuffle queue)
        for e in events:
            end = e["ts"] - (e["ts"] - BASE) % WINDOW_MS + WINDOW_MS
            seen = progress.get(e["key"])
            if seen is not None and end <= seen - LATENESS_MS:
                late.append(e)
            else:
                sums[(e["key"], end - WINDOW_MS)] += e["value"]
            progress[e["key"]] = max(seen if seen is not None else e["ts"], e["ts"])
    return dict(sums), late


def _events(rnd: random.Random, count: int, late_every: int) -> list[dict[str, Any]]:
    """In event-time order (2 s jitter); every ``late_every``-th one an hour behind."""
    out = []
    for i in range(count):
        ts = BASE + HOUR_MS + i * 100 - rnd.randint(0, 2_000)
        if i > 0 and i % late_every == 0:
            ts -= HOUR_MS
        out.append({"key": "k", "value": rnd.randint(1, 9), "ts": ts})
    return out


def test_hour_late_events_in_a_first_batch_are_late_by_their_own_origin() -> None:
    rnd = random.Random(5)
    # Queue 0 carries everything; queue 1 never speaks and holds the watermark.
    per_queue = {0: _events(rnd, 600, late_every=37)}
    sums, late = _reference(per_queue)
    assert late, "the input must contain late events"
    with TopologyTestDriver(_topology(False), source_queues=2, shuffle_queues=2) as driver:
        for e in per_queue[0]:
            driver.pipe(e, queue=0)
        driver.advance()  # one first batch: no watermark yet, queue 1 silent
        driver.advance_idle()
        fired = {(o["key"], o["window_start"]): o["sum"] for o in driver.outputs("out")}
        diverted = [d["value"] for d in driver.late()]
    assert fired == sums
    assert sorted(json.dumps(d, sort_keys=True) for d in diverted) == sorted(
        json.dumps(e, sort_keys=True) for e in late
    )


def test_late_by_origin_is_the_same_with_and_without_pre_combine_and_any_batch_size() -> None:
    rnd = random.Random(9)
    per_queue = {q: _events(rnd, 400, late_every=23) for q in range(2)}
    sums, late = _reference(per_queue)
    seen = []
    for pre_combine in (True, False):
        for batch in (7, 1000):
            with TopologyTestDriver(
                _topology(),
                source_queues=2,
                shuffle_queues=1,
                pre_combine=pre_combine,
                max_records_per_batch=batch,
            ) as driver:
                for q, events in per_queue.items():
                    for e in events:
                        driver.pipe(e, queue=q)
                driver.advance()
                driver.advance_idle()
                fired = {(o["key"], o["window_start"]): o["sum"] for o in driver.outputs("out")}
                seen.append((fired, sum(s.late for s in driver.stats)))
    # One shuffle queue, two origins: per origin progress as in _reference (one key).
    assert all(s == (sums, len(late)) for s in seen), [s[1] for s in seen]


def test_an_integer_beyond_64_bits_is_one_dead_letter_and_the_rest_is_exact() -> None:
    builder = StreamBuilder("poison")
    (
        builder.source("in", json_deserializer)
        .key_by("word")
        .sum("n", "total")
        .to_rstream()
        .sink("out")
    )
    rnd = random.Random(3)
    good = [{"word": rnd.choice("abcde"), "n": rnd.randint(1, 9)} for _ in range(300)]
    poison = [{"word": "a", "n": 2**70}, {"word": 2**70, "n": 1}]
    expected = collections.Counter()
    for e in good:
        expected[e["word"]] += e["n"]
    with TopologyTestDriver(builder.build(), source_queues=2) as driver:
        for i, e in enumerate(good):
            driver.pipe(e, queue=i % 2)
            if i == 100:
                for p in poison:
                    driver.pipe(p, queue=0)
        driver.advance()
        totals = {o["key"]: o["total"] for o in driver.outputs("out")}
        dead = driver.dead_letters()
    assert totals == dict(expected)
    assert sorted(json.loads(body)["n"] for body, _ in dead) == sorted(p["n"] for p in poison)
    for _body, props in dead:
        assert props["operator"].startswith("key_by") and "int" in props["reason"]


def test_a_sum_that_outgrows_the_state_codec_is_a_dead_letter_with_and_without_combining() -> None:
    """Two sums each within 64 bits whose total is not: the record (or the pre-combined
    partial) that would overflow the stored state goes to the dead letters; the rest
    of the batch and the other keys are exact."""
    builder = StreamBuilder("overflow")
    builder.source("in", json_deserializer).key_by("k").sum("n", "s").to_rstream().sink("out")
    big = 2**64 - 10  # fits msgpack (unsigned 64 bits); twice it does not
    events = [{"k": "big", "n": big}, {"k": "big", "n": big}] + [
        {"k": "small", "n": i} for i in range(50)
    ]
    for pre_combine in (True, False):
        with TopologyTestDriver(builder.build(), source_queues=1, pre_combine=pre_combine) as d:
            d.pipe_many(events[:1], queue=0)
            d.advance()
            d.pipe_many(events[1:], queue=0)
            d.advance()
            totals = {o["key"]: o["s"] for o in d.outputs("out")}
            dead = d.dead_letters()
        assert totals == {"big": big, "small": sum(range(50))}, pre_combine
        assert len(dead) == 1 and "int" in dead[0][1]["reason"], (pre_combine, dead)
