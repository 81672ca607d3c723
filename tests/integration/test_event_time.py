"""Lateness by each source queue's own progress on the real broker and Spark (issue 18).

One topology of four independent pipelines, run by one instance: a windowed
inner and a windowed left join of the same two topics, a stream-table join,
and session counts. Part of the input is stored before the instance starts;
the rest comes from concurrent producers (several per topic) while it runs.
Every result, each late topic and each late count must equal
:mod:`tests.event_time_reference`, computed from the source topics as the
broker stored them: per queue in offset order, the order the engine read. So
how the producers happened to interleave is part of the input, not noise.

The input holds hour-late records among on-time and out-of-order ones, and,
where keys are shuffled, late records whose source queue had sent nothing
before them to their key's stateful queue (only progress marks can judge
those). Waiting is on the sinks' contents and broker offsets, never on time.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.runtime.core.shuffle_codec import encode_key
from stream_assets.runtime.spark.instance import Instance
from stream_assets.serde import json_deserializer
from stream_assets.settings import RocketMQSettings
from stream_assets.windows import SessionWindow, Time, TumblingWindow
from tests.event_time_reference import (
    Event,
    Queues,
    session_counts,
    table_join,
    window_join,
    with_progress,
)
from tests.integration._engine_util import (
    BackgroundProducer,
    Message,
    latest_by_message_key,
    produce_per_queue,
    read_topic,
    unique,
    wait_until,
)
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

BASE = 1_700_000_000_000  # window-aligned
HOUR = 3_600_000
SIZE = 10_000  # tumbling windows of the joins
LATENESS = 2_000
GAP = 4_000  # session gap
IDLE_S = 2
SOURCE_QUEUES = 2
SHUFFLE_QUEUES = 4  # EngineHarness.instance's default
STEP = 700  # event time between a queue's consecutive keyed events
#: Event time between the stored input and the live input. The instance may catch up
#: and see every source queue idle before the producers start: then every open window
#: fires and stays closed. Live input past them is judged the same either way.
PHASE_GAP = 30_000
#: Events per source queue, as generated and sent (the reference reads them back instead).
PerQueue = dict[int, list[Event]]
JOIN_KEYS = [f"k{i}" for i in range(12)]
TABLE_KEYS = [f"c{i}" for i in range(6)]


def _route(key: Any) -> int:
    return queue_for_key(encode_key(key), SHUFFLE_QUEUES)


def _keyed(
    rnd: random.Random, name: str, keys: list[str], stored: int, live: int
) -> tuple[PerQueue, PerQueue]:
    """Per source queue, events STEP apart but up to 1.5 s out of order (within the
    lateness), about one in eight an hour or more old: (stored part, live part).

    Each queue's third event is an hour late, with a key whose shuffle queue its
    queue's first two events did not go to.
    """
    parts: tuple[PerQueue, PerQueue] = ({}, {})
    for q in range(SOURCE_QUEUES):
        for phase, count in enumerate((stored, live)):
            events: list[Event] = []
            for i in range(count):
                ts = BASE + HOUR + (phase * stored + i) * STEP + rnd.randint(-1_500, 300)
                ts += phase * PHASE_GAP
                key = rnd.choice(keys)
                if phase == 0 and i == 2:
                    reached = {_route(e["key"]) for e in events}
                    key = rnd.choice([k for k in keys if _route(k) not in reached])
                    ts -= HOUR
                elif (phase, i) != (0, 0) and rnd.random() < 1 / 8:
                    ts -= HOUR + rnd.randint(0, 30_000)
                events.append({"key": key, "id": f"{name}{phase}.{q}.{i}", "ts": ts})
            parts[phase][q] = events
    return parts


def _distinct_times(*parts: PerQueue) -> None:
    """Make one key's table updates never share an event time (table_join needs it)."""
    used: set[tuple[str, int]] = set()
    for part in parts:
        for events in part.values():
            for e in events:
                while (e["key"], e["ts"]) in used:
                    e["ts"] += 1
                used.add((e["key"], e["ts"]))


