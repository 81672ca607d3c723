"""No single record can stop a query: broker limits hit at send time are per record.

What a RocketMQ 5.3.3 broker refuses, and where the engine meets it:

- a message's properties (keys, tags, user properties) over 32767 bytes
  (MessageExtEncoder: PROPERTIES_SIZE_EXCEEDED for a single message, an
  exception for a batch): a result key, a sink ``key=`` or a late record's key
  of 40 000 characters used to fail the whole flush. Each key part is now
  shortened (``<first 479 bytes>~<32 hex of its SHA-256>``), so such a word is
  counted; properties the user's function makes too large or malformed are
  that record's dead letter;
- a body over maxMessageSize (``max_message_size``): a shuffle entry, a sink
  result, a late record, a changelog message, a dead letter's own body.

Every expected value here is computed from the input and the documented rule,
not by the engine's functions; every message the driver stored is re-planned
by the real batch producer, which raises for anything a broker would refuse.
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import wordcount
from stream_assets.operators.aggregates import Accumulator
from stream_assets.plan import nodes as n
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import BrokerRoute, TopicRoute
from stream_assets.rocketmq.batch_producer import (
    MAX_OWN_PROPERTIES_BYTES,
    BatchProducer,
    InvalidMessageError,
    OutgoingMessage,
    check_message,
)
from stream_assets.rocketmq.errors import MessageTooLargeError
from stream_assets.rocketmq.message_codec import MAX_PROPERTIES_BYTES
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.core.send_buffer import SendBuffer
from stream_assets.runtime.core.stage0.outputs import dead_letter, message_key
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.settings import DEFAULT_MAX_MESSAGE_SIZE, RocketMQSettings
from stream_assets.testing import InMemoryBroker, TopologyTestDriver
from stream_assets.windows import Time, TumblingWindow

SMALL = 64 * 1024  # a broker maxMessageSize small enough to reach in a unit test
VOCABULARY = ["the", "cat", "sat", "on", "a", "mat", "naïve", "new"]
#: Every (batch size, pre-combine) a result must not depend on.
BATCHINGS = [(None, True), (None, False), (1, True), (3, True), (7, False)]


class FakeAdmin:
    """Routes every topic to one queue of one broker; never connects."""

    def route(self, topic: str) -> TopicRoute:
        return TopicRoute(topic, {"broker-a": BrokerRoute("127.0.0.1:1", 1, 1)})

    def close(self) -> None:
        pass


def shortened(part: str) -> str:
    """The documented rule for an over-long ASCII key part with nothing to escape."""
    assert part.isascii() and part.isalnum() and len(part) > 512
    return part[:479] + "~" + hashlib.sha256(part.encode()).hexdigest()[:32]


def token(rnd: random.Random, length: int) -> str:
    return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))


def assert_a_broker_takes_everything(driver: TopologyTestDriver, limit: int) -> None:
    """Every message the driver stored, planned by the real batch producer (which raises
    for a key, tags, properties or body a broker would refuse)."""
    producer = BatchProducer(RocketMQSettings(max_message_size=limit), FakeAdmin())  # type: ignore[arg-type]
    for topic in driver.broker.topics.values():
        messages = [
            OutgoingMessage(
                topic.name,
                r.body,
                key=" ".join(r.keys) or None,
                tags=r.tags,
                properties=r.properties or None,
                queue_id=0,
            )
            for r in topic.log
        ]
        producer._plan(messages)


def current_counts(driver: TopologyTestDriver) -> tuple[dict[str, int], dict[str, str]]:
    """Per word, the count of its highest version (what docs/guarantees.md tells a consumer), and
    per word the result part of its message keys."""
    best: dict[str, tuple[int, dict[str, Any]]] = {}
    for record in driver.output_records():
        result, version, _position = record.keys[-1].rsplit("/", 2)
        number, body = int(version.removeprefix("v")), json.loads(record.body)
        if result not in best or number > best[result][0]:
            best[result] = (number, body)
    counts = {body["key"]: body["count"] for _, body in best.values()}
    parts = {body["key"]: result.split("/", 2)[2] for result, (_, body) in best.items()}
    return counts, parts


def sink_op(topology: Topology) -> str:
    (op,) = [node.op_id for node in topology.nodes if isinstance(node, n.Sink)]
    return op


def key_by_op(topology: Topology) -> str:
    (op,) = [node.op_id for node in topology.nodes if isinstance(node, n.KeyBy)]
    return op


def letters(driver: TopologyTestDriver) -> list[tuple[bytes, str, str]]:
    """Dead letters as (body, operator, reason), in a batching-independent order."""
    return sorted((b, p["operator"], p["reason"]) for b, p in driver.dead_letters())


# -- the key rule ----------------------------------------------------------------------


def test_a_key_part_up_to_512_bytes_is_kept_and_a_longer_one_is_prefix_tilde_digest() -> None:
    rnd = random.Random(1)
    at_limit, over = token(rnd, 512), token(rnd, 513)
    assert message_key("j", at_limit, "v1") == f"j/{at_limit}/v1"
    assert message_key("j", over, "v1") == f"j/{shortened(over)}/v1"
    word = token(rnd, 40_000)
    key = message_key("wc", "sink-4", word, "v9", "0")
    assert key == f"wc/sink-4/{shortened(word)}/v9/0"
    assert message_key("wc", "sink-4", word, "v9", "0") == key  # deterministic
    # Parts sharing their first 479 bytes still get different keys.
    assert message_key(word) != message_key(word[:-1] + ("a" if word[-1] != "a" else "b"))


def test_a_shortened_part_is_cut_at_a_character_and_outside_an_escape() -> None:
    spaced = "a" * 478 + " " * 100  # encoded: 478 "a", then "%20" x 100; byte 479 is "%"
    encoded = "a" * 478 + "%20" * 100
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:32]
    assert message_key(spaced) == "a" * 478 + "~" + digest
    spaced = "a" * 477 + " " * 100  # bytes 478-479 are "%2": the escape is dropped
    encoded = "a" * 477 + "%20" * 100
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:32]
    assert message_key(spaced) == "a" * 477 + "~" + digest
    accents = "é" * 300  # 2 bytes each: 239 whole characters fit in 479 bytes
    digest = hashlib.sha256(accents.encode()).hexdigest()[:32]
    assert message_key(accents) == "é" * 239 + "~" + digest
    assert len(message_key(accents).encode()) <= 512


def test_a_lone_surrogate_in_a_key_is_escaped_not_an_error() -> None:
    assert message_key("a\ud800b") == "a%ED%A0%80b"


# -- what a broker takes, checked per message --------------------------------------------


def test_the_property_budget_is_exact_and_the_producer_plans_what_the_check_passes() -> None:
    room = MAX_OWN_PROPERTIES_BYTES - len("KEYS\x01\x02")
    fits = OutgoingMessage("t", b"x", key="k" * room, queue_id=0)
    over = OutgoingMessage("t", b"x", key="k" * (room + 1), queue_id=0)
    producer = BatchProducer(RocketMQSettings(), FakeAdmin())  # type: ignore[arg-type]
    assert check_message(fits, DEFAULT_MAX_MESSAGE_SIZE) is fits
    (request,) = producer._plan([fits])[("t", 0)]
    # The entry (20-byte head, the 1-byte body, int16 length, properties): its
    # properties, UNIQ_KEY included, leave the broker its 512 bytes.
    entry = request.entries[0]
    assert int.from_bytes(entry[21:23], "big") == len(entry[23:]) == MAX_PROPERTIES_BYTES - 512
    for refused in (lambda: check_message(over, 10**6), lambda: producer._plan([over])):
        with pytest.raises(InvalidMessageError, match=f"take {room + 1 + 6} bytes"):
            refused()


@pytest.mark.parametrize(
    ("message", "words"),
    [
        (OutgoingMessage("t", b"x", key="a\x02b"), "key 'a\\x02b' must not contain"),
        (OutgoingMessage("t", b"x", tags="a\x01b"), "tags 'a\\x01b' must not contain"),
        (OutgoingMessage("t", b"x", properties={"a\x01": "v"}), "invalid message property name"),
        (OutgoingMessage("t", b"x", properties={"": "v"}), "invalid message property name"),
        (OutgoingMessage("t", b"x", properties={"p": "\udc80"}), "'\\udc80', which is not"),
    ],
)
def test_a_malformed_key_tag_or_property_is_refused_before_sending(
    message: OutgoingMessage, words: str
) -> None:
    with pytest.raises(InvalidMessageError) as info:
        check_message(message, 100)
    assert words in str(info.value)
    assert "message for topic 't'" in str(info.value)


def test_the_send_buffer_refuses_at_send_and_queues_nothing() -> None:
    broker = InMemoryBroker(max_message_size=100)
    broker.create_topic("t", 1)
    buffer = SendBuffer(broker)
    assert buffer.max_message_size == 100
    with pytest.raises(InvalidMessageError):
        buffer.send("t", b"x", key="k" * 40_000)
    with pytest.raises(MessageTooLargeError, match="over the limit of 100"):
        buffer.send("t", b"x" * 101)
    buffer.send("t", bytearray(b"ok"), key="k")  # type: ignore[arg-type]
    assert buffer.pending == 1
    [receipt] = buffer.flush()
    assert broker.topic("t").log[receipt.queue_offset].body == b"ok"


# -- WordCount with a 40 000-character word ------------------------------------------------


def _lines(rnd: random.Random, count: int) -> list[str]:
    return [
        " ".join(rnd.choice(VOCABULARY) for _ in range(rnd.randint(1, 6))) for _ in range(count)
    ]


@pytest.mark.parametrize(("batch", "combine"), BATCHINGS)
def test_a_40000_character_word_is_counted_under_a_shortened_key_and_the_rest_is_exact(
    batch: int | None, combine: bool
) -> None:
    rnd = random.Random(18)
    long_word = token(rnd, 40_000)
    lines = _lines(rnd, 200)
    lines[50] += f" {long_word}"
    lines[150] = f"{long_word} cat"  # a second update of the long word
    reference = collections.Counter(w for line in lines for w in line.lower().split())
    topology = wordcount.build("wc", "lines", "counts")
    with TopologyTestDriver(
        topology, source_queues=2, max_records_per_batch=batch, pre_combine=combine
    ) as driver:
        driver.pipe_many(lines)
        driver.advance()
        counts, parts = current_counts(driver)
        assert counts == dict(reference)
        assert counts[long_word] == 2
        assert parts[long_word] == shortened(long_word)
        assert {p for w, p in parts.items() if w != long_word} == set(reference) - {long_word}
        assert driver.dead_letters() == []
        assert driver.state(long_word) == {"count": 2}
        assert_a_broker_takes_everything(driver, DEFAULT_MAX_MESSAGE_SIZE)


def test_a_word_too_large_for_the_shuffle_is_one_dead_letter_whatever_the_batching() -> None:
    """Limit 64 KiB: the 40 000-byte word fits a line, but its shuffle entry (key and
    value, 80 000 bytes) fits no message. Its line is one dead letter of the key_by."""
    rnd = random.Random(19)
    long_word = token(rnd, 40_000)
    lines = _lines(rnd, 120)
    lines[60] = f"cat {long_word} mat"
    kept = lines[:60] + lines[61:]
    reference = collections.Counter(w for line in kept for w in line.lower().split())
    topology = wordcount.build("wc", "lines", "counts")
    seen = []
    for batch, combine in BATCHINGS:
        with TopologyTestDriver(
            topology,
            source_queues=2,
            max_records_per_batch=batch,
            pre_combine=combine,
            max_message_size=SMALL,
        ) as driver:
            driver.pipe_many(lines)
            driver.advance()
            assert current_counts(driver)[0] == dict(reference)
            [(body, operator, reason)] = letters(driver)
            assert body == lines[60].encode()
            assert operator == key_by_op(topology)
            assert reason.startswith("ShuffleEntryTooLargeError: the shuffle cannot carry")
            assert str(SMALL - 32) in reason
            assert_a_broker_takes_everything(driver, SMALL)
            seen.append(letters(driver))
    assert all(s == seen[0] for s in seen)


def test_a_result_over_the_size_limit_is_a_dead_letter_of_the_sink_and_the_state_counts_it() -> (
    None
):
    rnd = random.Random(20)
    long_word = token(rnd, 25_000)  # its line and shuffle entry fit 64 KiB; its result x3 not
    lines = _lines(rnd, 100)
    lines[40] += f" {long_word}"
    reference = collections.Counter(w for line in lines for w in line.lower().split())
    builder = StreamBuilder("echo")
    (
        builder.source("lines", text_deserializer)
        .flat_map(str.split)
        .key_by(lambda w: w)
        .count()
        .to_rstream()
        .map(lambda r: {**r, "echo": r["key"] * 3})
        .sink("counts")
    )
    topology = builder.build()
    for batch, combine in BATCHINGS:
        with TopologyTestDriver(
            topology, max_records_per_batch=batch, pre_combine=combine, max_message_size=SMALL
        ) as driver:
            driver.pipe_many(lines)
            driver.advance()
            counts, _ = current_counts(driver)
            assert counts == {w: c for w, c in reference.items() if w != long_word}
            [(body, operator, reason)] = letters(driver)
            assert json.loads(body) == {"key": long_word, "count": 1}
            assert operator == sink_op(topology)
            assert reason.startswith("MessageTooLargeError: ")
            assert driver.state(long_word) == {"count": 1}
            assert_a_broker_takes_everything(driver, SMALL)


# -- late records, sinks with keys and properties -------------------------------------------


def _late_topology() -> Topology:
    builder = StreamBuilder("late")
    (
        builder.source("events", json_deserializer)
        .key_by("k")
        .window(TumblingWindow.of(Time.seconds(10)))
        .count()
        .late_records_to("late")
        .to_rstream()
        .sink("out")
    )
    return builder.build()


def test_a_late_record_with_a_long_key_goes_out_under_a_shortened_key() -> None:
    long_key = token(random.Random(21), 40_000)
    with TopologyTestDriver(_late_topology(), source_queues=1, shuffle_queues=1) as driver:
        driver.pipe({"k": "a"}, event_time=100_000)
        driver.pipe({"k": long_key}, event_time=1_000)
        driver.advance()
        [late] = driver.output_records("late")
        assert late.keys == (f"late/late/0/1/0/10000/{shortened(long_key)}",)
        assert json.loads(late.body)["key"] == long_key
        assert driver.dead_letters() == []
        assert_a_broker_takes_everything(driver, DEFAULT_MAX_MESSAGE_SIZE)


def test_a_late_record_over_the_size_limit_is_a_dead_letter_of_the_aggregate() -> None:
    value = "é" * 20_000  # 40 000 bytes as UTF-8 in and through the shuffle, 120 000 as JSON
    topology = _late_topology()
    with TopologyTestDriver(
        topology, source_queues=1, shuffle_queues=1, max_message_size=SMALL
    ) as driver:
        driver.pipe({"k": "a"}, event_time=100_000)
        driver.pipe({"k": "b", "v": value}, event_time=1_000)
        driver.pipe({"k": "c"}, event_time=2_000)
        driver.advance()
        assert [json.loads(r.body)["key"] for r in driver.output_records("late")] == ["c"]
        [(body, props)] = driver.dead_letters()
        (aggregate,) = [x.op_id for x in topology.nodes if isinstance(x, n.Aggregate)]
        assert props["operator"] == aggregate
        assert props["reason"].startswith("MessageTooLargeError: ")
        shown = json.dumps({"key": "b", "value": {"k": "b", "v": value}, "window_end": 10_000})
        assert props["original_bytes"] == str(len(shown))
        assert body == shown.encode()[:SMALL]
        assert_a_broker_takes_everything(driver, SMALL)


def test_sink_keys_tags_and_properties_the_broker_would_refuse_fail_their_record_only() -> None:
    long_id = token(random.Random(22), 40_000)
    values: list[dict[str, Any]] = [
        {"id": "ok-1", "props": {"p": "v"}, "tag": "t"},
        {"id": long_id, "props": {}, "tag": "t"},  # shortened: sent
        {"id": "sep", "props": {"bad\x01name": "v"}, "tag": "t"},  # dead letter
        {"id": "empty", "props": {"": "v"}, "tag": "t"},  # dead letter
        {"id": "many", "props": {f"p{i}": "v" * 400 for i in range(100)}, "tag": "t"},  # dead
        {"id": "surrogate", "props": {"p": "\udc80"}, "tag": "\ud800"},  # cleaned: sent
        {"id": "ok-2", "props": {}, "tag": "t"},
    ]
    builder = StreamBuilder("props")
    builder.source("in", json_deserializer).sink(
        "out",
        lambda v: json.dumps(v).encode(),  # ASCII JSON: a lone surrogate travels escaped
        key="id",
        tags="tag",
        properties=lambda v: v["props"],
    )
    topology = builder.build()
    with TopologyTestDriver(topology, source_queues=1) as driver:
        for v in values:
            driver.pipe(json.dumps(v).encode())  # ASCII JSON: the surrogates travel escaped
        driver.advance()
        sent = driver.output_records("out")
        assert [json.loads(r.body)["id"] for r in sent] == [
            "ok-1",
            long_id,
            "surrogate",
            "ok-2",
        ]
        assert sent[1].keys[0] == shortened(long_id)
        assert sent[1].keys[1] == f"props/{sink_op(topology)}/in/0/1/0"
        assert (sent[2].tags, sent[2].properties) == ("\\ud800", {"p": "\\udc80"})
        dead = {json.loads(b)["id"]: p for b, p in driver.dead_letters()}
        assert sorted(dead) == ["empty", "many", "sep"]
        assert {p["operator"] for p in dead.values()} == {sink_op(topology)}
        assert all(p["reason"].startswith("InvalidMessageError: ") for p in dead.values())
        assert "take 4" in dead["many"]["reason"]  # 40 000 and some bytes
        assert_a_broker_takes_everything(driver, DEFAULT_MAX_MESSAGE_SIZE)


# -- dead letters and the changelog stay within the limits ---------------------------------


def _ctx(limit: int) -> StageContext:
    return StageContext.of(wordcount.build(), 0, shuffle_queues=1, max_message_size=limit)


def test_a_dead_letter_body_over_the_limit_is_cut_and_says_how_long_it_was() -> None:
    broker = InMemoryBroker(max_message_size=1024)
    ctx = _ctx(1024)
    broker.create_topic(ctx.dead_letter_topic, 1)
    stats = TaskStats()
    buffer = SendBuffer(broker)
    big = bytes(range(256)) * 20
    dead_letter(ctx, buffer, stats, Record("in", 0, 5, big), "map-1", ValueError("boom"))
    dead_letter(ctx, buffer, stats, Record("in", 0, 6, b""), "map-1", ValueError("boom"))
    buffer.flush()
    cut, empty = broker.topic(ctx.dead_letter_topic).log
    assert (cut.body, cut.properties["original_bytes"]) == (big[:1024], "5120")
    assert (empty.body, empty.properties["original_bytes"]) == (b"\x00", "0")
    assert cut.keys == ("in/0/5",) and stats.dead_letters == 2


def test_a_dead_letter_names_a_deserializer_error_whose_str_fails() -> None:
    class Odd(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    def deserialize(body: bytes) -> Any:
        raise Odd

    builder = StreamBuilder("odd")
    builder.source("in", deserialize).sink("out")
    with TopologyTestDriver(builder.build(), source_queues=1) as driver:
        driver.pipe({"a": 1})
        driver.advance()
        [(_body, props)] = driver.dead_letters()
        assert props["reason"] == "Odd: <Odd whose str() failed>"


def test_changelog_messages_stay_under_a_small_broker_limit_and_restore_exactly() -> None:
    rnd = random.Random(23)
    words = [token(rnd, 1_000) for _ in range(300)]  # one batch's delta: ~600 KB
    lines = [" ".join(words[i : i + 30]) for i in range(0, len(words), 30)]
    topology = wordcount.build("wc", "lines", "counts")
    with TopologyTestDriver(
        topology, source_queues=1, shuffle_queues=1, max_message_size=SMALL, snapshot_every=1
    ) as driver:
        driver.pipe_many(lines)
        driver.advance()
        state = driver.output_records(topology.state_topics[0])
        assert len(state) > 10 and max(len(r.body) for r in state) <= SMALL
        driver.restore_state()
        assert all(driver.state(w) == {"count": 1} for w in words)
        assert current_counts(driver)[0] == dict.fromkeys(words, 1)


class Peak(Accumulator):
    """The largest value; its result refuses 666 (a user's ``result`` that can fail)."""

    kind = "peak"

    def zero(self) -> Any:
        return None

    def add(self, acc: Any, value: Any) -> Any:
        return value["v"] if acc is None else max(acc, value["v"])

    def merge(self, a: Any, b: Any) -> Any:
        return b if a is None else a if b is None else max(a, b)

    def result(self, acc: Any) -> Any:
        if acc == 666:
            raise ValueError("the number of the beast")
        return acc


def test_an_accumulator_result_that_fails_for_one_key_is_one_dead_letter_of_the_aggregate() -> None:
    rnd = random.Random(24)
    events: list[dict[str, Any]] = [
        {"k": rnd.choice("abcde"), "v": rnd.randint(0, 500)} for _ in range(300)
    ]
    events.insert(123, {"k": "bad", "v": 666})
    reference: dict[str, int] = {}
    for e in events:
        key, value = e["k"], e["v"]
        reference[key] = max(reference.get(key, value), value)
    del reference["bad"]
    builder = StreamBuilder("peaks")
    builder.source("in", json_deserializer).key_by("k").aggregate(Peak()).to_rstream().sink("out")
    topology = builder.build()
    (aggregate,) = [x.op_id for x in topology.nodes if isinstance(x, n.Aggregate)]
    for batch, combine in BATCHINGS:
        with TopologyTestDriver(
            topology, max_records_per_batch=batch, pre_combine=combine
        ) as driver:
            driver.pipe_many(events)
            driver.advance()
            best: dict[str, tuple[int, int]] = {}
            for record in driver.output_records():
                body = json.loads(record.body)
                version = int(record.keys[-1].rsplit("/", 2)[1].removeprefix("v"))
                if body["key"] not in best or version > best[body["key"]][0]:
                    best[body["key"]] = (version, body["peak"])
            assert {k: v for k, (_, v) in best.items()} == reference
            assert letters(driver) == [
                (
                    b'{"key": "bad", "accumulator": [666]}',  # the aggregate's one part
                    aggregate,
                    "ValueError: the number of the beast",
                )
            ]
