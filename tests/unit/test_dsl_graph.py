"""The topology as a graph: several sources, union, branch, several key_by stages,
windowed and stream-table joins, metadata for user functions, sink keys/tags/properties,
dead letters and build-time errors, run on the public TopologyTestDriver.

Every expected result is computed here from the input in plain Python (Counter,
itertools, dicts), never taken from the engine or written down by hand.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from stream_assets.dsl.builder import RStream, StreamBuilder
from stream_assets.operators.metadata import Metadata
from stream_assets.plan import nodes as n
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.runtime.core.shuffle_codec import decode
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.testing import TopologyTestDriver
from stream_assets.windows import Time, TumblingWindow

_SIZE = 10_000  # tumbling window size, ms
_WORDS = ["stream", "queue", "topic", "broker", "state", "window", "key", "count"]


# -- helpers ------------------------------------------------------------------


def _canon(value: Any) -> str:
    """A hashable, order-independent form of a JSON-like value (multiset comparisons)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _bag(values: Iterable[Any]) -> Counter[str]:
    return Counter(_canon(v) for v in values)


def _latest(outputs: list[dict[str, Any]], field: str = "count") -> dict[Any, Any]:
    """Unwindowed aggregates emit the new value of each changed key: the last one wins."""
    latest: dict[Any, Any] = {}
    for out in outputs:
        latest[out["key"]] = out[field]
    return latest


def _window_start(ts: int) -> int:
    return ts - ts % _SIZE


def _lines(rnd: random.Random, count: int) -> list[str]:
    return [" ".join(rnd.choices(_WORDS, k=rnd.randint(1, 6))) for _ in range(count)]


def _op_ids(topology: Topology, kind: type[n.Node]) -> list[str]:
    return [node.op_id for node in topology.nodes if isinstance(node, kind)]


def _tumbling() -> TumblingWindow:
    return TumblingWindow.of(Time.milliseconds(_SIZE))


# -- 1. immutable handles -------------------------------------------------------


def test_a_handle_used_twice_branches_and_is_not_chained() -> None:
    def f(v: int) -> int:
        return v * 2

    def g(v: int) -> int:
        return v + 1_000

    b = StreamBuilder("handles")
    s = b.source("nums", json_deserializer)
    doubled = s.map(f)
    doubled.sink("a")
    s.map(g).sink("b")
    s.sink("raw")  # the source handle still stands for the raw values
    doubled.filter(lambda v: v % 3 == 0).sink("c")  # and the map's handle for f's values
    topology = b.build()

    rnd = random.Random(1)
    nums = [rnd.randint(-500, 500) for _ in range(200)]
    with TopologyTestDriver(topology, source_queues=3) as driver:
        placed: dict[int, list[int]] = defaultdict(list)
        for i, v in enumerate(nums):
            driver.pipe(v, queue=i % 3)
            placed[i % 3].append(v)
            if i % 50 == 49:
                driver.advance()
        driver.advance()
        assert Counter(driver.outputs("a")) == Counter(f(v) for v in nums)
        assert Counter(driver.outputs("b")) == Counter(g(v) for v in nums)
        assert Counter(driver.outputs("raw")) == Counter(nums)
        assert Counter(driver.outputs("c")) == Counter(f(v) for v in nums if f(v) % 3 == 0)
        # Each source queue's order is kept in a sink queue.
        by_queue: dict[int, list[int]] = defaultdict(list)
        for record in driver.output_records("b"):
            source_queue = int(record.keys[-1].split("/")[-3])
            by_queue[source_queue].append(json.loads(record.body))
        assert dict(by_queue) == {q: [g(v) for v in vs] for q, vs in placed.items()}


def test_two_aggregates_from_one_handle_each_get_every_value() -> None:
    b = StreamBuilder("two-aggs")
    words = b.source("lines", text_deserializer).flat_map(str.split)
    words.key_by(lambda w: w).count().to_rstream().sink("by-word")
    words.key_by(len).count().to_rstream().sink("by-length")
    topology = b.build()
    lines = _lines(random.Random(2), 150)
    all_words = [w for line in lines for w in line.split()]
    with TopologyTestDriver(topology, source_queues=2, shuffle_queues=3) as driver:
        driver.pipe_many(lines)
        driver.advance()
        assert _latest(driver.outputs("by-word")) == dict(Counter(all_words))
        assert _latest(driver.outputs("by-length")) == dict(Counter(len(w) for w in all_words))
        aggs = _op_ids(topology, n.Aggregate)
        assert len(aggs) == 2
        for word, count in Counter(all_words).items():
            assert driver.state(word, operator=aggs[0]) == {"count": count}
        for length, count in Counter(len(w) for w in all_words).items():
            assert driver.state(length, operator=aggs[1]) == {"count": count}


# -- 2. union -------------------------------------------------------------------


@pytest.mark.parametrize("pre_combine", [True, False])
@pytest.mark.parametrize("max_records", [None, 4])
def test_union_of_two_sources_then_count(pre_combine: bool, max_records: int | None) -> None:
    b = StreamBuilder("union2")
    left = b.source("left-lines", text_deserializer).flat_map(str.split)
    right = b.source("right-lines", text_deserializer).map(str.upper).flat_map(str.split)
    (left.union(right).key_by(lambda w: w).count().to_rstream().sink("counts"))
    topology = b.build()
    assert topology.source_topics == ("left-lines", "right-lines")

    rnd = random.Random(3)
    left_lines, right_lines = _lines(rnd, 120), _lines(rnd, 90)
    expected = Counter(w for line in left_lines for w in line.split())
    expected.update(w for line in right_lines for w in line.upper().split())
    with TopologyTestDriver(
        topology,
        source_queues=3,
        shuffle_queues=4,
        pre_combine=pre_combine,
        max_records_per_batch=max_records,
    ) as driver:
        for i, (a, c) in enumerate(itertools.zip_longest(left_lines, right_lines)):
            if a is not None:
                driver.pipe(a, topic="left-lines")
            if c is not None:
                driver.pipe(c, topic="right-lines")
            if i % 25 == 0:
                driver.advance()
        driver.advance()
        assert _latest(driver.outputs()) == dict(expected)
        for word, count in expected.items():
            assert driver.state(word) == {"count": count}


