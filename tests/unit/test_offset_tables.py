"""Batched offset calls without a broker: the fastjson parser for maps keyed by objects,
and the admin's pipelined requests against a scripted fake broker.

The bodies below were captured from a RocketMQ 5.3.3 broker (GET_TOPIC_STATS_INFO and
GET_CONSUME_STATS answers), topic and group names included; frames for the fake
broker are built with ``struct`` and ``json`` following the documented layout.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin, _offset_table
from stream_assets.rocketmq.errors import RemotingError, RocketMQError
from stream_assets.rocketmq.remoting import parse_fastjson, parse_fastjson_keyed
from stream_assets.settings import RocketMQSettings

# -- captured bodies -----------------------------------------------------------

#: GET_TOPIC_STATS_INFO of a 3-queue topic, 5 messages in queue 1.
STATS_3Q = (
    b'{"offsetTable":{{"brokerName":"broker-a","queueId":0,"topic":"it-cap%x-y_z-6922f4"}:'
    b'{"lastUpdateTimestamp":0,"maxOffset":0,"minOffset":0},{"brokerName":"broker-a",'
    b'"queueId":1,"topic":"it-cap%x-y_z-6922f4"}:{"lastUpdateTimestamp":1795360144787,'
    b'"maxOffset":5,"minOffset":0},{"brokerName":"broker-a","queueId":2,"topic":'
    b'"it-cap%x-y_z-6922f4"}:{"lastUpdateTimestamp":0,"maxOffset":0,"minOffset":0}},'
    b'"topicPutTps":0.5}'
)

#: GET_TOPIC_STATS_INFO of a retry-style topic name with '%', '_', '|' and '-'.
STATS_RETRY = (
    b'{"offsetTable":{{"brokerName":"broker-a","queueId":0,"topic":"%RETRY%it-cap_f366|x-1"}'
    b':{"lastUpdateTimestamp":1795360216106,"maxOffset":3,"minOffset":0},{"brokerName":'
    b'"broker-a","queueId":1,"topic":"%RETRY%it-cap_f366|x-1"}:{"lastUpdateTimestamp":0,'
    b'"maxOffset":0,"minOffset":0}},"topicPutTps":0.0}'
)

#: GET_CONSUME_STATS of group %DLQ%it-g_f366-y on that topic, queue 0 committed at 2.
CONSUME_STATS = (
    b'{"consumeTps":0.0,"offsetTable":{{"brokerName":"broker-a","queueId":0,"topic":'
    b'"%RETRY%it-cap_f366|x-1"}:{"brokerOffset":3,"consumerOffset":2,"lastTimestamp":'
    b'1795360216103,"pullOffset":2},{"brokerName":"broker-a","queueId":1,"topic":'
    b'"%RETRY%it-cap_f366|x-1"}:{"brokerOffset":0,"consumerOffset":0,"lastTimestamp":0,'
    b'"pullOffset":0}}}'
)

#: GET_CONSUME_STATS for a topic the broker does not have.
CONSUME_STATS_EMPTY = b'{"consumeTps":0.0,"offsetTable":{}}'


def _mq(topic: str, queue_id: int) -> str:
    return json.dumps(
        {"brokerName": "broker-a", "queueId": queue_id, "topic": topic},
        sort_keys=True,
        separators=(",", ":"),
    )


# -- parse_fastjson_keyed ---------------------------------------------------------


def test_topic_stats_body_parses_with_object_keys_as_json_text() -> None:
    topic = "it-cap%x-y_z-6922f4"
    assert parse_fastjson_keyed(STATS_3Q) == {
        "offsetTable": {
            _mq(topic, 0): {"lastUpdateTimestamp": 0, "maxOffset": 0, "minOffset": 0},
            _mq(topic, 1): {"lastUpdateTimestamp": 1795360144787, "maxOffset": 5, "minOffset": 0},
            _mq(topic, 2): {"lastUpdateTimestamp": 0, "maxOffset": 0, "minOffset": 0},
        },
        "topicPutTps": 0.5,
    }


def test_consume_stats_body_parses_and_keys_load_back() -> None:
    data = parse_fastjson_keyed(CONSUME_STATS)
    assert isinstance(data, dict)
    assert data["consumeTps"] == 0.0
    keys = [json.loads(k) for k in data["offsetTable"]]
    assert keys == [
        {"brokerName": "broker-a", "queueId": q, "topic": "%RETRY%it-cap_f366|x-1"} for q in (0, 1)
    ]
    assert [v["consumerOffset"] for v in data["offsetTable"].values()] == [2, 0]
    assert parse_fastjson_keyed(CONSUME_STATS_EMPTY) == {"consumeTps": 0.0, "offsetTable": {}}


def test_integer_keyed_bodies_parse_as_parse_fastjson_does() -> None:
    route = (
        b'{"brokerDatas":[{"brokerAddrs":{0:"127.0.0.1:20911",1:"127.0.0.1:20921"},'
        b'"brokerName":"broker-a","cluster":"DefaultCluster"}],"filterServerTable":{},'
        b'"queueDatas":[{"brokerName":"broker-a","perm":6,"readQueueNums":4,"topicSysFlag":0,'
        b'"writeQueueNums":4}]}'
    )
    assert parse_fastjson_keyed(route) == parse_fastjson(route)
    assert parse_fastjson_keyed(b'{ -1:"minus",\n\t0: "zero"}') == {"-1": "minus", "0": "zero"}


def test_strings_that_look_like_keys_escapes_and_unicode_are_untouched() -> None:
    doc = {
        "k": ['{0:"x"}', ",1:y", '{"a":1}:{"b":2}', 'escaped \\" quote }:{', "é—✓"],
        "m": {"{5:": "}6:", "": None, "t": [True, False, -1.5e3]},
    }
    for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False, indent=2)):
        assert parse_fastjson_keyed(text.encode("utf-8")) == doc


def test_keys_holding_quotes_braces_and_nested_objects() -> None:
    body = (
        b'{{"topic":"a\\"}:{b","queueId":7}:1, {"q":{"n":[1,{"x":null}]}} : {"v":[]},'
        b' [1,2]:"list key", true:false, "plain":{}}'
    )
    assert parse_fastjson_keyed(body) == {
        '{"queueId":7,"topic":"a\\"}:{b"}': 1,
        '{"q":{"n":[1,{"x":null}]}}': {"v": []},
        "[1,2]": "list key",
        "true": False,
        "plain": {},
    }


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b'{"offsetTable":{{"queueId":0}:{"maxOffset":1}}',  # unclosed
        b'{{"queueId":0} {"maxOffset":1}}',  # no colon
        b'{"a":1 "b":2}',  # no comma
        b'{"a":1}}',  # trailing data
        b"[1,2",
        b'{"a":nope}',
    ],
)
def test_malformed_bodies_raise_value_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_fastjson_keyed(body)


def test_offset_table_keeps_the_asked_topic_by_queue_id() -> None:
    table = _offset_table(STATS_RETRY, "%RETRY%it-cap_f366|x-1")
    assert {q: (e["minOffset"], e["maxOffset"]) for q, e in table.items()} == {
        0: (0, 3),
        1: (0, 0),
    }
    assert _offset_table(STATS_RETRY, "another-topic") == {}
    assert _offset_table(b'{"offsetTable":{},"topicPutTps":0.0}', "t") == {}
    with pytest.raises(ValueError, match="not a message queue"):
        _offset_table(b'{"offsetTable":{0:{"maxOffset":1}}}', "t")


# -- the admin against a scripted fake broker ---------------------------------------


def _frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack(">ii", 4 + len(head) + len(body), len(head)) + head + body


def _read_frame(conn: socket.socket) -> tuple[dict[str, Any], bytes]:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("client closed")
            buf += chunk
        return buf

    (length,) = struct.unpack(">i", exact(4))
    frame = exact(length)
    (mark,) = struct.unpack(">i", frame[:4])
    head_len = mark & 0xFFFFFF
    return json.loads(frame[4 : 4 + head_len]), frame[4 + head_len :]


Answer = tuple[int, dict[str, str], bytes]


class FakeBroker:
    """Name server and broker on one port: a route for any topic, other codes scripted.

    ``answer(code, ext_fields)`` gives (response code, ext fields, body). With
    ``hold`` set to (predicate, n), requests the predicate picks are answered only
    once n of them have arrived, in reverse order: a client that waits for each
    reply before sending the next never gets one.
    """

    def __init__(self, answer: Callable[[int, dict[str, str]], Answer], queues: int = 3) -> None:
        self.answer = answer
        self.queues = queues
        self.hold: tuple[Callable[[int, dict[str, str]], bool], int] | None = None
        self.received: list[tuple[int, dict[str, str]]] = []
        self.accepted = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.addr = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        held: list[tuple[dict[str, Any], bytes]] = []
        with contextlib.suppress(OSError):
            while True:
                header, _ = _read_frame(conn)
                code, fields = int(header["code"]), dict(header.get("extFields") or {})
                self.received.append((code, fields))
                if self.hold is not None and self.hold[0](code, fields):
                    held.append((header, b""))
                    if len(held) < self.hold[1]:
                        continue
                    replies, held = list(reversed(held)), []
                else:
                    replies = [(header, b"")]
                for request, _ in replies:
                    conn.sendall(self._reply(request))

    def _reply(self, request: dict[str, Any]) -> bytes:
        code, fields = int(request["code"]), dict(request.get("extFields") or {})
        if code == 105:  # GET_ROUTEINFO_BY_TOPIC
            # fastjson's integer key, as a real name server writes it.
            route = (
                f'{{"brokerDatas":[{{"brokerAddrs":{{0:"{self.addr}"}},"brokerName":"broker-a",'
                f'"cluster":"c"}}],"queueDatas":[{{"brokerName":"broker-a","perm":6,'
                f'"readQueueNums":{self.queues},"topicSysFlag":0,'
                f'"writeQueueNums":{self.queues}}}]}}'
            )
            rcode, ext, body = 0, dict[str, str](), route.encode()
        else:
            rcode, ext, body = self.answer(code, fields)
        head = {"code": rcode, "opaque": request["opaque"], "flag": 1, "extFields": ext}
        return _frame(head, body)

    def drop_connections(self) -> None:
        """Close every accepted connection, as a broker does with idle channels."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._conns.clear()

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()
        self.drop_connections()

    def codes(self) -> list[int]:
        return [code for code, _ in self.received if code != 105]


