"""Hour-late records at start and live, poison records, keys with spaces: real broker, real Spark.

- Lateness by the record's own origin: an event is late when an earlier event
  of its source queue, bound for the same shuffle queue, is more than the
  allowed lateness past the end of its window. The reference below computes
  that from the input alone (the source queue from the producer's key hash,
  the shuffle queue from the grouping key's), so silent source queues holding
  the watermark back, or a first batch without a watermark, change nothing.
- A value the shuffle cannot encode (an integer beyond 64 bits) is one dead
  letter; the topology goes on, and a restart is clean.
- Sink message keys stay one key whatever the result key holds.
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import windowed_sum
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.runtime.core.shuffle_codec import encode_key
from stream_assets.serde import json_deserializer
from stream_assets.settings import RocketMQSettings
from tests.integration._engine_util import (
    Message,
    current_results,
    final_counts,
    latest_by_message_key,
    produce,
    produce_per_queue,
    read_topic,
    totals_topology,
    unique,
    wait_until,
)
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

SOURCE_QUEUES = 4
SHUFFLE_QUEUES = 4  # the harness's engine setting
WINDOW_MS = 10_000
LATENESS_MS = 5_000
HOUR_MS = 3_600_000
BASE_TS = 1_700_000_000_000  # window-aligned
KEYS = [f"k{i}" for i in range(8)]


def _events(rnd: random.Random, count: int) -> list[tuple[str, dict[str, Any]]]:
    """(producer key, event) in production order; after a warm-up, one in 40 an hour late."""
    out = []
    for i in range(count):
        ts = BASE_TS + HOUR_MS + i * 20 - rnd.randint(0, 2_000)
        if i >= 400 and rnd.random() < 1 / 40:
            ts -= HOUR_MS
        event = {"key": rnd.choice(KEYS), "value": rnd.randint(1, 99), "ts": ts, "i": i}
        out.append((f"producer-{rnd.randint(0, 15)}", event))
    return out


def _reference(
    events: list[tuple[str, dict[str, Any]]],
) -> tuple[dict[tuple[str, int], int], list[dict[str, Any]]]:
    """On-time window sums and late events, by each origin's own progress."""
    sums: dict[tuple[str, int], int] = collections.defaultdict(int)
    late: list[dict[str, Any]] = []
    progress: dict[tuple[int, int], int] = {}  # (source queue, shuffle queue) -> max ts
    for producer_key, e in events:
        lane = (
            queue_for_key(producer_key, SOURCE_QUEUES),
            queue_for_key(encode_key(e["key"]), SHUFFLE_QUEUES),
        )
        start = e["ts"] - (e["ts"] - BASE_TS) % WINDOW_MS
        seen = progress.get(lane)
        if seen is not None and start + WINDOW_MS <= seen - LATENESS_MS:
            late.append(e)
        else:
            sums[(e["key"], start)] += e["value"]
        progress[lane] = e["ts"] if seen is None else max(seen, e["ts"])
    return dict(sums), late