def _clicks(rnd: random.Random, stored: int, live: int) -> tuple[PerQueue, PerQueue]:
    """Clicks, each user's on one source queue, in send order: (stored part, live part).

    One heavy user per queue clicks every 1.7 s on average, so its sessions
    last; a click delayed by more than the lateness then often falls inside a
    session still open (on time), or touches one that closed (late, whether
    or not that session had fired yet: where batches end plays no part), or
    touches none and is late by its own window. Other clicks are out of order
    by at most 1 s, or an hour late.
    """
    heavy = [f"u{q}" for q in range(SOURCE_QUEUES)]
    light = [f"u{i}" for i in range(SOURCE_QUEUES, 12)]
    parts: tuple[PerQueue, PerQueue] = (
        {q: [] for q in range(SOURCE_QUEUES)},
        {q: [] for q in range(SOURCE_QUEUES)},
    )
    progress: dict[int, int] = {}
    newest: dict[str, int] = {}  # per user
    for i in range(stored + live):
        phase = 0 if i < stored else 1
        user = rnd.choice(heavy) if rnd.random() < 0.6 else rnd.choice(light)
        q = int(user[1:]) % SOURCE_QUEUES
        ts = BASE + HOUR + i * 500 + phase * PHASE_GAP - rnd.randint(0, 1_000)
        roll = rnd.random()
        closed_to = progress[q] - LATENESS if q in progress else None
        last = newest.get(user)
        if closed_to is not None and roll < 0.1:
            ts -= HOUR
        elif closed_to is not None and roll < 0.2:
            ts = closed_to - rnd.randint(0, GAP + 3_000)
        elif last is not None and closed_to is not None and 0 <= closed_to - last - GAP < GAP - 500:
            # The user's session just closed; this click touches it, its own window open.
            ts = last + GAP - 500
        progress[q] = max(progress.get(q, ts), ts)
        newest[user] = max(newest.get(user, ts), ts)
        parts[phase][q].append({"key": user, "id": f"e{phase}.{i}", "ts": ts})
    return parts


def _bodies(part: PerQueue) -> dict[int, Sequence[bytes]]:
    return {q: [json.dumps(e).encode() for e in events] for q, events in part.items()}


def _interleaved(rnd: random.Random, part: PerQueue) -> list[Message]:
    """The live events in time order, the queues' turns shuffled, so that each producer
    thread (every n-th message) writes to every queue."""
    out: list[Message] = []
    for i in range(max(len(events) for events in part.values())):
        turn = [q for q, events in part.items() if i < len(events)]
        rnd.shuffle(turn)
        out.extend(Message(json.dumps(part[q][i]).encode(), queue_id=q) for q in turn)
    return out


def _stored(admin: RocketMQAdmin, topic: str) -> Queues:
    """A topic's events per queue, in offset order (the order the engine read them)."""
    per_queue: dict[int, list[tuple[int, Event]]] = collections.defaultdict(list)
    for r in read_topic(admin, topic):
        per_queue[r.queue_id].append((r.queue_offset, json.loads(r.body)))
    out: dict[Hashable, list[Event]] = {
        q: [e for _, e in sorted(rows, key=lambda x: x[0])] for q, rows in per_queue.items()
    }
    return out


def _unseen_route_lates(queues: Queues, late: Sequence[Event]) -> int:
    """Late events whose source queue sent nothing before them to their key's shuffle
    queue: what only a progress mark can judge."""
    late_ids = {e["id"] for e in late}
    count = 0
    for events in queues.values():
        reached: set[int] = set()
        for e in events:
            if e["id"] in late_ids and _route(e["key"]) not in reached:
                count += 1
            reached.add(_route(e["key"]))
    return count


def _on_time_behind(queues: Queues, late: Sequence[Event], by: int) -> int:
    """On-time events more than ``by`` behind their queue's progress before them."""
    late_ids = {e["id"] for e in late}
    return sum(
        1
        for _q, e, progress in with_progress(queues)
        if progress is not None and e["ts"] < progress - by and e["id"] not in late_ids
    )