@pytest.fixture
def fake() -> Iterator[Callable[..., tuple[FakeBroker, RocketMQAdmin]]]:
    made: list[tuple[FakeBroker, RocketMQAdmin]] = []

    def start(
        answer: Callable[[int, dict[str, str]], Answer], queues: int = 3
    ) -> tuple[FakeBroker, RocketMQAdmin]:
        broker = FakeBroker(answer, queues)
        admin = RocketMQAdmin(RocketMQSettings(namesrv_addr=broker.addr, request_timeout_s=2))
        made.append((broker, admin))
        return broker, admin

    yield start
    for broker, admin in made:
        admin.close()
        broker.stop()


def _queue_offsets(committed: dict[int, int]) -> Callable[[int, dict[str, str]], Answer]:
    def answer(code: int, fields: dict[str, str]) -> Answer:
        assert code == 14, code  # QUERY_CONSUMER_OFFSET
        assert fields["setZeroIfNotFound"] == "false"
        qid = int(fields["queueId"])
        if qid in committed:
            return 0, {"offset": str(committed[qid])}, b""
        return 22, {}, b""  # QUERY_NOT_FOUND

    return answer


def test_group_offsets_pipelines_one_request_per_queue_and_maps_not_found_to_none(
    fake: Any,
) -> None:
    broker, admin = fake(_queue_offsets({0: 7, 2: 0}), queues=4)
    queues = admin.queues("t")
    broker.hold = (lambda code, _: code == 14, 4)  # answered once all four are in
    assert admin.group_offsets("g", "t") == {
        queues[0]: 7,
        queues[1]: None,
        queues[2]: 0,
        queues[3]: None,
    }
    assert [f["queueId"] for c, f in broker.received if c == 14] == ["0", "1", "2", "3"]
    assert {f["consumerGroup"] for c, f in broker.received if c == 14} == {"g"}
    # A subset, in the caller's order, repeats dropped; the single-queue call agrees.
    broker.hold = None
    subset = [queues[3], queues[0], queues[3]]
    got = admin.group_offsets("g", "t", subset)
    assert list(got.items()) == [(queues[3], None), (queues[0], 7)]
    assert admin.query_consumer_offset("g", queues[2]) == 0
    assert admin.group_offsets("g", "t", []) == {}


