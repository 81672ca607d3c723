"""Lateness by each source queue's own progress, whatever the keys' routes (issue 18).

Each test feeds hour-late records among on-time ones and compares every
result, the late count and the late topic with :mod:`tests.event_time_reference`,
computed from the input alone. The inputs hold the case that used to lose
records: a late record whose source queue had never sent anything to the
stateful queue its key goes to, so only progress marks can tell that queue
how far the source had moved. Batch sizes, shuffle queue counts and
pre-combining vary, and must not change a single verdict.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.runtime.core.shuffle_codec import decode, encode_key
from stream_assets.serde import json_deserializer
from stream_assets.testing import TopologyTestDriver
from stream_assets.windows import SessionWindow, Time, TumblingWindow
from tests.event_time_reference import (
    Event,
    session_counts,
    table_join,
    tumbling_end,
    window_join,
    with_progress,
)

BASE = 1_700_000_000_000  # window-aligned
HOUR = 3_600_000
SIZE = 10_000
LATENESS = 2_000
SOURCE_QUEUES = 2
#: (shuffle queues, records per batch, pre-combine): routes and batches that must not matter.
SHAPES = [(1, None, True), (4, 3, True), (4, None, False), (3, 1, True)]


def _events(rnd: random.Random, n: int, keys: str, ids: str, start: int = 0) -> list[Event]:
    """Mostly forward in time, a few out of order within the lateness, about one in
    eight an hour (or more) old."""
    out = []
    for i in range(n):
        ts = BASE + HOUR + (start + i) * 700 + rnd.randint(-1_500, 300)
        if rnd.random() < 0.125:
            ts -= HOUR + rnd.randint(0, 30_000)
        out.append({"key": rnd.choice(keys), "id": f"{ids}{i}", "ts": ts})
    return out


def _split(events: list[Event], rnd: random.Random) -> dict[int, list[Event]]:
    """Events spread over the source queues, each queue's list in send order."""
    queues: dict[int, list[Event]] = {q: [] for q in range(SOURCE_QUEUES)}
    for e in events:
        queues[rnd.randrange(SOURCE_QUEUES)].append(e)
    return queues


def _pipe(driver: TopologyTestDriver, topic: str, queues: dict[int, list[Event]]) -> None:
    for q, events in queues.items():
        for e in events:
            driver.pipe(e, topic=topic, queue=q, event_time=e["ts"])


def _unseen_route_lates(
    queues: dict[int, list[Event]], late: list[Event], shuffle_queues: int
) -> int:
    """Late records whose source queue sent nothing before them to their key's shuffle
    queue: what only a progress mark can judge."""
    late_ids = {id(e) for e in late}
    count = 0
    for events in queues.values():
        reached: set[int] = set()
        for e in events:
            target = queue_for_key(encode_key(e["key"]), shuffle_queues)
            if id(e) in late_ids and target not in reached:
                count += 1
            reached.add(target)
    return count


def _late_ids(driver: TopologyTestDriver) -> list[str]:
    values = [r["value"] for r in driver.late()]  # a join's are [side, value]
    return sorted((v[1] if isinstance(v, list) else v)["id"] for v in values)


def _rounds(
    *feeds: tuple[str, dict[int, list[Event]], int],
) -> Callable[[TopologyTestDriver], None]:
    """Feed ``(topic, queues, records per queue per round)`` in interleaved rounds, as live
    producers would: each round pipes a slice of every queue, then advances."""

    def feed(driver: TopologyTestDriver) -> None:
        done = 0
        while any(done * n < len(ev) for _t, queues, n in feeds for ev in queues.values()):
            for topic, queues, n in feeds:
                _pipe(driver, topic, {q: ev[done * n : (done + 1) * n] for q, ev in queues.items()})
            driver.advance()
            done += 1

    return feed