def _topology(job: str, topics: Mapping[str, str]) -> Topology:
    b = StreamBuilder(job)
    orders = b.source(topics["orders"], json_deserializer).select_timestamp("ts")
    payments = b.source(topics["payments"], json_deserializer).select_timestamp("ts")
    for kind in ("inner", "left"):
        (
            (orders.join(payments) if kind == "inner" else orders.left_join(payments))
            .where("key")
            .equal_to("key")
            .window(TumblingWindow.of(Time.milliseconds(SIZE)))
            .water_mark(LATENESS / 1000)
            .idle_timeout(IDLE_S)
            .late_records_to(topics[f"{kind}-late"])
            .apply(lambda o, p: {"o": o["id"], "p": None if p is None else p["id"]})
            .sink(topics[kind])
        )
    prices = b.table(topics["table"], json_deserializer, key="key", timestamp="ts")
    (
        b.source(topics["stream"], json_deserializer)
        .select_timestamp("ts")
        .join_table(
            prices,
            key="key",
            joiner=lambda s, t: {"s": s["id"], "t": None if t is None else t["id"]},
            left=True,
        )
        .water_mark(LATENESS / 1000)
        .idle_timeout(IDLE_S)
        .late_records_to(topics["table-late"])
        .to_rstream()
        .sink(topics["table-out"])
    )
    (
        b.source(topics["clicks"], json_deserializer)
        .select_timestamp("ts")
        .key_by("key")
        .window(SessionWindow.with_gap(Time.milliseconds(GAP)))
        .count("n")
        .water_mark(LATENESS / 1000)
        .idle_timeout(IDLE_S)
        .late_records_to(topics["sessions-late"])
        .to_rstream()
        .sink(topics["sessions"])
    )
    return b.build()


def _late_count(inst: Instance, late_topic: str) -> int:
    """The late records the stage diverting to ``late_topic`` counted."""
    (stage,) = [s for s in inst.topology.stages if s.head and s.head.late_topic == late_topic]
    return int(inst.metrics[stage.index].totals["late"])


def _late_ids(admin: RocketMQAdmin, topic: str) -> list[str]:
    """Ids in a late topic, one per late entry (a join's values are ``[side, value]``)."""
    values = [v["value"] for v in latest_by_message_key(read_topic(admin, topic)).values()]
    return sorted((v[1] if isinstance(v, list) else v)["id"] for v in values)


def _pairs(admin: RocketMQAdmin, topic: str, a: str, b: str) -> collections.Counter[Any]:
    """A join's results once per message key (the sinks are at-least-once)."""
    values = latest_by_message_key(read_topic(admin, topic)).values()
    return collections.Counter((v[a], v[b]) for v in values)


def _sessions(admin: RocketMQAdmin, topic: str) -> list[tuple[tuple[Any, int, int], int]]:
    values = latest_by_message_key(read_topic(admin, topic)).values()
    return [((v["key"], v["window_start"], v["window_end"]), v["n"]) for v in values]


