"""Under CPU load, slow batches fire no window early: every window once, with the reference sum.

Four busy processes run beside the instance (``cpu_load``) and every record
costs some CPU in a map, so micro-batches take longer than the 1 s idle
timeout: a runtime that took a gap between batches for an idle source would
fire windows early and then again with the rest. Idleness is judged by the
source queues' end offsets and stage 0's commits instead. All input is stored
before the start (no producer can stall and make its queue idle for real),
each source queue in event-time order with jitter below the lateness, so no
event is late and the reference is simply the sum per (key, window).
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.serde import json_deserializer
from stream_assets.settings import RocketMQSettings
from stream_assets.windows import Time, TumblingWindow
from tests.integration._engine_util import produce_per_queue, read_topic, unique, wait_until
from tests.integration._load import busy_seconds, cpu_load  # noqa: F401
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

BASE_TS = 1_700_000_000_000  # window-aligned
WINDOW_MS = 10_000
QUEUES = 4
EVENTS_PER_QUEUE = 6_000
SPAN_MS = 240_000  # event time covered by each queue
KEYS = [f"k{i}" for i in range(8)]


IDLE_TIMEOUT_S = 1.0


def _work(rounds: int) -> int:
    return sum(i * i for i in range(rounds)) % 7


def burn(event: dict[str, Any]) -> dict[str, Any]:
    """Some CPU per record (about 0.1 ms), so batches are slow under load."""
    event["work"] = _work(3_000)
    return event


def burn_more(event: dict[str, Any]) -> dict[str, Any]:
    """About 2 ms of CPU per record: the join's batches hold few records (500 per
    queue), and each must still outlast the idle timeout beside the hogs, even with
    the session's Python workers already warm from earlier tests."""
    event["work"] = _work(50_000)
    return event


def _topology(job: str, source: str, sink: str) -> Topology:
    builder = StreamBuilder(job)
    (
        builder.source(source, json_deserializer)
        .map(burn)
        .select_timestamp("ts")
        .key_by("key")
        .window(TumblingWindow.of(Time.seconds(10)))
        .sum("value", "sum")
        .water_mark(5)
        .idle_timeout(IDLE_TIMEOUT_S)
        .to_rstream()
        .sink(sink)
    )
    return builder.build()


def _queue_events(rnd: random.Random) -> list[dict[str, Any]]:
    """One queue's events in event-time order, each pulled back by up to 2 s (< lateness)."""
    step = SPAN_MS // EVENTS_PER_QUEUE
    return [
        {
            "key": rnd.choice(KEYS),
            "value": rnd.randint(1, 100),
            "ts": max(BASE_TS, BASE_TS + i * step - rnd.randint(0, 2_000)),
        }
        for i in range(EVENTS_PER_QUEUE)
    ]


def _windows(admin: RocketMQAdmin, sink: str) -> tuple[dict[tuple[str, int], int], int]:
    """(key, window start) -> sum as emitted, and how many distinct results were emitted."""
    sums: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    seen_keys: set[str] = set()
    for r in read_topic(admin, sink):
        if r.keys[0] in seen_keys:
            continue  # an at-least-once copy of the same result (same message key)
        seen_keys.add(r.keys[0])
        v = json.loads(r.body)
        sums[(v["key"], v["window_start"])].append(v["sum"])
    for window, values in sums.items():
        assert len(values) == 1, f"window {window} emitted {len(values)} times: {values}"
    return {w: v[0] for w, v in sums.items()}, len(seen_keys)