def _windowed_count(job: str, source: str, window: Any) -> Topology:
    """``count("n")`` per key and window of the JSON events of ``source`` (event time
    ``ts``), 2 s lateness, late records to ``late``, results to ``out``."""
    b = StreamBuilder(job)
    (
        b.source(source, json_deserializer)
        .select_timestamp("ts")
        .key_by("key")
        .window(window)
        .count("n")
        .water_mark(LATENESS / 1000)
        .late_records_to("late")
        .to_rstream()
        .sink("out")
    )
    return b.build()


def _join_topology(kind: str) -> Topology:
    b = StreamBuilder(f"pay-{kind}")
    orders = b.source("orders", json_deserializer).select_timestamp("ts")
    payments = b.source("payments", json_deserializer).select_timestamp("ts")
    (
        (orders.join(payments) if kind == "inner" else orders.left_join(payments))
        .where("key")
        .equal_to("key")
        .window(TumblingWindow.of(Time.milliseconds(SIZE)))
        .water_mark(LATENESS / 1000)
        .late_records_to("late")
        .apply(lambda o, p: {"o": o["id"], "p": None if p is None else p["id"]})
        .sink("out")
    )
    return b.build()


def _run(
    topology: Topology,
    shape: tuple[int, int | None, bool],
    feed: Callable[[TopologyTestDriver], None],
) -> tuple[list[Any], list[str], int]:
    """Outputs, late record ids and the late count of one run."""
    shuffle_queues, per_batch, combine = shape
    with TopologyTestDriver(
        topology,
        source_queues=SOURCE_QUEUES,
        shuffle_queues=shuffle_queues,
        max_records_per_batch=per_batch,
        pre_combine=combine,
    ) as driver:
        feed(driver)
        driver.advance_idle()
        return driver.outputs(), _late_ids(driver), sum(s.late for s in driver.stats)


