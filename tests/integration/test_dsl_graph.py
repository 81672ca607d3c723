"""DSL breadth on Spark against the real broker: joins, union, branch, two key_by stages,
metadata, sink keys and dead letters, each equal to a reference computed from the input.

Every source here has one queue, so "which events are late" is a function of
the input (see test_engine.py), and all input is stored before the instance
starts or after it has caught up: synchronisation is by broker offsets and the
sink's contents, never by sleeping.
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.records import Record
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.settings import RocketMQSettings
from stream_assets.windows import Time, TumblingWindow
from tests.integration._engine_util import Message, produce, read_topic, unique, wait_until
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

BASE_TS = 1_700_000_000_000
WINDOW_MS = 10_000


def _json(value: Any) -> Message:
    return Message(json.dumps(value).encode())


def _deduplicated(records: list[Record]) -> list[Any]:
    """Sink values once each: the engine's de-duplication key is a message's last key."""
    seen: dict[str, Any] = {}
    for r in records:
        seen[r.keys[-1]] = json.loads(r.body)
    return list(seen.values())


def _events(rnd: random.Random, side: str, count: int, keys: list[str]) -> list[dict[str, Any]]:
    """Events 400 ms apart, some pulled back by up to 3 s (less than the lateness)."""
    out = []
    for i in range(count):
        ts = BASE_TS + i * 400 - (rnd.randint(0, 3_000) if rnd.random() < 0.3 else 0)
        out.append({"k": rnd.choice(keys), "side": side, "i": i, "ts": ts})
    return out


def _window(ts: int) -> int:
    return ts - (ts - BASE_TS) % WINDOW_MS


def _join_reference(
    lefts: list[dict[str, Any]], rights: list[dict[str, Any]], kind: str
) -> collections.Counter[tuple[Any, ...]]:
    by_window: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
    for r in rights:
        by_window[(r["k"], _window(r["ts"]))].append(r["i"])
    out: collections.Counter[tuple[Any, ...]] = collections.Counter()
    for left in lefts:
        matches = by_window.get((left["k"], _window(left["ts"])), [])
        for i in matches:
            out[(left["k"], left["i"], i)] += 1
        if not matches and kind == "left":
            out[(left["k"], left["i"], None)] += 1
    return out


def _pair(left: dict[str, Any], right: dict[str, Any] | None) -> dict[str, Any]:
    return {"k": left["k"], "l": left["i"], "r": None if right is None else right["i"]}


def test_windowed_inner_and_left_join_of_two_topics(
    engine: EngineHarness, admin: RocketMQAdmin, client_settings: RocketMQSettings, tmp_path: Path
) -> None:
    job = unique("it-join")
    left_topic, right_topic = f"{job}-l", f"{job}-r"
    inner_out, left_out, late_topic = f"{job}-inner", f"{job}-left", f"{job}-late"
    for topic in (left_topic, right_topic):
        admin.create_topic(topic, 1)
    rnd = random.Random(11)
    keys = [f"k{i}" for i in range(6)]
    lefts, rights = _events(rnd, "l", 150, keys), _events(rnd, "r", 120, keys)
    b = StreamBuilder(job)
    left = b.source(left_topic, json_deserializer).select_timestamp("ts")
    right = b.source(right_topic, json_deserializer).select_timestamp("ts")
    window = TumblingWindow.of(Time.seconds(WINDOW_MS // 1000))
    # Both handles used twice: two joins, each with its own shuffle and state.
    (
        left.join(right)
        .where("k")
        .equal_to("k")
        .window(window)
        .water_mark(5)
        .idle_timeout(3)
        .late_records_to(late_topic)
        .apply(_pair)
        .sink(inner_out)
    )
    (
        left.left_join(right)
        .where("k")
        .equal_to("k")
        .window(window)
        .water_mark(5)
        .idle_timeout(3)
        .apply(_pair)
        .sink(left_out)
    )
    topology = b.build()
    assert len(topology.stages) == 4
    produce(client_settings, left_topic, [_json(e) for e in lefts])
    produce(client_settings, right_topic, [_json(e) for e in rights])
    inner_ref = _join_reference(lefts, rights, "inner")
    left_ref = _join_reference(lefts, rights, "left")
    inst = engine.start(engine.instance(topology, tmp_path / "state"))

    def got(topic: str) -> collections.Counter[tuple[Any, ...]]:
        values = _deduplicated(read_topic(admin, topic))
        return collections.Counter((v["k"], v["l"], v["r"]) for v in values)

    wait_until(lambda: sum(got(left_out).values()) >= sum(left_ref.values()), 120, "left join")
    wait_until(lambda: sum(got(inner_out).values()) >= sum(inner_ref.values()), 60, "inner join")
    inst.await_caught_up(60)
    assert got(inner_out) == inner_ref
    assert got(left_out) == left_ref

    # Late on either side: every window has fired (idle), so these are dropped and diverted.
    late = [
        {"k": keys[0], "side": "l", "i": 1000, "ts": BASE_TS + 1},
        {"k": keys[1], "side": "r", "i": 1001, "ts": BASE_TS + 2},
    ]
    produce(client_settings, left_topic, [_json(late[0])])
    produce(client_settings, right_topic, [_json(late[1])])
    wait_until(lambda: len(read_topic(admin, late_topic)) >= 2, 60, "the late records")
    inst.await_caught_up(60)
    diverted = {json.loads(r.body)["value"][1]["i"] for r in read_topic(admin, late_topic)}
    assert diverted == {1000, 1001}
    assert got(inner_out) == inner_ref
    assert got(left_out) == left_ref


def test_stream_table_join_sees_the_table_as_of_each_record(
    engine: EngineHarness, admin: RocketMQAdmin, client_settings: RocketMQSettings, tmp_path: Path
) -> None:
    job = unique("it-tjoin")
    orders_topic, customers_topic, out = f"{job}-orders", f"{job}-customers", f"{job}-out"
    for topic in (orders_topic, customers_topic):
        admin.create_topic(topic, 1)
    rnd = random.Random(5)
    customers = [f"c{i}" for i in range(5)]
    orders = [{"id": i, "c": rnd.choice(customers), "ts": BASE_TS + i * 1_000} for i in range(60)]
    # Table updates spread over the same time; produced in shuffled order, so many
    # arrive after the orders they apply to (but within the 60 s lateness).
    updates = [
        {"c": rnd.choice(customers), "tier": f"t{j}", "ts": BASE_TS + rnd.randint(0, 60_000)}
        for j in range(25)
    ]
    produce_order = updates[:]
    rnd.shuffle(produce_order)
    b = StreamBuilder(job)
    table = b.table(customers_topic, json_deserializer, key="c", timestamp="ts")
    (
        b.source(orders_topic, json_deserializer)
        .select_timestamp("ts")
        .join_table(table, key="c", joiner=lambda o, c: [o["id"], c and c["tier"]], left=True)
        .water_mark(60)
        .idle_timeout(3)
        .to_rstream()
        .sink(out)
    )
    topology = b.build()
    produce(client_settings, orders_topic, [_json(o) for o in orders[:30]])
    produce(client_settings, customers_topic, [_json(u) for u in produce_order])
    produce(client_settings, orders_topic, [_json(o) for o in orders[30:]])

    def as_of(order: dict[str, Any]) -> str | None:
        versions = sorted(
            (u["ts"], u["tier"]) for u in updates if u["c"] == order["c"] and u["ts"] <= order["ts"]
        )
        return versions[-1][1] if versions else None

    reference = {o["id"]: as_of(o) for o in orders}
    inst = engine.start(engine.instance(topology, tmp_path / "state"))
    wait_until(
        lambda: len(_deduplicated(read_topic(admin, out))) >= len(orders), 120, "every order"
    )
    inst.await_caught_up(60)
    got = _deduplicated(read_topic(admin, out))
    assert len(got) == len(orders)
    assert {order_id: tier for order_id, tier in got} == reference


def test_union_branch_and_a_second_key_by_stage(
    engine: EngineHarness, admin: RocketMQAdmin, client_settings: RocketMQSettings, tmp_path: Path
) -> None:
    job = unique("it-graph")
    a_topic, b_topic = f"{job}-a", f"{job}-b"
    short_out, mid_out, long_out, hist_out = (f"{job}-{n}" for n in ("short", "mid", "long", "h"))
    for topic in (a_topic, b_topic):
        admin.create_topic(topic, 1)
    rnd = random.Random(3)
    vocab = [f"w{'x' * (i % 7)}{i}" for i in range(40)]
    a_lines = [" ".join(rnd.choices(vocab, k=6)) for _ in range(120)]
    b_lines = [" ".join(rnd.choices(vocab, k=6)) for _ in range(80)]
    b = StreamBuilder(job)
    words = (
        b.source(a_topic, text_deserializer)
        .union(b.source(b_topic, text_deserializer))
        .flat_map(str.split)
    )
    short, mid, rest = words.branch(lambda w: len(w) <= 3, lambda w: len(w) <= 6, default=True)
    short.sink(short_out)
    mid.sink(mid_out)
    rest.sink(long_out)
    # Stage 1 counts each word; stage 2 counts how many words have each count.
    (
        words.key_by(lambda w: w)
        .window(TumblingWindow.of(Time.seconds(3600)))
        .count()
        .idle_timeout(3)
        .to_rstream()
        .key_by(lambda r: r["count"])
        .count("words")
        .to_rstream()
        .sink(hist_out)
    )
    topology = b.build()
    assert [s.upstreams for s in topology.stages] == [(), (), (0, 1), (2,)]
    produce(client_settings, a_topic, [Message(line.encode()) for line in a_lines])
    produce(client_settings, b_topic, [Message(line.encode()) for line in b_lines])
    all_words = [w for line in a_lines + b_lines for w in line.split()]
    counts = collections.Counter(all_words)
    histogram = collections.Counter(counts.values())
    inst = engine.start(engine.instance(topology, tmp_path / "state"))

    def hist() -> dict[int, int]:
        return {v["key"]: v["words"] for v in _latest(read_topic(admin, hist_out))}

    wait_until(lambda: hist() == dict(histogram), 120, "the count-of-counts histogram")
    inst.await_caught_up(60)
    assert hist() == dict(histogram)
    branches = {
        t: collections.Counter(_deduplicated(read_topic(admin, t)))
        for t in (short_out, mid_out, long_out)
    }
    assert branches[short_out] == collections.Counter(w for w in all_words if len(w) <= 3)
    assert branches[mid_out] == collections.Counter(w for w in all_words if 3 < len(w) <= 6)
    assert branches[long_out] == collections.Counter(w for w in all_words if len(w) > 6)


def _latest(records: list[Record]) -> list[dict[str, Any]]:
    """Unwindowed results: the last update of each key (one key, one queue, offset order)."""
    last: dict[str, dict[str, Any]] = {}
    for r in records:
        value = json.loads(r.body)
        last[json.dumps(value["key"])] = value
    return list(last.values())


def test_metadata_sink_keys_and_unencodable_values(
    engine: EngineHarness, admin: RocketMQAdmin, client_settings: RocketMQSettings, tmp_path: Path
) -> None:
    job = unique("it-meta")
    source, tagged_out, counts_out = f"{job}-in", f"{job}-tagged", f"{job}-counts"
    admin.create_topic(source, 1)
    items = [{"n": i, "k": f"k{i % 4}", "bad": i % 10 == 0} for i in range(50)]
    with Producer(client_settings) as producer:
        for item in items:
            producer.send(
                source,
                json.dumps(item).encode(),
                key=f"order-{item['n']}",
                tags=f"tag{item['n'] % 3}",
                properties={"origin": "test"},
            )
    b = StreamBuilder(job)
    stream = b.source(source, json_deserializer)
    (
        stream.map(
            lambda v, m: {
                **v,
                "tag": m.tags,
                "mkey": m.key,
                "origin": m.properties["origin"],
                "queue": m.queue_id,
                "offset": m.offset,
                "born": m.born_timestamp,
            },
            metadata=True,
        ).sink(
            tagged_out,
            key=lambda v: v["mkey"],
            tags=lambda v: v["tag"].upper(),
            properties=lambda v: {"n": v["n"]},
        )
    )
    # A set cannot cross the shuffle: those records are dead letters, the rest count.
    (
        stream.map(lambda v: {**v, "payload": {1, 2}} if v["bad"] else v)
        .key_by("k")
        .count()
        .to_rstream()
        .sink(counts_out)
    )
    topology = b.build()
    inst = engine.start(engine.instance(topology, tmp_path / "state"))
    good = collections.Counter(i["k"] for i in items if not i["bad"])
    wait_until(
        lambda: (
            {v["key"]: v["count"] for v in _latest(read_topic(admin, counts_out))} == dict(good)
        ),
        90,
        "the counts of encodable records",
    )
    inst.await_caught_up(60)
    tagged = read_topic(admin, tagged_out)
    by_n = {json.loads(r.body)["n"]: r for r in tagged}
    assert sorted(by_n) == [i["n"] for i in items]
    for n, record in by_n.items():
        body = json.loads(record.body)
        assert body["tag"] == f"tag{n % 3}" and body["origin"] == "test" and body["queue"] == 0
        assert body["mkey"] == f"order-{n}" and body["born"] > 0 and body["offset"] == n
        assert record.keys[0] == f"order-{n}" and len(record.keys) == 2
        assert record.tags == f"TAG{n % 3}" and record.properties["n"] == str(n)
    letters = read_topic(admin, topology.dead_letter_topic)
    bad = sorted(i["n"] for i in items if i["bad"])
    assert sorted(json.loads(r.body)["n"] for r in letters) == bad
    for letter in letters:
        assert letter.properties["operator"] == topology.stages[0].exits[0].key_by.op_id
        assert "set" in letter.properties["reason"]
