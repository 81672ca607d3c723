"""How BatchProducer cuts messages into requests by size, without a broker.

What a RocketMQ 5.3.3 broker enforces (MessageExtEncoder): a batch request's
whole body <= maxMessageSize; a single message's body <= maxMessageSize. The
producer's one limit is ``settings.max_message_size`` (that maxMessageSize):
every body up to it is planned for sending, alone in a request if need be.
"""

from __future__ import annotations

import pytest

from stream_assets.rocketmq.admin import BrokerRoute, TopicRoute
from stream_assets.rocketmq.batch_producer import (
    MAX_REQUEST_BYTES_CAP,
    BatchProducer,
    OutgoingMessage,
    _Request,
)
from stream_assets.rocketmq.errors import BrokerUnreachableError, MessageTooLargeError, SendError
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.rocketmq.message_codec import decode_properties
from stream_assets.rocketmq.remoting import RemotingCommand, RequestCode
from stream_assets.settings import DEFAULT_MAX_MESSAGE_SIZE, RocketMQSettings

MIB4 = 4 * 1024 * 1024


class FakeAdmin:
    """Routes every topic to two queues of one broker; never connects."""

    def route(self, topic: str) -> TopicRoute:
        return TopicRoute(topic, {"broker-a": BrokerRoute("127.0.0.1:1", 2, 2)})

    def close(self) -> None:
        pass


def producer(max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE, **kw: int) -> BatchProducer:
    settings = RocketMQSettings(max_message_size=max_message_size)
    return BatchProducer(settings, FakeAdmin(), **kw)  # type: ignore[arg-type]


def requests_of(
    p: BatchProducer, messages: list[OutgoingMessage], queue: int = 0
) -> list[_Request]:
    return list(p._plan(messages)[("t", queue)])


def test_default_request_cap_is_the_limit_itself() -> None:
    assert DEFAULT_MAX_MESSAGE_SIZE == MAX_REQUEST_BYTES_CAP == MIB4
    assert producer().max_request_bytes == MIB4
    assert producer(1024).max_request_bytes == 1024
    assert producer(16 * MIB4).max_request_bytes == MAX_REQUEST_BYTES_CAP