@pytest.mark.parametrize("kind", ["inner", "left"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_window_join_judges_each_record_by_its_own_source_queue(
    kind: str, shape: tuple[int, int | None, bool]
) -> None:
    rnd = random.Random(19)
    orders = _split(_events(rnd, 160, "abcdefghijkl", "o"), rnd)
    payments = _split(_events(rnd, 160, "abcdefghijkl", "p"), rnd)
    pairs, late = window_join(orders, payments, SIZE, LATENESS, kind)
    unseen = _unseen_route_lates(orders, late, shape[0]) + _unseen_route_lates(
        payments, late, shape[0]
    )
    assert shape[0] == 1 or unseen > 0

    feed = _rounds(("orders", orders, 10), ("payments", payments, 10))
    outputs, late_ids, late_count = _run(_join_topology(kind), shape, feed)
    assert sorted(((o["o"], o["p"]) for o in outputs), key=repr) == pairs
    assert late_ids == sorted(e["id"] for e in late)
    assert late_count == len(late)


@pytest.mark.parametrize("kind", ["inner", "left"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_table_join_drops_hour_late_table_updates_whatever_their_route(
    kind: str, shape: tuple[int, int | None, bool]
) -> None:
    rnd = random.Random(5)
    stream = _split(_events(rnd, 150, "abcdef", "s"), rnd)
    table_events = _events(rnd, 60, "abcdef", "t")
    for e in table_events:  # one key's updates never share an event time
        e["ts"] = e["ts"] - e["ts"] % 7 + int(e["id"][1:]) % 7
    table = _split(table_events, rnd)
    pairs, late = table_join(stream, table, LATENESS, kind)
    late_table = [e for e in late if e["id"].startswith("t")]
    assert late_table
    assert shape[0] == 1 or _unseen_route_lates(table, late_table, shape[0]) > 0

    b = StreamBuilder(f"prices-{kind}")
    prices = b.table("table", json_deserializer, key="key", timestamp="ts")
    (
        b.source("stream", json_deserializer)
        .select_timestamp("ts")
        .join_table(
            prices,
            key="key",
            joiner=lambda s, t: {"s": s["id"], "t": None if t is None else t["id"]},
            left=kind == "left",
        )
        .water_mark(LATENESS / 1000)
        .late_records_to("late")
        .to_rstream()
        .sink("out")
    )

    feed = _rounds(("table", table, 6), ("stream", stream, 15))
    outputs, late_ids, late_count = _run(b.build(), shape, feed)
    assert sorted(((o["s"], o["t"]) for o in outputs), key=repr) == pairs
    assert late_ids == sorted(e["id"] for e in late)
    assert late_count == len(late)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sessions_judge_a_record_by_its_queue_and_the_session_it_joins(
    shape: tuple[int, int | None, bool],
) -> None:
    """Keys are tied to a source queue (producers key messages by user); records
    inside open sessions stay on time while other keys move the watermark."""
    rnd = random.Random(9)
    gap = 4_000
    queues: dict[int, list[Event]] = {q: [] for q in range(SOURCE_QUEUES)}
    users = [f"u{i}" for i in range(12)]
    progress: dict[int, int] = {}
    newest: dict[str, int] = {}
    for i in range(240):
        user = rnd.choice(users)
        q = int(user[1:]) % SOURCE_QUEUES
        ts = BASE + HOUR + i * 500 + rnd.randint(-1_000, 0)
        closed_to = progress[q] - LATENESS if q in progress else None
        last = newest.get(user)
        roll = rnd.random()
        if closed_to is not None and roll < 0.1:
            ts -= HOUR
        elif closed_to is not None and roll < 0.25:
            # Behind by more than the lateness, less than lateness + gap: such a
            # click may touch a session that closed (and fired, or not yet).
            ts = closed_to - rnd.randint(0, gap)
        elif last is not None and closed_to is not None and 0 <= closed_to - last - gap < gap:
            ts = last + gap - 500  # touches the user's just-closed session, own window open
        progress[q] = max(progress.get(q, ts), ts)
        newest[user] = max(newest.get(user, ts), ts)
        queues[q].append({"key": user, "id": f"e{i}", "ts": ts})
    counts, late = session_counts(queues, gap, LATENESS)
    assert late and any(n >= 3 for n in counts.values())
    # Late only because the session they touch had closed: their own window had not.
    late_ids = {e["id"] for e in late}
    assert any(
        e["id"] in late_ids and e["ts"] + gap > p - LATENESS
        for _q, e, p in with_progress(queues)
        if p is not None
    )

    topology = _windowed_count("sessions", "clicks", SessionWindow.with_gap(Time.milliseconds(gap)))

    outputs, late_ids, late_count = _run(topology, shape, _rounds(("clicks", queues, 13)))
    got = Counter({(o["key"], o["window_start"], o["window_end"]): o["n"] for o in outputs})
    assert len(outputs) == len(counts) and got == Counter(counts)
    assert late_ids == sorted(e["id"] for e in late)
    assert late_count == len(late)


def test_a_click_touching_a_closed_session_is_late_whether_or_not_it_fired() -> None:
    """Whether the closed session fired before the click came (a batch boundary between
    them) must not matter: the click is late both ways, never a second session."""
    gap = 4_000
    events = [
        {"key": "a", "id": "1", "ts": BASE},
        {"key": "b", "id": "2", "ts": BASE + 6_000},  # closes a's [0, 4 s) by 2 s lateness
        {"key": "a", "id": "3", "ts": BASE + 3_000},  # own window open, a's session closed
    ]
    counts, late = session_counts({0: events}, gap, LATENESS)
    topology = _windowed_count(
        "closed-session", "clicks", SessionWindow.with_gap(Time.milliseconds(gap))
    )
    for boundary in (None, 2):  # one batch; or a's session fires before the click
        with TopologyTestDriver(topology, source_queues=1, shuffle_queues=1) as driver:
            for i, e in enumerate(events):
                if i == boundary:
                    driver.advance()
                driver.pipe(e, queue=0, event_time=e["ts"])
            driver.advance_idle()
            got = {(o["key"], o["window_start"], o["window_end"]): o["n"] for o in driver.outputs()}
            assert got == counts and _late_ids(driver) == [e["id"] for e in late] == ["3"]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_pre_combined_count_judges_like_a_per_record_one(
    shape: tuple[int, int | None, bool],
) -> None:
    rnd = random.Random(31)
    queues = _split(_events(rnd, 300, "abcdefghijk", "w"), rnd)
    end = tumbling_end(SIZE)
    _pairs, late = window_join(queues, {}, SIZE, LATENESS, "left")
    late_ids = {id(e) for e in late}
    expected = Counter(
        (e["key"], end(e) - SIZE) for ev in queues.values() for e in ev if id(e) not in late_ids
    )
    topology = _windowed_count("combined", "words", TumblingWindow.of(Time.milliseconds(SIZE)))

    outputs, got_late, late_count = _run(topology, shape, _rounds(("words", queues, 30)))
    assert Counter({(o["key"], o["window_start"]): o["n"] for o in outputs}) == expected
    assert got_late == sorted(e["id"] for e in late)
    assert late_count == len(late)


def test_every_shuffle_queue_hears_a_batch_s_progress_once_and_a_replay_adds_nothing() -> None:
    """A source queue's batch reaches every shuffle queue: its records' last message
    ends with the progress, and a queue none of its keys went to gets one mark."""
    topology = _windowed_count("marks", "words", TumblingWindow.of(Time.milliseconds(SIZE)))
    shuffle_queues = 4
    key = "a"
    home = queue_for_key(encode_key(key), shuffle_queues)
    with TopologyTestDriver(topology, source_queues=1, shuffle_queues=shuffle_queues) as driver:
        driver.pipe_many([{"key": key, "ts": BASE + t} for t in (5, 900, 300)], event_time=1)
        stats = driver.advance()
        shuffle = driver.output_records(driver.topology.shuffle_topics[0])
        bodies = {r.queue_id: decode(r.body) for r in shuffle}
        assert len(shuffle) == shuffle_queues and set(bodies) == set(range(shuffle_queues))
        assert all(body["p"] == BASE + 900 for body in bodies.values())
        assert [q for q, body in bodies.items() if "recs" not in body and "comb" not in body] == [
            q for q in range(shuffle_queues) if q != home
        ]
        assert stats[0].progress_marks == shuffle_queues - 1
        driver.rewind()  # the source batch runs again: its marks are skipped by origin
        driver.advance()
        assert len(driver.output_records(driver.topology.shuffle_topics[0])) == 2 * shuffle_queues
        driver.advance_idle()
        assert [(o["key"], o["n"]) for o in driver.outputs()] == [(key, 3)]


def test_a_chained_stage_moves_its_watermark_by_marks_from_queues_without_results() -> None:
    """Upstream stateful queues whose windows produced nothing still tell the next
    stage how far they fired, so its windows fire without any idleness."""
    b = StreamBuilder("chained")
    (
        b.source("words", json_deserializer)
        .select_timestamp("ts")
        .key_by("key")
        .window(TumblingWindow.of(Time.milliseconds(SIZE)))
        .count("n")
        .to_rstream()
        .key_by(lambda r: r["n"])
        .window(TumblingWindow.of(Time.milliseconds(SIZE)))
        .count("keys")
        .to_rstream()
        .sink("hist")
    )
    with TopologyTestDriver(b.build(), source_queues=1, shuffle_queues=4) as driver:
        # One key only: one upstream queue has results, the other three never do.
        driver.pipe_many([{"key": "a", "ts": BASE + t} for t in (1, 2, 3)], event_time=1)
        driver.advance()
        driver.pipe_many([{"key": "a", "ts": BASE + 5 * SIZE}], event_time=2)
        # Upstream fires [0, SIZE) on one queue (three words) and moves to 5 * SIZE on
        # all four: downstream passes that result's window, no idleness declared.
        driver.advance()
        assert [(o["key"], o["keys"]) for o in driver.outputs("hist")] == [(3, 1)]
        driver.pipe_many([{"key": "a", "ts": BASE + 9 * SIZE}], event_time=3)
        driver.advance()
        assert [(o["key"], o["keys"]) for o in driver.outputs("hist")] == [(3, 1), (1, 1)]