@pytest.mark.parametrize("pre_combine", [True, False])
def test_union_of_two_branches_of_one_source_is_a_diamond(pre_combine: bool) -> None:
    def small(v: int) -> bool:
        return v < 60

    def even(v: int) -> bool:
        return v % 2 == 0

    b = StreamBuilder("diamond")
    s = b.source("nums", json_deserializer)
    both = s.filter(small).union(s.filter(even))
    both.sink("union-out")
    both.key_by(lambda v: v % 7).count().to_rstream().sink("counts")
    topology = b.build()

    rnd = random.Random(4)
    nums = [rnd.randint(0, 120) for _ in range(300)]
    # A value passing both filters appears twice, one passing one filter once.
    passed = [v for v in nums for keep in (small(v), even(v)) if keep]
    assert any(small(v) and even(v) for v in nums)
    with TopologyTestDriver(topology, source_queues=2, pre_combine=pre_combine) as driver:
        for i, v in enumerate(nums):
            driver.pipe(v)
            if i % 40 == 0:
                driver.advance()
        driver.advance()
        assert Counter(driver.outputs("union-out")) == Counter(passed)
        keys = [r.keys for r in driver.output_records("union-out")]
        assert len(set(keys)) == len(keys)  # both copies of a value have their own key
        expected = Counter(v % 7 for v in passed)
        assert _latest(driver.outputs("counts")) == dict(expected)
        for key, count in expected.items():
            assert driver.state(key) == {"count": count}


def test_windows_of_a_union_fire_on_the_slowest_queue_of_both_topics() -> None:
    """One shuffle queue, so its watermark is the minimum over every source queue of both
    topics (each one's max event time), until a topic's queues are declared idle."""
    b = StreamBuilder("union-windows")
    fast = b.source("fast", text_deserializer)
    slow = b.source("slow", text_deserializer)
    (fast.union(slow).key_by(lambda w: w).window(_tumbling()).count().to_rstream().sink("counts"))
    rnd = random.Random(22)
    piped: list[tuple[str, int, str, int]] = []  # topic, queue, word, ts
    for topic, horizon in (("fast", 80_000), ("slow", 30_000)):
        for queue in range(2):
            times = sorted(rnd.randrange(horizon) for _ in range(40))
            piped += [(topic, queue, rnd.choice(_WORDS), ts) for ts in times]
    counts = Counter((w, _window_start(ts)) for _t, _q, w, ts in piped)

    def fired_up_to(watermark: int) -> dict[tuple[str, int], int]:
        return {k: c for k, c in counts.items() if k[1] + _SIZE <= watermark}

    def max_ts(topic: str) -> list[int]:
        return [max(ts for t, q, _w, ts in piped if (t, q) == (topic, queue)) for queue in (0, 1)]

    with TopologyTestDriver(b.build(), source_queues=2, shuffle_queues=1) as driver:
        for topic, queue, word, ts in piped:
            driver.pipe(word, topic=topic, queue=queue, event_time=ts)
        driver.advance()
        fired = {(o["key"], o["window_start"]): o["count"] for o in driver.outputs()}
        watermark = min(max_ts("fast") + max_ts("slow"))
        assert fired == fired_up_to(watermark)
        assert fired  # something fired, not everything
        assert fired != dict(counts)
        driver.advance_idle(topic="slow")
        fired = {(o["key"], o["window_start"]): o["count"] for o in driver.outputs()}
        assert fired == fired_up_to(max(watermark, min(max_ts("fast"))))
        driver.advance_idle()
        fired = {(o["key"], o["window_start"]): o["count"] for o in driver.outputs()}
        assert len(fired) == len(driver.outputs())
        assert fired == dict(counts)


# -- 3. branch ------------------------------------------------------------------


def _branch_reference(
    values: list[int], predicates: list[Callable[[int], bool]], default: bool
) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in range(len(predicates) + (1 if default else 0))]
    for v in values:
        for i, p in enumerate(predicates):
            if p(v):
                outs[i].append(v)
                break
        else:
            if default:
                outs[-1].append(v)
    return outs


@pytest.mark.parametrize("default", [False, True])
@pytest.mark.parametrize("pre_combine", [True, False])
def test_branch_first_match_wins_each_to_its_sink(default: bool, pre_combine: bool) -> None:
    predicates: list[Callable[[int], bool]] = [
        lambda v: v < 10,
        lambda v: v % 3 == 0,
        lambda v: v % 2 == 0,
    ]
    b = StreamBuilder("branches")
    streams = b.source("nums", json_deserializer).branch(*predicates, default=default)
    assert len(streams) == 3 + (1 if default else 0)
    for i, stream in enumerate(streams):
        stream.sink(f"branch-{i}")
    # One branch keyed and counted (by residue), besides its sink.
    streams[1].key_by(lambda v: v % 4).count().to_rstream().sink("branch-1-counts")
    topology = b.build()

    rnd = random.Random(5)
    nums = [rnd.randint(0, 100) for _ in range(400)]
    expected = _branch_reference(nums, predicates, default)
    assert all(expected)  # every branch gets something
    with TopologyTestDriver(
        topology, source_queues=3, shuffle_queues=2, pre_combine=pre_combine
    ) as driver:
        driver.pipe_many(nums)
        driver.advance()
        for i, values in enumerate(expected):
            assert Counter(driver.outputs(f"branch-{i}")) == Counter(values), i
        taken = sum((Counter(v) for v in expected), Counter[int]())
        dropped = Counter(nums) - taken
        if default:
            assert not dropped
        else:
            assert dropped  # values no predicate took are dropped
        counts = Counter(v % 4 for v in expected[1])
        assert _latest(driver.outputs("branch-1-counts")) == dict(counts)


def test_branch_after_an_aggregate() -> None:
    b = StreamBuilder("branch-after")
    counts = (
        b.source("lines", text_deserializer)
        .flat_map(str.split)
        .key_by(lambda w: w)
        .window(_tumbling())
        .count()
        .to_rstream()
    )
    few, many = counts.branch(lambda r: r["count"] < 3, lambda r: r["count"] < 6)
    few.sink("few")
    many.sink("many")
    topology = b.build()
    rnd = random.Random(6)
    events = sorted(
        [(line, rnd.randint(0, 39_999)) for line in _lines(rnd, 150)], key=lambda e: e[1]
    )
    per_window = Counter((w, _window_start(ts)) for line, ts in events for w in line.split())
    with TopologyTestDriver(topology, source_queues=2) as driver:
        for line, ts in events:
            driver.pipe(line, event_time=ts)
        driver.advance_idle()
        got_few = {(o["key"], o["window_start"]): o["count"] for o in driver.outputs("few")}
        got_many = {(o["key"], o["window_start"]): o["count"] for o in driver.outputs("many")}
        assert got_few == {k: c for k, c in per_window.items() if c < 3}
        assert got_many == {k: c for k, c in per_window.items() if 3 <= c < 6}


# -- 4. two key_by stages, outbox exactly once ------------------------------------