def test_group_offsets_rejects_queues_of_another_topic(fake: Any) -> None:
    _, admin = fake(_queue_offsets({}))
    with pytest.raises(ValueError, match="not queues of topic 't'"):
        admin.group_offsets("g", "t", [MessageQueue("u", "broker-a", 0)])


def test_topic_offsets_is_one_request_and_names_a_missing_queue(fake: Any) -> None:
    topic = "it-cap%x-y_z-6922f4"

    def answer(code: int, fields: dict[str, str]) -> Answer:
        assert code == 202 and fields == {"topic": topic}
        return 0, {}, STATS_3Q

    broker, admin = fake(answer, queues=3)
    offsets = admin.topic_offsets(topic)
    assert [(q.queue_id, o.min_offset, o.max_offset) for q, o in offsets.items()] == [
        (0, 0, 0),
        (1, 0, 5),
        (2, 0, 0),
    ]
    assert all(o.queue is q for q, o in offsets.items())
    assert broker.codes() == [202]
    assert admin.queue_offsets(topic) == list(offsets.values())
    with pytest.raises(RocketMQError, match=r"reported no offsets for .*\[5\]"):
        admin.topic_offsets(topic, [MessageQueue(topic, "broker-a", 5)])


def test_topic_offsets_error_code_raises_remoting_error(fake: Any) -> None:
    _, admin = fake(lambda code, fields: (17, {}, b""))
    with pytest.raises(RemotingError, match="offsets of topic 't' on broker broker-a"):
        admin.topic_offsets("t")