def test_windowed_sum_under_cpu_load_emits_every_window_once(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    cpu_load: list[int],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = unique("it-load")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, QUEUES)
    rnd = random.Random(61)
    per_queue = {q: _queue_events(rnd) for q in range(QUEUES)}
    reference: dict[tuple[str, int], int] = collections.defaultdict(int)
    for events in per_queue.values():
        for e in events:
            reference[(e["key"], e["ts"] - (e["ts"] - BASE_TS) % WINDOW_MS)] += e["value"]
    bodies = {q: [json.dumps(e).encode() for e in evs] for q, evs in per_queue.items()}
    produce_per_queue(client_settings, source, bodies)
    # Many small batches, each slowed by the load and by burn().
    topology = _topology(job, source, sink)
    inst = engine.start(engine.instance(topology, tmp_path / "state", max_records_per_batch=2_000))
    inst.await_caught_up(600)
    wait_until(
        lambda: len(_windows(admin, sink)[0]) >= len(reference), 300, "every window", poll_s=1.0
    )
    emitted, results = _windows(admin, sink)
    assert emitted == dict(reference)
    assert results == len(reference)
    assert inst.metrics[1].totals["late"] == 0
    slowest = max(m.max_batch_s for m in inst.metrics.values())
    # The scenario really happened: some batch outlasted the idle timeout.
    assert slowest > IDLE_TIMEOUT_S, f"no batch was slower than the idle timeout ({slowest} s)"
    with capsys.disabled():
        print(
            f"\n[load] windowed sum, {QUEUES * EVENTS_PER_QUEUE} events beside 4 CPU hogs "
            f"({busy_seconds(cpu_load):.0f} CPU-s burnt): {len(reference)} windows exact, each "
            f"once; batches {inst.metrics[0].batches}/{inst.metrics[1].batches}, slowest "
            f"{slowest:.1f} s (idle timeout {IDLE_TIMEOUT_S} s)",
            flush=True,
        )


def test_stream_table_join_under_cpu_load_meets_the_table_as_of_each_order(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    cpu_load: list[int],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Orders wait for the watermark before they meet the customer table. A runtime that
    took a slow batch for idle sources would join orders before the table updates at or
    before their time were applied, and get the tier wrong."""
    job = unique("it-load-tj")
    orders_topic, customers_topic, sink = f"{job}-orders", f"{job}-customers", f"{job}-out"
    admin.create_topic(orders_topic, 2)
    admin.create_topic(customers_topic, 1)
    rnd = random.Random(67)
    customers = [f"c{i}" for i in range(6)]
    updates = [
        {
            "c": rnd.choice(customers),
            "tier": f"t{j}",
            "ts": BASE_TS + j * 1_000 + rnd.randint(0, 999),
        }
        for j in range(SPAN_MS // 1_000)
    ]
    orders = {
        q: [
            {
                "id": q * 100_000 + i,
                "c": rnd.choice(customers),
                "ts": max(BASE_TS, BASE_TS + i * (SPAN_MS // 2_000) - rnd.randint(0, 2_000)),
            }
            for i in range(2_000)
        ]
        for q in range(2)
    }

    def as_of(order: dict[str, Any]) -> str | None:
        known = [u for u in updates if u["c"] == order["c"] and u["ts"] <= order["ts"]]
        return max(known, key=lambda u: u["ts"])["tier"] if known else None

    reference = {o["id"]: as_of(o) for q in orders.values() for o in q}
    produce_per_queue(
        client_settings, customers_topic, {0: [json.dumps(u).encode() for u in updates]}
    )
    produce_per_queue(
        client_settings,
        orders_topic,
        {q: [json.dumps(o).encode() for o in evs] for q, evs in orders.items()},
    )
    builder = StreamBuilder(job)
    table = builder.table(customers_topic, json_deserializer, key="c", timestamp="ts")
    (
        builder.source(orders_topic, json_deserializer)
        .map(burn_more)
        .select_timestamp("ts")
        .join_table(table, key="c", joiner=lambda o, c: [o["id"], c and c["tier"]], left=True)
        .water_mark(5)
        .idle_timeout(IDLE_TIMEOUT_S)
        .to_rstream()
        .sink(sink)
    )
    inst = engine.start(
        engine.instance(builder.build(), tmp_path / "state", max_records_per_batch=500)
    )

    def joined() -> dict[int, str | None]:
        seen = {r.keys[-1]: json.loads(r.body) for r in read_topic(admin, sink)}
        return {order_id: tier for order_id, tier in seen.values()}

    wait_until(lambda: len(joined()) >= len(reference), 600, "every order joined", poll_s=1.0)
    inst.await_caught_up(300)
    assert joined() == reference
    assert inst.metrics[2].totals["late"] == 0
    slowest = max(m.max_batch_s for m in inst.metrics.values())
    assert slowest > IDLE_TIMEOUT_S, f"no batch was slower than the idle timeout ({slowest} s)"
    with capsys.disabled():
        print(
            f"\n[load] stream-table join, {len(reference)} orders and {len(updates)} table "
            f"updates beside 4 CPU hogs: every order met the table as of its time; slowest "
            f"batch {slowest:.1f} s (idle timeout {IDLE_TIMEOUT_S} s)",
            flush=True,
        )