def _count_of_counts_topology() -> tuple[Topology, str, str]:
    b = StreamBuilder("count-of-counts")
    per_window = (
        b.source("lines", json_deserializer)
        .select_timestamp("ts")
        .flat_map(lambda v: v["text"].split())
        .key_by(lambda w: w)
        .window(_tumbling())
        .count()
        .to_rstream()
    )
    per_window.sink("word-windows")
    per_window.key_by(lambda r: r["count"]).count("pairs").to_rstream().sink("count-of-counts")
    topology = b.build()
    assert len(topology.stages) == 3
    stage2 = topology.stages[2]
    assert stage2.upstreams == (1,)
    assert stage2.aggregate is not None
    return topology, stage2.input_topic, stage2.aggregate.op_id


def _events(rnd: random.Random, count: int, t0: int, span: int) -> list[dict[str, Any]]:
    """Lines with event times in [t0, t0 + span), in time order (so none is late)."""
    stamped = [{"text": line, "ts": t0 + rnd.randint(0, span - 1)} for line in _lines(rnd, count)]
    return sorted(stamped, key=lambda e: e["ts"])


def _count_of_counts(events: list[dict[str, Any]]) -> tuple[Counter[Any], Counter[int]]:
    pairs = Counter((w, _window_start(e["ts"])) for e in events for w in e["text"].split())
    return pairs, Counter(pairs.values())


@pytest.mark.parametrize("pre_combine", [True, False])
@pytest.mark.parametrize("max_records", [None, 5])
def test_two_key_by_stages_count_of_counts_is_exact(
    pre_combine: bool, max_records: int | None
) -> None:
    topology, shuffle2, agg2 = _count_of_counts_topology()
    rnd = random.Random(7)
    first = _events(rnd, 250, 0, 60_000)
    pairs, expected = _count_of_counts(first)
    with TopologyTestDriver(
        topology,
        source_queues=3,
        shuffle_queues=4,
        pre_combine=pre_combine,
        max_records_per_batch=max_records,
    ) as driver:
        for i, event in enumerate(first):
            driver.pipe(event)
            if i % 30 == 0:
                driver.advance()
        driver.advance_idle()
        windows = {
            (o["key"], o["window_start"]): o["count"] for o in driver.outputs("word-windows")
        }
        assert len(windows) == len(driver.outputs("word-windows"))  # each window fires once
        assert windows == dict(pairs)
        assert _latest(driver.outputs("count-of-counts"), "pairs") == dict(expected)
        for count, number in expected.items():
            assert driver.state(count, operator=agg2) == {"pairs": number}

        # The outbox is exactly once: stage 2 re-reading its whole shuffle skips every entry.
        outputs_before = driver.outputs("count-of-counts")
        entries = sum(len(_shuffle_entries(r.body)) for r in driver.output_records(shuffle2))
        assert entries == len(pairs)  # one entry per fired (word, window)
        skipped_before = sum(s.skipped_duplicates for s in driver.stats if s.stage == 2)
        driver.rewind(shuffle2, 0)
        driver.advance()
        skipped = sum(s.skipped_duplicates for s in driver.stats if s.stage == 2)
        assert skipped - skipped_before == entries
        assert driver.outputs("count-of-counts") == outputs_before
        for count, number in expected.items():
            assert driver.state(count, operator=agg2) == {"pairs": number}

        # Rebuilt from the state topic: each queue's last outbox was noted as sent only
        # locally, so it goes again, and stage 2 skips every copy.
        driver.restore_state()
        skipped_before = sum(s.skipped_duplicates for s in driver.stats if s.stage == 2)
        driver.advance_idle()
        resent = sum(s.skipped_duplicates for s in driver.stats if s.stage == 2) - skipped_before
        assert 0 < resent <= entries
        assert driver.outputs("count-of-counts") == outputs_before
        # More input after the restore: still exact.
        second = _events(rnd, 150, 100_000, 40_000)
        for event in second:
            driver.pipe(event)
        driver.advance_idle()
        pairs_all, expected_all = _count_of_counts(first + second)
        windows = {
            (o["key"], o["window_start"]): o["count"] for o in driver.outputs("word-windows")
        }
        assert windows == dict(pairs_all)
        assert _latest(driver.outputs("count-of-counts"), "pairs") == dict(expected_all)
        for count, number in expected_all.items():
            assert driver.state(count, operator=agg2) == {"pairs": number}


def _shuffle_entries(body: bytes) -> list[Any]:
    decoded = decode(body)
    return list(decoded.get("recs", decoded.get("comb", [])))


def test_two_key_by_stages_survive_replays_of_every_stage() -> None:
    topology, shuffle2, agg2 = _count_of_counts_topology()
    shuffle1 = topology.stages[1].input_topic
    rnd = random.Random(8)
    events = _events(rnd, 200, 0, 50_000)
    pairs, expected = _count_of_counts(events)
    with TopologyTestDriver(topology, source_queues=2, shuffle_queues=3) as driver:
        half = len(events) // 2
        for event in events[:half]:
            driver.pipe(event)
        driver.advance()
        # A crash after the work, before the offsets: every stage replays.
        driver.rewind("lines", 0)
        driver.rewind(shuffle1, 0)
        driver.rewind(shuffle2, 0)
        driver.advance()
        driver.restore_state()
        for event in events[half:]:
            driver.pipe(event)
        driver.advance()
        driver.rewind(shuffle2, 0)
        driver.advance_idle()
        windows = {
            (o["key"], o["window_start"]): o["count"] for o in driver.outputs("word-windows")
        }
        assert windows == dict(pairs)
        assert _latest(driver.outputs("count-of-counts"), "pairs") == dict(expected)
        for count, number in expected.items():
            assert driver.state(count, operator=agg2) == {"pairs": number}


def test_two_windowed_stages_sum_the_first_stage_s_windows() -> None:
    """10 s word counts, then per word the sum of its counts over 30 s windows."""
    b = StreamBuilder("two-windows")
    (
        b.source("lines", json_deserializer)
        .select_timestamp("ts")
        .flat_map(lambda v: v["text"].split())
        .key_by(lambda w: w)
        .window(_tumbling())
        .count()
        .to_rstream()
        .key_by("key")
        .window(TumblingWindow.of(Time.milliseconds(3 * _SIZE)))
        .sum("count", "words")
        .to_rstream()
        .sink("per-30s")
    )
    rnd = random.Random(20)
    events = _events(rnd, 200, 0, 90_000)
    expected = Counter(
        (w, e["ts"] - e["ts"] % (3 * _SIZE)) for e in events for w in e["text"].split()
    )
    with TopologyTestDriver(b.build(), source_queues=2, shuffle_queues=3) as driver:
        for i, event in enumerate(events):
            driver.pipe(event)
            if i % 20 == 0:
                driver.advance()
        driver.advance_idle()
        got = driver.outputs("per-30s")
        fired = {(o["key"], o["window_start"]): o["words"] for o in got}
        assert len(fired) == len(got)  # each window fires once
        assert fired == dict(expected)