def _settle(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for ``condition``; a timeout falls through to the comparisons after it,
    which show what differs."""
    with contextlib.suppress(AssertionError):
        wait_until(condition, timeout_s, what, poll_s=1.0)


def test_joins_and_sessions_equal_the_reference_with_stored_and_live_input(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    job = unique("it-evt")
    names = ["orders", "payments", "stream", "table", "clicks"]
    names += ["inner", "left", "table-out", "sessions"]
    names += ["inner-late", "left-late", "table-late", "sessions-late"]
    topics = {name: f"{job}-{name}" for name in names}
    sources = names[:5]
    for name in sources:
        admin.create_topic(topics[name], SOURCE_QUEUES)

    rnd = random.Random(18)
    parts: dict[str, tuple[PerQueue, PerQueue]] = {
        "orders": _keyed(rnd, "o", JOIN_KEYS, 50, 80),
        "payments": _keyed(rnd, "p", JOIN_KEYS, 50, 80),
        "stream": _keyed(rnd, "s", TABLE_KEYS, 50, 80),
        "table": _keyed(rnd, "t", TABLE_KEYS, 20, 30),
        "clicks": _clicks(rnd, 120, 200),
    }
    _distinct_times(*parts["table"])
    for name in sources:
        produce_per_queue(client_settings, topics[name], _bodies(parts[name][0]))
    # Live: two producers per keyed topic, each writing to both queues; one per clicks
    # queue, so each user's clicks keep their order (see _clicks). Connected and held
    # until the instance runs, so that no topic starts long after another.
    live = [
        BackgroundProducer(
            client_settings,
            topics[name],
            _interleaved(rnd, parts[name][1]),
            threads=2,
            pause_after=0,
        )
        for name in ("orders", "payments", "stream", "table")
    ]
    live += [
        BackgroundProducer(
            client_settings,
            topics["clicks"],
            [Message(body, queue_id=q) for body in bodies],
            threads=1,
            pause_after=0,
        )
        for q, bodies in _bodies(parts["clicks"][1]).items()
    ]
    for producer in live:
        producer.start()
    inst = engine.start(engine.instance(_topology(job, topics), tmp_path / "state"))
    for producer in live:
        producer.resume()
    for producer in live:
        producer.join(120)

    stored = {name: _stored(admin, topics[name]) for name in sources}
    for name in sources:
        sent = sum(len(events) for part in parts[name] for events in part.values())
        assert sum(len(events) for events in stored[name].values()) == sent, name
    inner, join_late = window_join(stored["orders"], stored["payments"], SIZE, LATENESS, "inner")
    left, _ = window_join(stored["orders"], stored["payments"], SIZE, LATENESS, "left")
    looked_up, table_late = table_join(stored["stream"], stored["table"], LATENESS, "left")
    counts, session_late = session_counts(stored["clicks"], GAP, LATENESS)

    # The input holds the cases worth testing, in both the stored and the live part.
    for late in (join_late, table_late, session_late):
        assert {e["id"][1] for e in late} == {"0", "1"}  # the phase: stored, live
    assert _unseen_route_lates(stored["orders"], join_late) > 0
    assert _unseen_route_lates(stored["payments"], join_late) > 0
    late_updates = [e for e in table_late if e["id"].startswith("t")]
    assert late_updates and _unseen_route_lates(stored["table"], late_updates) > 0
    for name, late in (("orders", join_late), ("stream", table_late), ("table", table_late)):
        assert _on_time_behind(stored[name], late, 0) > 0, f"no out-of-order {name}"
    # Clicks whose own [ts, ts + gap) their queue had closed, on time inside open sessions.
    assert _on_time_behind(stored["clicks"], session_late, LATENESS + GAP) > 0
    # ... and clicks late only because they touch a session that had closed.
    late_ids = {e["id"] for e in session_late}
    assert any(
        e["id"] in late_ids and e["ts"] + GAP > progress - LATENESS
        for _q, e, progress in with_progress(stored["clicks"])
        if progress is not None
    )
    assert any(n >= 3 for n in counts.values())
    assert any(p is None for _o, p in left) and any(t is None for _s, t in looked_up)
    times = [(e["key"], e["ts"]) for events in stored["table"].values() for e in events]
    assert len(set(times)) == len(times)

    expected_late = {
        "inner-late": join_late,
        "left-late": join_late,
        "table-late": table_late,
        "sessions-late": session_late,
    }

    def settled() -> bool:
        return (
            sum(_pairs(admin, topics["inner"], "o", "p").values()) >= len(inner)
            and sum(_pairs(admin, topics["left"], "o", "p").values()) >= len(left)
            and sum(_pairs(admin, topics["table-out"], "s", "t").values()) >= len(looked_up)
            and len(_sessions(admin, topics["sessions"])) >= len(counts)
            and all(
                len(_late_ids(admin, topics[t])) >= len(late)
                and _late_count(inst, topics[t]) >= len(late)
                for t, late in expected_late.items()
            )
        )

    _settle(settled, 120, "every result and late record")
    inst.await_caught_up(60)

    assert _pairs(admin, topics["inner"], "o", "p") == collections.Counter(inner)
    assert _pairs(admin, topics["left"], "o", "p") == collections.Counter(left)
    assert _pairs(admin, topics["table-out"], "s", "t") == collections.Counter(looked_up)
    sessions = _sessions(admin, topics["sessions"])
    got, want = collections.Counter(sessions), collections.Counter(counts.items())
    assert got == want, f"engine only: {sorted(got - want)}; reference only: {sorted(want - got)}"
    for name, late in expected_late.items():
        assert _late_ids(admin, topics[name]) == sorted(e["id"] for e in late), name
        assert _late_count(inst, topics[name]) == len(late), name
    report(
        f"{sum(len(s) for q in stored.values() for s in q.values())} records; "
        f"results: inner {len(inner)}, left {len(left)}, table {len(looked_up)}, "
        f"sessions {len(counts)}; late: joins {len(join_late)} "
        f"({_unseen_route_lates(stored['orders'], join_late)}"
        f"+{_unseen_route_lates(stored['payments'], join_late)} unseen routes), "
        f"table {len(table_late)} ({len(late_updates)} updates), "
        f"sessions {len(session_late)}"
    )