def test_commits_are_pipelined_and_a_missing_group_is_created_then_committed(
    fake: Any,
) -> None:
    created: list[str] = []

    def answer(code: int, fields: dict[str, str]) -> Answer:
        if code == 200:  # UPDATE_AND_CREATE_SUBSCRIPTIONGROUP
            created.append("g")
            return 0, {}, b""
        assert code == 15  # UPDATE_CONSUMER_OFFSET
        return (0 if created else 26), {}, b""

    broker, admin = fake(answer, queues=3)
    queues = admin.queues("t")
    # The first queue's commit goes alone (it creates the group's offset map for the
    # topic), the others together: answered only once both are in.
    broker.hold = (lambda code, fields: code == 15 and fields["queueId"] != "0", 2)
    admin.commit_consumer_offsets("g", {queues[0]: 5, queues[1]: 0, queues[2]: 9})
    assert broker.codes() == [15, 200, 15, 15, 15]
    assert [f["commitOffset"] for c, f in broker.received if c == 15] == ["5", "5", "0", "9"]
    assert created == ["g"]


def test_commits_of_several_topics_send_each_topics_first_queue_first(fake: Any) -> None:
    broker, admin = fake(lambda code, fields: (0, {}, b""), queues=3)
    t, u = admin.queues("t"), admin.queues("u")
    broker.hold = (lambda code, fields: code == 15, 2)  # the two first queues, together
    admin.commit_consumer_offsets("g", {t[1]: 1, u[2]: 2, t[0]: 0, u[0]: 3})
    sent = [(f["topic"], f["queueId"], f["commitOffset"]) for c, f in broker.received if c == 15]
    assert sent[:2] == [("t", "1", "1"), ("u", "2", "2")]
    assert sorted(sent[2:]) == [("t", "0", "0"), ("u", "0", "3")]


def test_failed_commits_name_queue_and_offset(fake: Any) -> None:
    def answer(code: int, fields: dict[str, str]) -> Answer:
        return (1 if fields["queueId"] in ("1", "2") else 0), {}, b""

    _, admin = fake(answer, queues=3)
    queues = admin.queues("t")
    with pytest.raises(RemotingError, match=r"on t\[1\] at 11, t\[2\] at 12 failed: code 1"):
        admin.commit_consumer_offsets("g", {q: 10 + q.queue_id for q in queues})
    with pytest.raises(ValueError, match=r"-3 for t\[0\]"):
        admin.commit_consumer_offsets("g", {queues[0]: -3})


def test_a_connection_the_broker_closed_while_idle_is_replaced_once(fake: Any) -> None:
    broker, admin = fake(_queue_offsets({0: 1, 1: 2, 2: 3}))
    queues = admin.queues("t")
    assert list(admin.group_offsets("g", "t", queues).values()) == [1, 2, 3]
    accepted = broker.accepted
    broker.drop_connections()
    assert list(admin.group_offsets("g", "t", queues).values()) == [1, 2, 3]
    assert broker.accepted == accepted + 1


def test_offset_for_timestamp_sends_topic_queue_and_time_and_reads_the_offset(fake: Any) -> None:
    def answer(code: int, fields: dict[str, str]) -> Answer:
        assert code == 29  # SEARCH_OFFSET_BY_TIMESTAMP
        if fields["queueId"] == "2":
            return 1, {}, b""  # SYSTEM_ERROR
        return 0, {"offset": str(int(fields["timestamp"]) % 1000 + int(fields["queueId"]))}, b""

    broker, admin = fake(answer, queues=3)
    queues = admin.queues("t")
    assert admin.offset_for_timestamp(queues[1], 1_763_735_400_042) == 43
    assert broker.received[-1] == (
        29,
        {"topic": "t", "queueId": "1", "timestamp": "1763735400042", "boundaryType": "LOWER"},
    )
    with pytest.raises(RemotingError, match=r"offset by timestamp of t\[2\]"):
        admin.offset_for_timestamp(queues[2], 5)