def test_join_of_two_branches_of_an_aggregate_s_results() -> None:
    """Both sides of a join leave one keyed stage through its outbox (two exits, one shuffle):
    per 10 s window, every word of the first half of the alphabet with every other word."""
    b = StreamBuilder("outbox-join")
    counts = (
        b.source("lines", json_deserializer)
        .select_timestamp("ts")
        .flat_map(lambda v: v["text"].split())
        .key_by(lambda w: w)
        .window(_tumbling())
        .count()
        .to_rstream()
    )
    early, late = counts.branch(lambda r: r["key"] < "n", default=True)
    (
        early.join(late)
        .where("window_start")
        .equal_to("window_start")
        .window(_tumbling())
        .apply(lambda a, c: {"l": [a["key"], a["count"]], "r": [c["key"], c["count"]]})
        .sink("pairs")
    )
    rnd = random.Random(21)
    events = _events(rnd, 120, 0, 40_000)
    per_window = Counter((w, _window_start(e["ts"])) for e in events for w in e["text"].split())
    expected = [
        {"l": [a, n_a], "r": [c, n_c]}
        for (a, start_a), n_a in per_window.items()
        for (c, start_c), n_c in per_window.items()
        if start_a == start_c and a < "n" <= c
    ]
    assert expected
    with TopologyTestDriver(b.build(), source_queues=2, shuffle_queues=2) as driver:
        for event in events:
            driver.pipe(event)
        driver.advance_idle()
        skipped = sum(s.skipped_duplicates for s in driver.stats)
        assert _bag(driver.outputs("pairs")) == _bag(expected), (
            f"{skipped} outbox entries were skipped as duplicates in a run without replays"
        )


# -- 5. windowed joins ----------------------------------------------------------


_USERS = ["ann", "bob", "cy", "dee", "eve"]
_LATENESS_MS = 5_000
_FIELD = {"clicks": "click", "views": "view"}
_SIDE = {"clicks": 0, "views": 1}  # how a join shuffles (and reports late) each side
_JITTER_MS = 4_000


def _join_events(rnd: random.Random, count: int) -> list[tuple[str, dict[str, Any], int]]:
    """(topic, value, ts): both topics interleaved, out of order by up to the jitter, never
    late: each window ends after (max event time piped before it) - lateness."""
    events: list[tuple[str, dict[str, Any], int]] = []
    max_before = -(10**9)
    for i in range(count):
        ts = max(0, i * 150 - rnd.randint(0, _JITTER_MS))
        assert _window_start(ts) + _SIZE > max_before - _LATENESS_MS
        topic = rnd.choice(["clicks", "views"])
        user = rnd.choice(_USERS[:-1] if topic == "views" else _USERS)  # eve is never viewed
        events.append((topic, {"user": user, _FIELD[topic]: i}, ts))
        max_before = max(max_before, ts)
    return events


def _join_reference(
    events: list[tuple[str, dict[str, Any], int]], kind: str
) -> list[dict[str, Any]]:
    buckets: dict[tuple[str, int], tuple[list[Any], list[Any]]] = defaultdict(lambda: ([], []))
    for topic, value, ts in events:
        buckets[(value["user"], _window_start(ts))][topic == "views"].append(value)
    out: list[dict[str, Any]] = []
    for lefts, rights in buckets.values():
        if rights:
            out.extend({"l": a, "r": c} for a, c in itertools.product(lefts, rights))
        elif kind == "left":
            out.extend({"l": a, "r": None} for a in lefts)
    return out


def _join_topology(kind: str) -> Topology:
    b = StreamBuilder(f"{kind}-join")
    clicks = b.source("clicks", json_deserializer)
    views = b.source("views", json_deserializer)
    declared = clicks.join(views) if kind == "inner" else clicks.left_join(views)
    (
        declared.where("user")
        .equal_to(lambda v: v["user"])
        .window(_tumbling())
        .water_mark(_LATENESS_MS / 1000)
        .late_records_to("join-late")
        .apply(lambda c, v: {"l": c, "r": v})
        .sink("joined")
    )
    return b.build()


@pytest.mark.parametrize("kind", ["inner", "left"])
@pytest.mark.parametrize(("max_records", "restore_midway"), [(None, False), (6, False), (6, True)])
def test_windowed_join_with_out_of_order_and_late_events(
    kind: str, max_records: int | None, restore_midway: bool
) -> None:
    rnd = random.Random(9)
    events = _join_events(rnd, 400)
    out_of_order = [e for i, e in enumerate(events) if e[2] < max(x[2] for x in events[: i + 1])]
    assert len(out_of_order) > 50
    with TopologyTestDriver(
        _join_topology(kind), source_queues=2, shuffle_queues=3, max_records_per_batch=max_records
    ) as driver:
        for i, (topic, value, ts) in enumerate(events):
            driver.pipe(value, topic=topic, event_time=ts)
            if i % 37 == 0:
                driver.advance()
            if restore_midway and i == len(events) // 2:
                driver.restore_state()  # open windows rebuilt from the state topic
        driver.advance()
        driver.advance_idle()  # every source queue idle: all open windows fire
        expected = _join_reference(events, kind)
        assert _bag(driver.outputs("joined")) == _bag(expected)
        assert driver.late("join-late") == []
        keys = [r.keys for r in driver.output_records("joined")]
        assert len(set(keys)) == len(keys)  # every pair has its own de-duplication key

        # Late now, deterministically: their windows fired (each key's queue fired a window
        # ending at or after the first window's end).
        late_events = [
            (topic, {"user": rnd.choice(_USERS[:-1]), _FIELD[topic]: -1}, rnd.randrange(_SIZE))
            for topic in rnd.choices(["clicks", "views"], k=12)
        ]
        for topic, value, ts in late_events:
            driver.pipe(value, topic=topic, event_time=ts)
        # Fresh events in a window after every fired one join as usual.
        t0 = _window_start(max(ts for *_, ts in events)) + 3 * _SIZE
        fresh = [(topic, value, t0 + (ts % _SIZE)) for topic, value, ts in _join_events(rnd, 40)]
        for topic, value, ts in fresh:
            driver.pipe(value, topic=topic, event_time=ts)
        driver.advance()
        driver.advance_idle()
        late_expected = [
            {"key": value["user"], "value": [_SIDE[topic], value], "window_end": _SIZE}
            for topic, value, _ in late_events
        ]
        assert _bag(driver.late("join-late")) == _bag(late_expected)
        assert sum(s.late for s in driver.stats) == len(late_events)
        assert _bag(driver.outputs("joined")) == _bag(expected + _join_reference(fresh, kind))