@pytest.mark.parametrize("mode", ["pre-produced", "live"])
def test_hour_late_events_are_late_and_every_window_equals_the_reference(
    mode: str,
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    job = unique("it-late")
    source, sink, late_topic = f"{job}-src", f"{job}-out", f"{job}-late"
    admin.create_topic(source, SOURCE_QUEUES)
    events = _events(random.Random(71), 6_000)
    sums, late = _reference(events)
    hour_late = [e for _, e in events if e["ts"] < BASE_TS + HOUR_MS - WINDOW_MS]
    assert late == hour_late, "the data must make exactly the hour-late events late"
    # Keyed producers: a message's source queue is its producer key's hash,
    # unrelated to the grouping key; each queue is sent in order by one thread.
    per_queue: dict[int, list[bytes]] = collections.defaultdict(list)
    for producer_key, e in events:
        per_queue[queue_for_key(producer_key, SOURCE_QUEUES)].append(json.dumps(e).encode())
    topology = windowed_sum.build(
        job, source, sink, window_s=10, lateness_s=LATENESS_MS / 1000, idle_timeout_s=3
    )
    if mode == "pre-produced":
        produce_per_queue(client_settings, source, per_queue)
    inst = engine.start(engine.instance(topology, tmp_path / "state"))
    if mode == "live":
        produce_per_queue(client_settings, source, per_queue)
    inst.await_caught_up(300)
    wait_until(lambda: len(_windows(admin, sink)) >= len(sums), 120, "every window", poll_s=1.0)
    assert _windows(admin, sink) == sums
    assert inst.metrics[1].totals["late"] == len(late)
    diverted = sorted(json.loads(r.body)["value"]["i"] for r in read_topic(admin, late_topic))
    assert diverted == sorted(e["i"] for e in late)


def _windows(admin: RocketMQAdmin, sink: str) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for v in latest_by_message_key(read_topic(admin, sink)).values():
        window = (v["key"], v["window_start"])
        assert window not in out, f"window {window} emitted under two message keys"
        out[window] = v["sum"]
    return out


def test_an_integer_beyond_64_bits_is_one_dead_letter_and_a_restart_is_clean(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    job = unique("it-poison")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 2)
    rnd = random.Random(73)
    first = [{"word": rnd.choice("abcdef"), "n": rnd.randint(1, 9)} for _ in range(2_000)]
    then = [{"word": rnd.choice("abcdef"), "n": rnd.randint(1, 9)} for _ in range(1_000)]
    poison = {"word": "a", "n": 2**70}
    bodies = [json.dumps(e).encode() for e in first]
    bodies.insert(777, json.dumps(poison).encode())
    produce(client_settings, source, [Message(b, queue_id=i % 2) for i, b in enumerate(bodies)])
    topology = totals_topology(job, source, sink)
    inst = engine.start(engine.instance(topology, tmp_path / "state"))
    inst.await_caught_up(180)
    engine.stop(inst)
    # The restart resumes past the poison record: nothing is stuck, nothing redone.
    inst = engine.start(engine.instance(topology, tmp_path / "state"))
    produce(client_settings, source, [Message(json.dumps(e).encode()) for e in then])
    inst.await_caught_up(180)
    expected: collections.Counter[str] = collections.Counter()
    for e in first + then:
        expected[e["word"]] += e["n"]
    totals = final_counts(read_topic(admin, sink), field="total")
    assert totals == dict(expected)
    dead = read_topic(admin, topology.dead_letter_topic)
    assert [json.loads(r.body) for r in dead] == [poison]
    assert "1180591620717411303424" in dead[0].properties["reason"]
    assert dead[0].properties["operator"] == topology.stages[0].exits[0].key_by.op_id


def test_tuple_and_spaced_keys_deduplicate_on_the_message_key(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    job = unique("it-keys")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 2)
    cities = ["new york", "san  francisco", "são paulo", "tab\tcity", "x%20y"]
    rnd = random.Random(79)
    events = [{"city": rnd.choice(cities), "n": rnd.randint(0, 9)} for _ in range(3_000)]
    builder = StreamBuilder(job)
    (
        builder.source(source, json_deserializer)
        .key_by(lambda e: (e["city"], e["n"] % 2))
        .count()
        .to_rstream()
        .sink(sink)
    )
    produce(client_settings, source, [Message(json.dumps(e).encode()) for e in events])
    inst = engine.start(engine.instance(builder.build(), tmp_path / "state"))
    inst.await_caught_up(180)
    records = read_topic(admin, sink)
    assert all(len(r.keys) == 1 for r in records), [r.keys for r in records if len(r.keys) != 1]
    got = {tuple(v["key"]): v["count"] for v in current_results(records).values()}
    assert got == dict(collections.Counter((e["city"], e["n"] % 2) for e in events))