def test_a_body_near_the_limit_goes_in_a_batch_within_the_limit_in_queue_order() -> None:
    p = producer()
    big = bytes(range(256)) * (4_190_000 // 256) + b"\x01" * (4_190_000 % 256)
    assert len(big) == 4_190_000
    small = b"s" * 2_000
    msgs = [OutgoingMessage("t", small, queue_id=0)] * 3
    msgs += [OutgoingMessage("t", big, key="k", queue_id=0)]
    msgs += [OutgoingMessage("t", small, queue_id=0)] * 3
    requests = requests_of(p, msgs)
    assert [i for r in requests for i in r.positions] == list(range(7))
    assert len(requests) == 3 and all(r.size <= DEFAULT_MAX_MESSAGE_SIZE for r in requests)
    (with_big,) = [r for r in requests if 3 in r.positions]
    assert with_big.single is None  # its entry is within the broker's whole-batch limit
    code, fields, body = p._frame(with_big, "0")
    assert code == RequestCode.SEND_BATCH_MESSAGE and fields["m"] == "true"
    assert len(body) == with_big.size
    assert big in body


def test_a_body_of_exactly_the_limit_goes_as_a_single_message() -> None:
    p = producer()
    body = b"\xff" * DEFAULT_MAX_MESSAGE_SIZE
    msgs = [
        OutgoingMessage("t", b"a", queue_id=1),
        OutgoingMessage("t", body, key="k", tags="x", properties={"p": "v"}, queue_id=1),
        OutgoingMessage("t", b"b", queue_id=1),
    ]
    first, alone, last = requests_of(p, msgs, queue=1)
    assert alone.single is not None and alone.positions == [1]
    assert alone.size > DEFAULT_MAX_MESSAGE_SIZE  # too large for any batch
    code, fields, sent = p._frame(alone, "0")
    assert code == RequestCode.SEND_MESSAGE_V2
    assert sent == body and fields["m"] == "false" and fields["e"] == "1"
    props = decode_properties(fields["i"])
    assert props == {"p": "v", "KEYS": "k", "TAGS": "x", "UNIQ_KEY": alone.msg_ids[0]}
    assert first.single is None and last.single is None


def test_one_byte_over_the_limit_is_refused_naming_the_limit_and_its_setting() -> None:
    p = producer()
    with pytest.raises(MessageTooLargeError) as raised:
        p._plan([OutgoingMessage("t", b"a"), OutgoingMessage("t", b"\x00" * (MIB4 + 1))])
    text = str(raised.value)
    assert (raised.value.size, raised.value.limit) == (MIB4 + 1, MIB4)
    assert "4194305-byte body" in text and "4194304 bytes" in text
    assert "STREAM_ASSETS_ROCKETMQ_MAX_MESSAGE_SIZE" in text
    assert "4177920" not in text


def test_a_small_request_cap_never_refuses_a_message_within_the_limit() -> None:
    p = producer(max_request_bytes=1_000)
    msgs = [OutgoingMessage("t", b"x" * n, queue_id=0) for n in (10, 1_000, 5_000, 10)]
    requests = requests_of(p, msgs)
    assert [r.positions for r in requests] == [[0], [1], [2], [3]]
    assert all(r.single is None for r in requests)


def test_a_custom_limit_is_the_one_enforced() -> None:
    p = producer(1_024)
    exact, near = b"e" * 1_024, b"n" * 900
    requests = requests_of(p, [OutgoingMessage("t", exact, queue_id=0)])
    assert requests[0].single is not None  # entry over 1 024 bytes: single message
    requests = requests_of(p, [OutgoingMessage("t", near, queue_id=0)])
    assert requests[0].single is None and requests[0].size <= 1_024
    with pytest.raises(MessageTooLargeError, match="1025-byte body, over the limit of 1024"):
        p._plan([OutgoingMessage("t", exact + b"!")])


def test_a_request_cap_over_the_limit_is_held_to_the_limit() -> None:
    p = producer(1_024, max_request_bytes=10_000)
    requests = requests_of(p, [OutgoingMessage("t", b"m" * 300, queue_id=0)] * 10)
    assert all(r.size <= 1_024 for r in requests) and len(requests) == 5


class MovingAdmin:
    """broker-a's master moves (a slave promoted under a controller); broker-b stays."""

    def __init__(self) -> None:
        self.master = "127.0.0.1:1"

    def route(self, topic: str) -> TopicRoute:
        group = "broker-b" if topic == "elsewhere" else "broker-a"
        addr = "127.0.0.1:9" if group == "broker-b" else self.master
        return TopicRoute(topic, {group: BrokerRoute(addr, 2, 2)})

    def close(self) -> None:
        pass


def test_requests_to_a_dead_master_go_to_the_promoted_one_for_the_same_queue() -> None:
    admin = MovingAdmin()
    p = BatchProducer(RocketMQSettings(), admin)  # type: ignore[arg-type]
    (request,) = p._plan([OutgoingMessage("t", b"x", queue_id=1)])[("t", 1)]
    p._plan([OutgoingMessage("u", b"x"), OutgoingMessage("elsewhere", b"x")])
    assert request.slot.addr == "127.0.0.1:1"
    admin.master = "127.0.0.1:2"
    p._forget_routes({"127.0.0.1:1"})
    # Every route through the dead address is forgotten, the others kept.
    assert sorted(p._routes) == ["elsewhere"]
    p._repoint([request])
    assert (request.slot.broker_name, request.slot.addr, request.slot.queue_id) == (
        "broker-a",
        "127.0.0.1:2",
        1,
    )


class TwoGroups:
    """broker-a and broker-b, two queues each; broker-b's master may be gone."""

    def __init__(self) -> None:
        self.b_master = "127.0.0.1:2"

    def route(self, topic: str) -> TopicRoute:
        brokers = {"broker-a": BrokerRoute("127.0.0.1:1", 2, 2)}
        brokers["broker-b"] = BrokerRoute(self.b_master, 2, 2)
        return TopicRoute(topic, brokers)

    def close(self) -> None:
        pass


class FakeBrokers:
    """A connection pool whose brokers store every request, except those at ``dead``."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.stored: list[tuple[str, str, int, int]] = []  # (addr, topic, queue, count)

    def get(self, addr: str, role: str) -> FakeBrokers._Conn:
        return FakeBrokers._Conn(self, addr, role)

    class _Conn:
        def __init__(self, brokers: FakeBrokers, addr: str, role: str) -> None:
            self.brokers, self.addr, self.role = brokers, addr, role

        def call_many(
            self, requests: list[tuple[int, dict[str, str], bytes]], timeout_s: float
        ) -> list[RemotingCommand]:
            if self.addr in self.brokers.dead:
                raise BrokerUnreachableError(self.role, self.addr, "connection refused")
            replies = []
            for _code, fields, body in requests:
                count = _entries(body)
                self.brokers.stored.append((self.addr, fields["b"], int(fields["e"]), count))
                replies.append(
                    RemotingCommand(0, 0, ext_fields={"queueOffset": "0", "queueId": fields["e"]})
                )
            return replies


def _entries(body: bytes) -> int:
    """How many batch entries ``body`` holds (each starts with its total size)."""
    count = at = 0
    while at < len(body):
        at += int.from_bytes(body[at : at + 4], "big")
        count += 1
    return count


def reachable_producer(admin: TwoGroups, brokers: FakeBrokers) -> BatchProducer:
    p = BatchProducer(RocketMQSettings(send_retries=1), admin)  # type: ignore[arg-type]
    p._pool = brokers  # type: ignore[assignment]
    return p


def test_send_reachable_holds_a_dead_groups_queues_in_order_and_stores_the_rest() -> None:
    admin, brokers = TwoGroups(), FakeBrokers()
    p = reachable_producer(admin, brokers)
    p.pin(
        [
            TopicLayout(
                "shuffle", (("broker-a", 0), ("broker-a", 1), ("broker-b", 0), ("broker-b", 1))
            )
        ]
    )
    brokers.dead.add("127.0.0.1:2")
    # Queue 2 (broker-b) gets more than one request: the first fails, so none goes.
    p.max_request_messages = 2
    messages = [OutgoingMessage("shuffle", f"m{i}".encode(), queue_id=i % 4) for i in range(12)]
    receipts, unsent = p.send_reachable(messages)
    assert sorted(unsent) == [i for i in range(12) if i % 4 >= 2]
    assert set(unsent.values()) == {"broker-b"}
    assert [r is None for r in receipts] == [i % 4 >= 2 for i in range(12)]
    assert {(a, q) for a, _, q, _ in brokers.stored} == {("127.0.0.1:1", 0), ("127.0.0.1:1", 1)}
    assert sum(n for *_, n in brokers.stored) == 6
    # A group named in skip is not even tried: nothing reaches it though it is alive.
    brokers.dead.clear()
    brokers.stored.clear()
    _, unsent = p.send_reachable(messages, skip={"broker-b"})
    assert sorted(unsent) == [i for i in range(12) if i % 4 >= 2]
    assert {a for a, *_ in brokers.stored} == {"127.0.0.1:1"}
    # send_all still fails rather than hold.
    brokers.dead.add("127.0.0.1:2")
    with pytest.raises(SendError, match="broker-b"):
        p.send_all(messages)


def test_a_sink_message_for_a_group_without_a_master_goes_to_a_group_that_has_one() -> None:
    admin, brokers = TwoGroups(), FakeBrokers()
    p = reachable_producer(admin, brokers)
    p._route("sink")  # cached while broker-b still has its master
    brokers.dead.add("127.0.0.1:2")
    admin.b_master = ""  # gone from the route: no master now
    messages = [OutgoingMessage("sink", f"r{i}".encode(), key=f"k{i}") for i in range(40)]
    receipts, unsent = p.send_reachable(messages)
    assert unsent == {} and all(r is not None for r in receipts)
    assert {a for a, *_ in brokers.stored} == {"127.0.0.1:1"}
    assert sum(n for *_, n in brokers.stored) == 40