def test_windowed_join_of_two_branches_of_one_source() -> None:
    """A self-join: both sides come from one source stage (two key_bys, one shuffle topic)."""
    b = StreamBuilder("self-join")
    events = b.source("events", json_deserializer)
    clicks = events.filter(lambda v: v["kind"] == "click")
    views = events.filter(lambda v: v["kind"] == "view")
    (
        clicks.join(views)
        .where("user")
        .equal_to("user")
        .window(_tumbling())
        .apply(lambda c, v: {"l": c, "r": v})
        .sink("joined")
    )
    rnd = random.Random(10)
    values: list[dict[str, Any]] = [
        {"user": rnd.choice(_USERS), "kind": rnd.choice(["click", "view"]), "i": i}
        for i in range(120)
    ]
    stamped = [(v, rnd.randint(0, 29_999)) for v in values]
    stamped.sort(key=lambda x: x[1])
    buckets: dict[tuple[str, int], tuple[list[Any], list[Any]]] = defaultdict(lambda: ([], []))
    for v, ts in stamped:
        buckets[(v["user"], _window_start(ts))][v["kind"] == "view"].append(v)
    expected = [
        {"l": a, "r": c} for lefts, rights in buckets.values() for a in lefts for c in rights
    ]
    assert expected
    with TopologyTestDriver(b.build(), source_queues=2, shuffle_queues=2) as driver:
        for v, ts in stamped:
            driver.pipe(v, event_time=ts)
        driver.advance_idle()
        skipped = sum(s.skipped_duplicates for s in driver.stats)
        assert _bag(driver.outputs("joined")) == _bag(expected), (
            f"{skipped} shuffle records were skipped as duplicates in a run without replays"
        )


# -- 6. stream-table join -------------------------------------------------------


def _table_join_topology(left: bool) -> Topology:
    b = StreamBuilder("enrich")
    users = b.table("users", json_deserializer, key="user", timestamp="ts")
    (
        b.source("orders", json_deserializer)
        .select_timestamp(lambda v: v["ts"])
        .join_table(
            users,
            key="user",
            joiner=lambda o, u: {"order": o["id"], "tier": None if u is None else u["tier"]},
            left=left,
        )
        .to_rstream()
        .sink("enriched")
    )
    return b.build()


