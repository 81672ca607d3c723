"""BatchProducer against the real broker: what it stores, where, in which order.

Everything expected is recomputed here from the message index (body, key,
tags, properties) and the queue of a key from an MD5 reference written in this
file. Read back with the project's QueueReader, every receipt must name the
exact (queue, offset, msg id) where its message is found.

Faults (a busy broker, a lost connection, a refused request) are injected by
wrapping ``RemotingConnection.call_many``: the chosen requests are answered
locally and never reach the broker, all others go to the real broker.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest

from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer, OutgoingMessage
from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    MessageTooLargeError,
    SendError,
    TopicNotFoundError,
)
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.message_codec import encode_message
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record, SendReceipt
from stream_assets.rocketmq.remoting import RemotingCommand, RemotingConnection, RequestCode
from stream_assets.settings import RocketMQSettings
from tests.integration._util import wait_for

pytestmark = pytest.mark.integration

QUEUES = 8
TOTAL = 5_000
SYSTEM_ERROR = 1
SYSTEM_BUSY = 2
MESSAGE_ILLEGAL = 13


def reference_queue(key: str, queue_count: int) -> int:
    """Independent reference: MD5 of the UTF-8 key, first 4 bytes big-endian, 31 bits, mod n."""
    digest = hashlib.md5(key.encode("utf-8")).digest()
    return (int.from_bytes(digest[:4], "big") & 0x7FFFFFFF) % queue_count


def body_for(i: int) -> bytes:
    """Index first (so a read body names its message), then zero bytes and 0xff."""
    return (
        f"{i}:".encode() + b"\x00" + bytes((i * 7 + j) % 256 for j in range(i % 50)) + b"\xff\x00"
    )


def index_of(body: bytes) -> int:
    return int(body.split(b":", 1)[0])


def message_for(topic: str, i: int) -> OutgoingMessage:
    """A mix: keyed, pinned to a queue, routed by another key, and unkeyed (round-robin)."""
    props = {"idx": str(i), "kind": "präfix-✓"}
    if i % 10 == 3:
        return OutgoingMessage(topic, body_for(i), tags="pinned", properties=props, queue_id=i % 8)
    if i % 10 == 5:
        return OutgoingMessage(topic, body_for(i), properties=props)
    if i % 10 == 7:
        return OutgoingMessage(
            topic, body_for(i), key=f"u-{i}", properties=props, route_key=f"k{i % 37}"
        )
    return OutgoingMessage(topic, body_for(i), key=f"k{i % 37}", tags=f"t{i % 3}", properties=props)


def new_topic(admin: RocketMQAdmin, prefix: str, queues: int = QUEUES) -> str:
    topic = f"it-{prefix}-{uuid.uuid4().hex}"
    admin.create_topic(topic, queues=queues)
    return topic


def read_topic(admin: RocketMQAdmin, topic: str, expected: int) -> dict[int, list[Record]]:
    """Every record of every queue, once the broker shows ``expected`` messages in all."""
    queues = admin.queues(topic)

    def stored() -> bool:
        return sum(admin.max_offset(q) for q in queues) >= expected

    # The broker answers a send before its consume queue is written; poll for it.
    wait_for(stored, 30.0, f"{expected} messages to be indexed in {topic}")
    reader = QueueReader(admin, group=f"it-batch-reader-{uuid.uuid4().hex[:8]}")
    try:
        return {q.queue_id: list(reader.read(q, 0)) for q in queues}
    finally:
        reader.close()


class CallSpy:
    """Wraps ``RemotingConnection.call_many``: records every call and injects faults."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[dict[str, str]]] = []
        self.busy_once: set[int] = set()  # queue ids whose next request is answered SYSTEM_BUSY
        self.refuse: set[int] = set()  # queue ids whose requests are answered MESSAGE_ILLEGAL
        self.unreachable_calls: set[int] = set()  # call numbers that fail before sending
        self._lock = threading.Lock()
        original = RemotingConnection.call_many
        spy = self

        def call_many(
            conn: RemotingConnection,
            requests: list[tuple[int, dict[str, str], bytes]],
            timeout_s: float | None = None,
        ) -> list[RemotingCommand]:
            with spy._lock:
                number = len(spy.calls)
                spy.calls.append([dict(fields) for _, fields, _ in requests])
                if number in spy.unreachable_calls:
                    raise BrokerUnreachableError("broker", conn.addr, "injected connection loss")
                local: dict[int, RemotingCommand] = {}
                for i, (_, fields, _) in enumerate(requests):
                    queue = int(fields["e"])
                    if queue in spy.refuse:
                        local[i] = RemotingCommand(MESSAGE_ILLEGAL, 0, 1, "injected: illegal")
                    elif queue in spy.busy_once:
                        spy.busy_once.discard(queue)
                        local[i] = RemotingCommand(SYSTEM_BUSY, 0, 1, "injected: busy")
            sent = [i for i in range(len(requests)) if i not in local]
            replies = original(conn, [requests[i] for i in sent], timeout_s) if sent else []
            out = dict(local) | dict(zip(sent, replies, strict=True))
            return [out[i] for i in range(len(requests))]

        monkeypatch.setattr(RemotingConnection, "call_many", call_many)

    def requests_per_queue(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for call in self.calls:
            for fields in call:
                counts[int(fields["e"])] = counts.get(int(fields["e"]), 0) + 1
        return counts


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> CallSpy:
    return CallSpy(monkeypatch)


@pytest.fixture
def producer(client_settings: RocketMQSettings, admin: RocketMQAdmin) -> Iterator[BatchProducer]:
    with BatchProducer(client_settings, admin) as p:
        yield p


def check_stored_as_receipted(
    read: dict[int, list[Record]], receipts: list[SendReceipt], total: int
) -> dict[int, Record]:
    """Each message stored exactly once, where its receipt says; returns index -> record."""
    found: dict[int, Record] = {}
    for qid, records in read.items():
        for r in records:
            i = index_of(r.body)
            assert i not in found, f"message {i} stored twice"
            found[i] = r
            receipt = receipts[i]
            assert (receipt.queue_id, receipt.queue_offset, receipt.msg_id) == (
                qid,
                r.queue_offset,
                r.msg_id,
            ), f"message {i}"
    assert sorted(found) == list(range(total))
    return found


def check_input_order_per_queue(read: dict[int, list[Record]]) -> None:
    for qid, records in read.items():
        indexes = [index_of(r.body) for r in records]
        assert indexes == sorted(indexes), f"queue {qid} is out of input order"
        assert [r.queue_offset for r in records] == list(range(len(records)))


def test_round_trip_receipts_order_keys_and_properties(
    producer: BatchProducer, admin: RocketMQAdmin, spy: CallSpy
) -> None:
    topic = new_topic(admin, "batch")
    messages = [message_for(topic, i) for i in range(TOTAL)]
    receipts = producer.send_all(messages)
    assert len(receipts) == TOTAL
    assert all(r.topic == topic for r in receipts)
    assert len({r.msg_id for r in receipts}) == TOTAL

    read = read_topic(admin, topic, TOTAL)
    found = check_stored_as_receipted(read, receipts, TOTAL)
    check_input_order_per_queue(read)
    assert all(read[q] for q in range(QUEUES)), "every queue is used"

    for i, m in enumerate(messages):
        r = found[i]
        assert r.body == m.body
        assert r.tags == m.tags
        assert r.properties["idx"] == str(i)
        assert r.properties["kind"] == "präfix-✓"
        assert r.keys == ((m.key,) if m.key is not None else ())
        if m.queue_id is not None:
            assert r.queue_id == m.queue_id
        elif m.route_key is not None:
            assert r.queue_id == reference_queue(m.route_key, QUEUES)
        elif m.key is not None:
            assert r.queue_id == reference_queue(m.key, QUEUES) == queue_for_key(m.key, QUEUES)
    # Batched: far fewer requests than messages, each queue's requests in waves.
    assert 0 < sum(len(call) for call in spy.calls) < TOTAL / 100
    assert all(len({f["e"] for f in call}) == len(call) for call in spy.calls), (
        "at most one request per queue in flight"
    )


def test_small_max_request_bytes_gives_several_requests_per_queue(
    client_settings: RocketMQSettings, admin: RocketMQAdmin, spy: CallSpy
) -> None:
    topic = new_topic(admin, "batch-small", queues=2)
    messages = [OutgoingMessage(topic, body_for(i), queue_id=i % 2) for i in range(400)]
    with BatchProducer(client_settings, admin, max_request_bytes=2_000) as producer:
        receipts = producer.send_all(messages)
    per_queue = spy.requests_per_queue()
    assert per_queue[0] >= 5 and per_queue[1] >= 5, per_queue
    read = read_topic(admin, topic, len(messages))
    check_stored_as_receipted(read, receipts, len(messages))
    check_input_order_per_queue(read)


def test_transient_failures_are_retried_without_reordering(
    client_settings: RocketMQSettings, admin: RocketMQAdmin, spy: CallSpy
) -> None:
    topic = new_topic(admin, "batch-retry", queues=4)
    messages = [OutgoingMessage(topic, body_for(i), queue_id=i % 4) for i in range(800)]
    spy.busy_once = {1, 2}  # first requests of queues 1 and 2: SYSTEM_BUSY
    spy.unreachable_calls = {3}  # a later wave loses its connection before sending
    with BatchProducer(client_settings, admin, max_request_bytes=4_000) as producer:
        receipts = producer.send_all(messages)
    assert not spy.busy_once, "the injected faults were hit"
    assert len(spy.calls) > 4
    read = read_topic(admin, topic, len(messages))
    check_stored_as_receipted(read, receipts, len(messages))
    check_input_order_per_queue(read)


def test_permanent_refusal_raises_send_error_naming_the_queue(
    client_settings: RocketMQSettings, admin: RocketMQAdmin, spy: CallSpy
) -> None:
    topic = new_topic(admin, "batch-refused", queues=2)
    spy.refuse = {1}
    with (
        BatchProducer(client_settings, admin) as producer,
        pytest.raises(SendError) as err,
    ):
        producer.send_all([OutgoingMessage(topic, b"x", queue_id=q) for q in (0, 1)])
    text = str(err.value)
    assert topic in text and "queue 1" in text
    assert "code 13" in text and "MESSAGE_ILLEGAL" in text and "injected: illegal" in text
    assert len(spy.calls) == 1, "a refused request is not retried"


def test_retries_exhausted_raise_send_error(
    client_settings: RocketMQSettings, admin: RocketMQAdmin, spy: CallSpy
) -> None:
    topic = new_topic(admin, "batch-exhausted", queues=1)
    settings = client_settings.model_copy(update={"send_retries": 2})
    spy.unreachable_calls = {0, 1, 2, 3}
    with BatchProducer(settings, admin) as producer, pytest.raises(SendError, match="3 attempts"):
        producer.send_all([OutgoingMessage(topic, b"x")])
    assert len(spy.calls) == 3


def test_oversize_message_is_refused_before_anything_is_sent(
    client_settings: RocketMQSettings, admin: RocketMQAdmin, spy: CallSpy
) -> None:
    topic = new_topic(admin, "batch-big", queues=1)
    small = client_settings.model_copy(update={"max_message_size": 10})
    with BatchProducer(small, admin) as producer, pytest.raises(MessageTooLargeError) as err:
        producer.send_all([OutgoingMessage(topic, b"a"), OutgoingMessage(topic, b"b" * 11)])
    assert (err.value.size, err.value.limit) == (11, 10)
    assert spy.calls == []
    assert admin.max_offset(admin.queues(topic)[0]) == 0


# -- message size: the broker's maxMessageSize is the one limit --------------------------


def big_body(i: int, size: int) -> bytes:
    """``size`` bytes naming message ``i`` (for index_of), then every byte value in turn."""
    head = f"{i}:".encode()
    filler = bytes(range(256)) * (size // 256 + 1)
    return head + filler[: size - len(head)]


def test_body_just_under_the_brokers_limit_is_stored_byte_identical(
    producer: BatchProducer, admin: RocketMQAdmin, spy: CallSpy
) -> None:
    # 4 190 000 bytes: the broker takes it; the producer used to refuse it
    # against its own request cap (4 177 920), not the 4 194 304 of the setting.
    assert producer.settings.max_message_size == 4_194_304
    topic = new_topic(admin, "batch-near-limit", queues=1)
    body = big_body(0, 4_190_000)
    (receipt,) = producer.send_all([OutgoingMessage(topic, body, key="near", tags="big")])
    ((record,),) = read_topic(admin, topic, 1).values()
    assert record.body == body
    assert (record.queue_offset, record.msg_id) == (receipt.queue_offset, receipt.msg_id)
    assert (record.keys, record.tags) == (("near",), "big")
    ((fields,),) = spy.calls
    assert fields["m"] == "true"  # a batch (of one) is within the broker's batch limit


def test_body_of_exactly_the_brokers_limit_is_stored_byte_identical(
    producer: BatchProducer, admin: RocketMQAdmin, spy: CallSpy
) -> None:
    limit = producer.settings.max_message_size
    topic = new_topic(admin, "batch-at-limit", queues=1)
    body = big_body(0, limit)
    (receipt,) = producer.send_all(
        [OutgoingMessage(topic, body, key="exact", properties={"p": "ä✓"})]
    )
    ((record,),) = read_topic(admin, topic, 1).values()
    assert len(record.body) == limit and record.body == body
    assert (record.queue_offset, record.msg_id) == (receipt.queue_offset, receipt.msg_id)
    assert record.keys == ("exact",) and record.properties["p"] == "ä✓"
    ((fields,),) = spy.calls
    # Its batch entry would be over maxMessageSize: it went as a single message.
    assert fields["m"] == "false"


def test_one_byte_over_the_limit_is_refused_before_sending_naming_the_setting(
    producer: BatchProducer, admin: RocketMQAdmin, spy: CallSpy
) -> None:
    topic = new_topic(admin, "batch-over-limit", queues=1)
    with pytest.raises(MessageTooLargeError) as err:
        producer.send_all(
            [OutgoingMessage(topic, b"fine"), OutgoingMessage(topic, big_body(1, 4_194_305))]
        )
    text = str(err.value)
    assert (err.value.size, err.value.limit) == (4_194_305, 4_194_304)
    assert "4194305-byte body" in text and "4194304 bytes" in text
    assert "STREAM_ASSETS_ROCKETMQ_MAX_MESSAGE_SIZE" in text
    assert spy.calls == []
    assert admin.max_offset(admin.queues(topic)[0]) == 0


@pytest.mark.parametrize("request_cap", [None, 64 * 1024], ids=["default-cap", "64KiB-cap"])
def test_large_and_small_messages_keep_each_queues_order(
    client_settings: RocketMQSettings, admin: RocketMQAdmin, spy: CallSpy, request_cap: int | None
) -> None:
    limit = client_settings.max_message_size
    topic = new_topic(admin, "batch-mixed-sizes", queues=2)
    sizes = {3: 4_190_000, 8: limit, 9: 1_500_000, 14: limit, 15: 3_000_000, 20: 4_100_000}
    messages = [
        OutgoingMessage(
            topic,
            big_body(i, sizes[i]) if i in sizes else body_for(i),
            key=f"k{i}",
            queue_id=(i // 2) % 2,
        )
        for i in range(30)
    ]
    # With a small request cap, every large message is over it: none is refused.
    with BatchProducer(client_settings, admin, max_request_bytes=request_cap) as producer:
        receipts = producer.send_all(messages)
    read = read_topic(admin, topic, len(messages))
    found = check_stored_as_receipted(read, receipts, len(messages))
    check_input_order_per_queue(read)
    for i, m in enumerate(messages):
        assert found[i].body == m.body and found[i].queue_id == m.queue_id
    singles = [f for call in spy.calls for f in call if f["m"] == "false"]
    assert len(singles) == 2  # the two bodies of exactly the limit
    assert all(len({f["e"] for f in call}) == len(call) for call in spy.calls)


def test_what_the_broker_itself_enforces(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    """The broker (5.3.3, MessageExtEncoder): a batch's whole body <= maxMessageSize;
    a single message's body <= maxMessageSize. Neither over-limit request is stored."""
    limit = client_settings.max_message_size
    topic = new_topic(admin, "batch-broker-limits", queues=1)
    (queue,) = admin.queues(topic)
    common = {
        "a": "it-limits",
        "b": topic,
        "c": "TBW102",
        "d": "4",
        "e": "0",
        "f": "0",
        "g": "0",
        "h": "0",
        "j": "0",
        "k": "false",
        "n": queue.broker_name,
    }
    entry = encode_message(b"x" * limit)  # body at the limit: the entry is 22 bytes over
    conn = RemotingConnection(admin.broker_addr(queue), timeout_s=30.0)
    try:
        batch = conn.call(RequestCode.SEND_BATCH_MESSAGE, common | {"m": "true"}, entry)
        single = conn.call(
            RequestCode.SEND_MESSAGE_V2, common | {"m": "false", "i": ""}, b"x" * (limit + 1)
        )
        stored = conn.call(
            RequestCode.SEND_MESSAGE_V2, common | {"m": "false", "i": ""}, b"x" * limit
        )
    finally:
        conn.close()
    assert batch.code == SYSTEM_ERROR and "message body size exceeded" in (batch.remark or "")
    assert single.code == MESSAGE_ILLEGAL and f"limit {limit}B" in (single.remark or "")
    assert stored.code == 0 and stored.ext_fields["queueOffset"] == "0"
    wait_for(lambda: admin.max_offset(queue) == 1, 10.0, "the stored message to be indexed")
    assert admin.max_offset(queue) == 1


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (lambda t: OutgoingMessage(t, b""), ValueError),
        (lambda t: OutgoingMessage(t, "text"), TypeError),  # type: ignore[arg-type]
        (lambda t: OutgoingMessage(t, b"x", queue_id=5), ValueError),
        (lambda t: OutgoingMessage(t, b"x", properties={"a": "b\x02c"}), ValueError),
        (lambda t: OutgoingMessage(t, b"x", key="a\x01b"), ValueError),
    ],
)
def test_invalid_messages_send_nothing(
    producer: BatchProducer,
    admin: RocketMQAdmin,
    spy: CallSpy,
    bad: Callable[[str], OutgoingMessage],
    error: type[Exception],
) -> None:
    topic = new_topic(admin, "batch-invalid", queues=1)
    with pytest.raises(error):
        producer.send_all([OutgoingMessage(topic, b"fine"), bad(topic)])
    assert spy.calls == []


def test_missing_topic_gives_a_clear_error(producer: BatchProducer, spy: CallSpy) -> None:
    topic = f"it-batch-missing-{uuid.uuid4().hex}"
    with pytest.raises(TopicNotFoundError, match=topic):
        producer.send_all([OutgoingMessage(topic, b"x")])
    assert spy.calls == []


def test_empty_send_sends_nothing(producer: BatchProducer, spy: CallSpy) -> None:
    assert producer.send_all([]) == []
    assert spy.calls == []


def test_concurrent_callers_share_one_producer(
    producer: BatchProducer, admin: RocketMQAdmin
) -> None:
    topic = new_topic(admin, "batch-threads", queues=4)
    per_thread = 500
    results: dict[int, list[SendReceipt]] = {}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            # Each thread owns one queue, so each queue's order is its thread's.
            results[t] = producer.send_all(
                [
                    OutgoingMessage(topic, body_for(t * per_thread + i), queue_id=t)
                    for i in range(per_thread)
                ]
            )
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    receipts = [r for t in range(4) for r in results[t]]
    read = read_topic(admin, topic, len(receipts))
    check_stored_as_receipted(read, receipts, len(receipts))
    check_input_order_per_queue(read)


def test_unstarted_producer_refuses(client_settings: RocketMQSettings) -> None:
    producer = BatchProducer(client_settings)
    try:
        with pytest.raises(Exception, match="not started"):
            producer.send_all([OutgoingMessage("any", b"x")])
    finally:
        producer.close()


def test_queue_index_is_the_brokers_queue_id(producer: BatchProducer, admin: RocketMQAdmin) -> None:
    # One broker here: the queue index is the broker's queue id.
    topic = new_topic(admin, "batch-route", queues=3)
    route = producer.route(topic)
    assert route.write_queue_count == 3
    receipts = producer.send_all([OutgoingMessage(topic, b"x", queue_id=q) for q in range(3)])
    broker = next(iter(route.brokers))
    assert [(r.queue_id, r.queue_offset) for r in receipts] == [(0, 0), (1, 0), (2, 0)]
    assert [MessageQueue(topic, broker, r.queue_id) for r in receipts] == route.read_queues