def _table_join_data(
    rnd: random.Random,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Table updates before (ts < 5000) and after (ts >= 5000) the orders (ts < 10000);
    every table update has its own time; some orders share a table update's time."""
    table_ts = sorted(rnd.sample(range(0, 10_000), 60))
    updates: list[dict[str, Any]] = [
        {"user": rnd.choice(_USERS[:-1]), "tier": f"t{i}", "ts": ts}  # eve has no table value
        for i, ts in enumerate(table_ts)
    ]
    # cy's first table value comes late: its earlier orders meet nothing.
    updates = [u for u in updates if not (u["user"] == "cy" and u["ts"] < 4_000)]
    before = [u for u in updates if u["ts"] < 5_000]
    after = [u for u in updates if u["ts"] >= 5_000]
    placed: list[tuple[str, int]] = [(u["user"], u["ts"]) for u in rnd.sample(updates, 20)]
    placed += [(rnd.choice(_USERS), rnd.randrange(10_000)) for _ in range(150)]  # and others
    placed.sort(key=lambda p: p[1])
    orders = [{"id": i, "user": user, "ts": ts} for i, (user, ts) in enumerate(placed)]
    return before, orders, after


def _table_join_reference(
    updates: list[dict[str, Any]], orders: list[dict[str, Any]], left: bool
) -> list[dict[str, Any]]:
    out = []
    for order in orders:
        seen = [u for u in updates if u["user"] == order["user"] and u["ts"] <= order["ts"]]
        latest = max(seen, key=lambda u: u["ts"]) if seen else None
        if latest is not None or left:
            out.append({"order": order["id"], "tier": None if latest is None else latest["tier"]})
    return out


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("advance_between", [False, True])
@pytest.mark.parametrize("max_records", [None, 7])
def test_stream_table_join_meets_the_table_as_of_the_event_time(
    left: bool, advance_between: bool, max_records: int | None
) -> None:
    rnd = random.Random(11)
    before, orders, after = _table_join_data(rnd)
    expected = _table_join_reference(before + after, orders, left)
    # The data exercise every case: a value updated after the order arrived, no value yet,
    # no value ever, and an update exactly at an order's time.
    assert any(o["user"] == "eve" for o in orders)
    assert any(u["user"] == o["user"] and u["ts"] <= o["ts"] for o in orders for u in after)
    assert any(
        u["ts"] == o["ts"] and u["user"] == o["user"] for o in orders for u in before + after
    )
    with TopologyTestDriver(
        _table_join_topology(left),
        source_queues=2,
        shuffle_queues=3,
        max_records_per_batch=max_records,
    ) as driver:
        for u in before:
            driver.pipe(u, topic="users")
        if advance_between:
            driver.advance()
        for o in orders:
            driver.pipe(o, topic="orders")
        if advance_between:
            driver.advance()
        for u in after:
            driver.pipe(u, topic="users")
        driver.advance()
        driver.advance_idle()  # stream records wait for the watermark: flush them
        got = driver.outputs("enriched")
        assert _bag(got) == _bag(expected)
        assert sorted(o["order"] for o in got) == sorted(o["order"] for o in expected)
        assert sum(s.late for s in driver.stats) == 0


def test_stream_table_join_is_exact_across_replays_and_restores() -> None:
    rnd = random.Random(24)
    before, orders, after = _table_join_data(rnd)
    expected = _table_join_reference(before + after, orders, True)
    topology = _table_join_topology(True)
    shuffle = topology.shuffle_topics[0]
    with TopologyTestDriver(topology, source_queues=2, shuffle_queues=3) as driver:
        for u in before:
            driver.pipe(u, topic="users")
        for o in orders[: len(orders) // 2]:
            driver.pipe(o, topic="orders")
        driver.advance()
        # A crash after the work, before the offsets, then the queues move: replays and a
        # restore must neither lose a waiting order nor join one twice.
        driver.rewind("users", 0)
        driver.rewind("orders", 0)
        driver.rewind(shuffle, 0)
        driver.restore_state()
        driver.advance()
        for o in orders[len(orders) // 2 :]:
            driver.pipe(o, topic="orders")
        for u in after:
            driver.pipe(u, topic="users")
        driver.advance()
        driver.restore_state()
        driver.advance_idle()
        assert _bag(driver.outputs("enriched")) == _bag(expected)
        keys = [r.keys for r in driver.output_records("enriched")]
        assert len(set(keys)) == len(keys)


def test_stream_table_join_waits_for_the_table_watermark() -> None:
    """An order is not joined before the table's queues passed its time (or went idle)."""
    with TopologyTestDriver(_table_join_topology(True), source_queues=1) as driver:
        driver.pipe({"user": "ann", "tier": "gold", "ts": 100}, topic="users")
        driver.pipe({"id": 1, "user": "ann", "ts": 500}, topic="orders")
        driver.advance()
        assert driver.outputs("enriched") == []
        driver.pipe({"user": "ann", "tier": "platinum", "ts": 400}, topic="users")
        driver.pipe({"user": "ann", "tier": "later", "ts": 900}, topic="users")
        driver.pipe({"id": 2, "user": "ann", "ts": 1_000}, topic="orders")
        driver.advance()
        updates = [
            {"user": "ann", "tier": "gold", "ts": 100},
            {"user": "ann", "tier": "platinum", "ts": 400},
            {"user": "ann", "tier": "later", "ts": 900},
        ]
        orders = [{"id": 1, "user": "ann", "ts": 500}, {"id": 2, "user": "ann", "ts": 1_000}]
        # The watermark is now min(orders 1000, users 900): order 1 has met its table value.
        assert driver.outputs("enriched") == _table_join_reference(updates, orders[:1], True)
        driver.advance_idle()
        assert driver.outputs("enriched") == _table_join_reference(updates, orders, True)


# -- 7. metadata ----------------------------------------------------------------


def _describe(v: Any, m: Metadata) -> dict[str, Any]:
    return {
        "value": v,
        "topic": m.topic,
        "queue": m.queue_id,
        "offset": m.offset,
        "keys": list(m.keys),
        "key": m.key,
        "tags": m.tags,
        "properties": m.properties,
        "born": m.born_timestamp,
        "stored": m.store_timestamp,
        "event_time": m.event_time,
    }


def test_metadata_of_piped_records_reaches_user_functions() -> None:
    b = StreamBuilder("meta")
    (
        b.source("events", json_deserializer)
        .filter(lambda v, m: m.tags != "skip", metadata=True)
        .select_timestamp("at")
        .map(_describe, metadata=True)
        .sink("described")
    )
    rnd = random.Random(12)
    piped: list[dict[str, Any]] = []
    next_offset: Counter[int] = Counter()
    with TopologyTestDriver(b.build(), source_queues=3) as driver:
        for i in range(60):
            queue = rnd.randrange(3)
            born = 1_000 + i * 10
            tags = rnd.choice(["a", "b", "skip", None])
            key = rnd.choice([None, f"user-{i % 5}", f"two keys-{i}"])
            props = {"n": str(i), "kind": rnd.choice(["x", "y"])} if i % 2 else None
            value = {"i": i, "at": born + 7}
            driver.pipe(
                value,
                topic="events",
                queue=queue,
                event_time=born,
                key=key,
                tags=tags,
                properties=props,
            )
            offset = next_offset[queue]
            next_offset[queue] += 1
            if tags == "skip":
                continue
            keys = key.split(" ") if key else []
            piped.append(
                {
                    "value": value,
                    "topic": "events",
                    "queue": queue,
                    "offset": offset,
                    "keys": keys,
                    "key": keys[0] if keys else None,
                    "tags": tags,
                    "properties": props or {},
                    "born": born,
                    "stored": born,
                    "event_time": born + 7,  # select_timestamp, not the born time
                }
            )
        driver.advance()
        assert _bag(driver.outputs("described")) == _bag(piped)


def test_metadata_after_an_aggregate_is_the_result_s() -> None:
    b = StreamBuilder("meta-after")
    (
        b.source("lines", text_deserializer)
        .flat_map(lambda line, m: [(w, m.queue_id) for w in line.split()], metadata=True)
        .key_by(lambda wq: wq[0])
        .window(_tumbling())
        .count()
        .to_rstream()
        .map(
            lambda r, m: {
                "key": r["key"],
                "result_key": m.result_key,
                "event_time": m.event_time,
                "window_end": r["window_end"],
                "queue": m.queue_id,
                "offset": m.offset,
                "tags": m.tags,
            },
            metadata=True,
        )
        .sink("out")
    )
    topology = b.build()
    rnd = random.Random(13)
    events = sorted(
        [(line, rnd.randint(0, 29_999)) for line in _lines(rnd, 60)], key=lambda e: e[1]
    )
    pairs = {(w, _window_start(ts)) for line, ts in events for w in line.split()}
    expected = [
        {
            "key": w,
            "result_key": w,
            "event_time": start + _SIZE - 1,
            "window_end": start + _SIZE,
            "queue": None,
            "offset": None,
            "tags": None,
        }
        for w, start in pairs
    ]
    with TopologyTestDriver(topology, source_queues=2) as driver:
        for line, ts in events:
            driver.pipe(line, event_time=ts)
        driver.advance_idle()
        assert _bag(driver.outputs("out")) == _bag(expected)


def test_metadata_names_the_topic_of_each_side_of_a_union() -> None:
    b = StreamBuilder("meta-union")
    a = b.source("first", json_deserializer)
    c = b.source("second", json_deserializer)
    a.union(c).map(lambda v, m: [v, m.topic, m.queue_id, m.offset], metadata=True).sink("out")
    piped: list[list[Any]] = []
    offsets: Counter[tuple[str, int]] = Counter()
    with TopologyTestDriver(b.build(), source_queues=2) as driver:
        for i in range(30):
            topic = "first" if i % 3 else "second"
            queue = i % 2
            driver.pipe(i, topic=topic, queue=queue)
            piped.append([i, topic, queue, offsets[(topic, queue)]])
            offsets[(topic, queue)] += 1
        driver.advance()
        assert _bag(driver.outputs("out")) == _bag(piped)


# -- 8. sink key, tags, properties --------------------------------------------------


def test_sink_key_tags_and_properties() -> None:
    b = StreamBuilder("sinkmeta")
    (
        b.source("orders", json_deserializer).sink(
            "out",
            key="user",
            tags=lambda v: v["kind"],
            properties=lambda v: {"amount": v["amount"], "region": v["region"]},
        )
    )
    topology = b.build()
    sink_op = _op_ids(topology, n.Sink)[0]
    rnd = random.Random(14)
    orders = [
        {
            "user": rnd.choice(_USERS),
            "kind": rnd.choice(["buy", "sell"]),
            "amount": rnd.randint(1, 999),
            "region": rnd.choice(["eu", "us"]),
        }
        for _ in range(80)
    ]
    sink_queues = 4
    with TopologyTestDriver(topology, source_queues=2, sink_queues=sink_queues) as driver:
        positions = []
        for i, order in enumerate(orders):
            record = driver.pipe(order, queue=i % 2)
            positions.append((record.queue_id, record.queue_offset))
        driver.advance()
        records = driver.output_records("out")
        assert len(records) == len(orders)
        got = {}
        for record in records:
            assert len(record.keys) == 2
            got[record.keys[-1]] = record
        for order, (queue, offset) in zip(orders, positions, strict=True):
            record = got[f"sinkmeta/{sink_op}/orders/{queue}/{offset}/0"]
            assert json.loads(record.body) == order
            assert record.keys[0] == order["user"]
            assert record.tags == order["kind"]
            assert record.properties == {
                "amount": str(order["amount"]),
                "region": order["region"],
            }
            # The sink queue follows the user's key.
            assert record.queue_id == queue_for_key(order["user"], sink_queues)


def test_sink_key_after_an_aggregate_keeps_the_dedup_key_last() -> None:
    b = StreamBuilder("sinkagg")
    (
        b.source("lines", text_deserializer)
        .flat_map(str.split)
        .key_by(lambda w: w)
        .count()
        .to_rstream()
        .sink("out", key=lambda r: f"word-{r['key']}", tags="key")
    )
    topology = b.build()
    sink_op = _op_ids(topology, n.Sink)[0]
    lines = _lines(random.Random(15), 50)
    expected = Counter(w for line in lines for w in line.split())
    with TopologyTestDriver(topology) as driver:
        driver.pipe_many(lines)
        driver.advance()
        records = driver.output_records("out")
        assert _latest([json.loads(r.body) for r in records]) == dict(expected)
        for record in records:
            word = json.loads(record.body)["key"]
            user_key, engine_key = record.keys
            assert user_key == f"word-{word}"
            expected_key = re.escape(f"sinkagg/{sink_op}/{word}/") + r"v\d+/0"
            assert re.fullmatch(expected_key, engine_key), engine_key
            assert record.tags == word
            assert record.properties == {}


def test_sink_properties_that_are_not_a_dict_are_a_dead_letter_naming_the_sink() -> None:
    b = StreamBuilder("bad-props")
    (
        b.source("nums", json_deserializer).sink(
            "out", properties=lambda v: {"v": v} if v % 4 else [("v", v)]
        )
    )
    topology = b.build()
    sink_op = _op_ids(topology, n.Sink)[0]
    nums = list(range(40))
    with TopologyTestDriver(topology, source_queues=2) as driver:
        driver.pipe_many(nums)
        driver.advance()
        assert Counter(driver.outputs("out")) == Counter(v for v in nums if v % 4)
        letters = driver.dead_letters()
        assert Counter(json.loads(body) for body, _ in letters) == Counter(
            v for v in nums if not v % 4
        )
        assert {props["operator"] for _, props in letters} == {sink_op}
        assert all("dict" in props["reason"] for _, props in letters)


def test_a_branch_predicate_that_raises_is_a_dead_letter_naming_the_branch() -> None:
    b = StreamBuilder("bad-branch")
    small, rest = b.source("nums", json_deserializer).branch(
        lambda v: 100 // v < 10, lambda v: True
    )
    small.sink("small")
    rest.key_by(lambda v: v % 3).count().to_rstream().sink("rest-counts")
    topology = b.build()
    branch_op = _op_ids(topology, n.Split)[0]
    rnd = random.Random(23)
    nums = [rnd.randint(0, 30) for _ in range(120)]
    assert 0 in nums
    with TopologyTestDriver(topology, source_queues=2) as driver:
        driver.pipe_many(nums)
        driver.advance()
        assert Counter(driver.outputs("small")) == Counter(v for v in nums if v and 100 // v < 10)
        rest_values = [v for v in nums if v and 100 // v >= 10]
        assert _latest(driver.outputs("rest-counts")) == dict(Counter(v % 3 for v in rest_values))
        letters = driver.dead_letters()
        assert [json.loads(body) for body, _ in letters] == [0] * nums.count(0)
        assert {props["operator"] for _, props in letters} == {branch_op}
        assert all(props["reason"].startswith("ZeroDivisionError") for _, props in letters)


# -- 9. dead letters --------------------------------------------------------------


def _events_with_poison(rnd: random.Random, count: int) -> list[dict[str, Any]]:
    return [
        {
            "user": rnd.choice(_USERS),
            "tags": rnd.sample(_WORDS, rnd.randint(1, 3)),
            "bad": rnd.random() < 0.2,
        }
        for _ in range(count)
    ]


@pytest.mark.parametrize("pre_combine", [True, False])
def test_a_set_value_is_a_dead_letter_naming_the_key_by(pre_combine: bool) -> None:
    b = StreamBuilder("set-value")
    (
        b.source("events", json_deserializer)
        .map(lambda v: {"user": v["user"], "tags": set(v["tags"]) if v["bad"] else v["tags"]})
        .key_by("user")
        .count()
        .to_rstream()
        .sink("counts")
    )
    topology = b.build()
    key_by = _op_ids(topology, n.KeyBy)[0]
    events = _events_with_poison(random.Random(16), 200)
    bad = [e for e in events if e["bad"]]
    assert bad
    with TopologyTestDriver(topology, source_queues=2, pre_combine=pre_combine) as driver:
        driver.pipe_many(events)
        driver.advance()
        assert _latest(driver.outputs("counts")) == dict(
            Counter(e["user"] for e in events if not e["bad"])
        )
        letters = driver.dead_letters()
        assert _bag(json.loads(body) for body, _ in letters) == _bag(bad)
        for _body, props in letters:
            assert props["operator"] == key_by
            assert "set" in props["reason"]
            assert props["source_topic"] == "events"


@pytest.mark.parametrize("pre_combine", [True, False])
def test_a_frozenset_key_is_a_dead_letter_naming_the_key_by(pre_combine: bool) -> None:
    b = StreamBuilder("fs-key")
    (
        b.source("events", json_deserializer)
        .key_by(lambda v: frozenset(v["tags"]) if v["bad"] else v["user"])
        .count()
        .to_rstream()
        .sink("counts")
    )
    topology = b.build()
    key_by = _op_ids(topology, n.KeyBy)[0]
    events = _events_with_poison(random.Random(17), 200)
    bad = [e for e in events if e["bad"]]
    assert bad
    with TopologyTestDriver(topology, source_queues=2, pre_combine=pre_combine) as driver:
        driver.pipe_many(events)
        driver.advance()
        assert _latest(driver.outputs("counts")) == dict(
            Counter(e["user"] for e in events if not e["bad"])
        )
        letters = driver.dead_letters()
        assert _bag(json.loads(body) for body, _ in letters) == _bag(bad)
        for _body, props in letters:
            assert props["operator"] == key_by
            assert "frozenset" in props["reason"]


def test_a_set_after_an_aggregate_is_a_dead_letter_of_the_second_key_by() -> None:
    b = StreamBuilder("set-later")
    (
        b.source("lines", json_deserializer)
        .select_timestamp("ts")
        .flat_map(lambda v: v["text"].split())
        .key_by(lambda w: w)
        .window(_tumbling())
        .count()
        .to_rstream()
        .map(lambda r: {**r, "count": {r["count"]}} if r["key"] == "state" else r)
        .key_by(lambda r: r["count"] if isinstance(r["count"], int) else -1)
        .count("pairs")
        .to_rstream()
        .sink("count-of-counts")
    )
    topology = b.build()
    key_by_ops = _op_ids(topology, n.KeyBy)
    rnd = random.Random(18)
    events = _events(rnd, 150, 0, 40_000)
    pairs = Counter((w, _window_start(e["ts"])) for e in events for w in e["text"].split())
    good = Counter(c for (w, _start), c in pairs.items() if w != "state")
    poisoned = [p for p in pairs if p[0] == "state"]
    assert poisoned
    with TopologyTestDriver(topology, source_queues=2, shuffle_queues=3) as driver:
        for event in events:
            driver.pipe(event)
        driver.advance_idle()
        assert _latest(driver.outputs("count-of-counts"), "pairs") == dict(good)
        letters = driver.dead_letters()
        assert len(letters) == len(poisoned)
        assert {props["operator"] for _, props in letters} == {key_by_ops[1]}
        assert all("set" in props["reason"] for _, props in letters)


def test_a_joiner_that_raises_is_a_dead_letter_naming_the_join() -> None:
    def joiner(c: dict[str, Any], v: dict[str, Any]) -> dict[str, Any]:
        if c["click"] % 5 == 0:
            raise ValueError(f"click {c['click']} refused")
        return {"l": c, "r": v}

    b = StreamBuilder("bad-joiner")
    clicks = b.source("clicks", json_deserializer)
    views = b.source("views", json_deserializer)
    (
        clicks.join(views)
        .where("user")
        .equal_to("user")
        .window(_tumbling())
        .water_mark(_LATENESS_MS / 1000)
        .apply(joiner)
        .sink("joined")
    )
    topology = b.build()
    join_op = _op_ids(topology, n.Join)[0]
    rnd = random.Random(19)
    events = _join_events(rnd, 250)
    pairs = _join_reference(events, "inner")
    refused = [p for p in pairs if p["l"]["click"] % 5 == 0]
    assert refused
    with TopologyTestDriver(topology, source_queues=2, shuffle_queues=2) as driver:
        for topic, value, ts in events:
            driver.pipe(value, topic=topic, event_time=ts)
        driver.advance_idle()
        assert _bag(driver.outputs("joined")) == _bag(p for p in pairs if p not in refused)
        letters = driver.dead_letters()
        assert _bag(json.loads(body) for body, _ in letters) == _bag(
            [p["l"], p["r"]] for p in refused
        )
        for _body, props in letters:
            assert props["operator"] == join_op
            assert props["reason"].startswith("ValueError: click ")


# -- 10. build-time errors ------------------------------------------------------------


def _two_streams() -> tuple[StreamBuilder, RStream, RStream]:
    b = StreamBuilder("errors")
    return b, b.source("a", json_deserializer), b.source("c", json_deserializer)


def test_a_join_without_a_window_is_refused() -> None:
    _, a, c = _two_streams()
    with pytest.raises(ValueError, match="needs a window"):
        a.join(c).where("k").equal_to("k").apply()
    with pytest.raises(ValueError, match="needs a window"):
        a.left_join(c).where("k").equal_to("k").apply()


@pytest.mark.parametrize("keys", ["none", "where", "equal_to"])
def test_a_join_without_both_keys_is_refused(keys: str) -> None:
    _, a, c = _two_streams()
    declared = a.join(c).window(_tumbling())
    if keys == "where":
        declared = declared.where("k")
    elif keys == "equal_to":
        declared = declared.equal_to("k")
    with pytest.raises(ValueError, match=r"\.where\(\.\.\.\) and \.equal_to\(\.\.\.\)"):
        declared.apply()


def test_a_join_with_another_builder_s_stream_is_refused() -> None:
    _, a, _c = _two_streams()
    other = StreamBuilder("other").source("x", json_deserializer)
    with pytest.raises(TypeError, match="same StreamBuilder"):
        a.join(other)
    with pytest.raises(TypeError, match="same StreamBuilder"):
        a.union(other)


def test_a_branch_without_predicates_is_refused() -> None:
    _, a, _c = _two_streams()
    with pytest.raises(ValueError, match="at least one predicate"):
        a.branch()
    with pytest.raises(ValueError, match="at least one predicate"):
        a.branch(default=True)
    with pytest.raises(TypeError, match="branch"):
        a.branch(lambda v: True, 3)  # type: ignore[arg-type]


def test_a_union_without_other_streams_is_refused() -> None:
    _, a, _c = _two_streams()
    with pytest.raises(ValueError, match="at least one other stream"):
        a.union()


@pytest.mark.parametrize("windowed", [False, True])
def test_a_key_by_not_followed_by_an_aggregate_is_refused(windowed: bool) -> None:
    b, a, _c = _two_streams()
    a.map(lambda v: v).sink("fine")
    grouped = a.key_by("k")
    if windowed:
        grouped.window(_tumbling())
    with pytest.raises(ValueError, match="not followed by an aggregate"):
        b.build()


def test_a_key_by_aggregated_without_to_rstream_is_refused() -> None:
    b, a, _c = _two_streams()
    a.key_by("k").count()
    with pytest.raises(ValueError, match="not followed by an aggregate"):
        b.build()


def test_a_dangling_key_by_is_refused_beside_an_aggregated_one_with_the_same_selector() -> None:
    b, a, _c = _two_streams()

    def selector(v: Any) -> Any:
        return v["k"]

    a.key_by(selector)  # dangling
    a.key_by(selector).count().to_rstream().sink("counts")
    with pytest.raises(ValueError, match="not followed by an aggregate"):
        b.build()


def test_a_dangling_key_by_after_an_aggregate_is_refused() -> None:
    b, a, _c = _two_streams()
    a.key_by("k").count().to_rstream().key_by("count")
    with pytest.raises(ValueError, match="not followed by an aggregate"):
        b.build()


def test_the_same_topic_as_two_sources_is_refused() -> None:
    b, _a, _c = _two_streams()
    with pytest.raises(ValueError, match="'a' is already a source"):
        b.source("a", text_deserializer)
    with pytest.raises(ValueError, match="'c' is already a source"):
        b.table("c", json_deserializer, key="k")
    # and the plan itself refuses it, whoever built it
    nodes = (
        n.Source("s1", "t", json_deserializer),
        n.Source("s2", "t", json_deserializer),
    )
    with pytest.raises(ValueError, match="read by more than one source"):
        Topology("dup", nodes)


def test_a_table_join_with_another_builder_s_table_is_refused() -> None:
    _, a, _c = _two_streams()
    table = StreamBuilder("other").table("users", json_deserializer, key="user")
    with pytest.raises(TypeError, match="same StreamBuilder"):
        a.join_table(table, key="user")
