"""Unit tests of the hand-written remoting protocol (no broker, no network).

Frames are built and parsed in the tests with ``struct`` and ``json`` following
the documented layout (``int32 length | int32 (type << 24 | header length) |
JSON header | body``, big-endian), independently of the code under test.
The connection tests use a throwaway TCP server thread on 127.0.0.1.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import SecretStr

from stream_assets.rocketmq.errors import BrokerUnreachableError
from stream_assets.rocketmq.remoting import (
    ConnectionPool,
    Credentials,
    RemotingCommand,
    RemotingConnection,
    RequestCode,
    parse_fastjson,
)
from stream_assets.settings import RocketMQSettings

# -- independent frame helpers ---------------------------------------------


def build_frame(header: dict[str, Any], body: bytes = b"", serialize_type: int = 0) -> bytes:
    """A whole wire frame, length word included."""
    head = json.dumps(header).encode()
    mark = (serialize_type << 24) | len(head)
    return struct.pack(">iI", 4 + len(head) + len(body), mark) + head + body


def split_frame(frame: bytes) -> tuple[int, int, dict[str, Any], bytes]:
    """(length word, serialize type, header, body) of a whole frame."""
    length, mark = struct.unpack(">iI", frame[:8])
    header_len = mark & 0xFFFFFF
    header = json.loads(frame[8 : 8 + header_len])
    return length, mark >> 24, header, frame[8 + header_len :]


def recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("client closed")
        buf += chunk
    return buf


def recv_frame(conn: socket.socket) -> bytes:
    """One whole frame (length word included) from a socket."""
    head = recv_exact(conn, 4)
    (length,) = struct.unpack(">i", head)
    return head + recv_exact(conn, length)


# -- RemotingCommand ---------------------------------------------------------


def test_encode_layout_matches_documented_frame() -> None:
    cmd = RemotingCommand(
        code=105,
        opaque=4242,
        flag=0,
        ext_fields={"topic": "orders", "queueId": "3"},
        body=b"\x00\x01payload\xff",
    )
    frame = cmd.encode()
    length, stype, header, body = split_frame(frame)
    assert length == len(frame) - 4
    assert stype == 0  # JSON
    (mark,) = struct.unpack(">i", frame[4:8])
    assert 8 + (mark & 0xFFFFFF) + len(body) == len(frame)
    assert header["code"] == 105
    assert header["opaque"] == 4242
    assert header["flag"] == 0
    assert header["extFields"] == {"topic": "orders", "queueId": "3"}
    assert body == b"\x00\x01payload\xff"


def test_encode_decode_round_trip() -> None:
    cmd = RemotingCommand(
        code=11,
        opaque=7,
        flag=1,
        remark='a remark, with "quotes" and ünïcode',
        ext_fields={"a": "1", "b": "x y", "c": ""},
        body=bytes(range(256)),
    )
    frame = cmd.encode()
    back = RemotingCommand.decode(frame[4:])
    assert back == cmd


def test_decode_of_independently_built_frame() -> None:
    frame = build_frame(
        {
            "code": 0,
            "opaque": 99,
            "flag": 1,
            "language": "JAVA",
            "version": 497,
            "remark": None,
            "extFields": {"offset": "12345", "minOffset": "0"},
            "serializeTypeCurrentRPC": "JSON",
        },
        b"body\x00bytes",
    )
    cmd = RemotingCommand.decode(frame[4:])
    assert cmd.code == 0
    assert cmd.opaque == 99
    assert cmd.flag == 1
    assert cmd.remark is None
    assert cmd.ext_fields == {"offset": "12345", "minOffset": "0"}
    assert cmd.body == b"body\x00bytes"


def test_decode_tolerates_missing_optional_header_fields() -> None:
    frame = build_frame({"code": 17, "extFields": None})
    cmd = RemotingCommand.decode(frame[4:])
    assert (cmd.code, cmd.opaque, cmd.flag, cmd.ext_fields, cmd.body) == (17, 0, 0, {}, b"")


@pytest.mark.parametrize("serialize_type", [1, 2, 0x7F])
def test_decode_rejects_non_json_serialize_type(serialize_type: int) -> None:
    frame = build_frame({"code": 0, "opaque": 1, "flag": 1}, serialize_type=serialize_type)
    with pytest.raises(ValueError, match=f"serialize type {serialize_type}"):
        RemotingCommand.decode(frame[4:])


# -- parse_fastjson ------------------------------------------------------------


def test_parse_fastjson_unquoted_integer_keys_leave_strings_alone() -> None:
    body = b'{"brokerAddrs":{0:"127.0.0.1:10911"},"x":"a,1:b"}'
    assert parse_fastjson(body) == {"brokerAddrs": {"0": "127.0.0.1:10911"}, "x": "a,1:b"}


def test_parse_fastjson_nested_and_in_arrays() -> None:
    body = (
        b'{"brokerDatas":[{"brokerName":"broker-a","brokerAddrs":{0:"10.0.0.1:10911",'
        b'1:"10.0.0.2:10911"}},{"brokerName":"b","brokerAddrs":{12:"h:1"}}],'
        b'"outer":{3:{4:{5:"deep"}}},"list":[1,2,3]}'
    )
    assert parse_fastjson(body) == {
        "brokerDatas": [
            {
                "brokerName": "broker-a",
                "brokerAddrs": {"0": "10.0.0.1:10911", "1": "10.0.0.2:10911"},
            },
            {"brokerName": "b", "brokerAddrs": {"12": "h:1"}},
        ],
        "outer": {"3": {"4": {"5": "deep"}}},
        "list": [1, 2, 3],
    }


def test_parse_fastjson_negative_keys_and_whitespace() -> None:
    body = b'{ -1:"minus",\n\t0: "zero"}'
    assert parse_fastjson(body) == {"-1": "minus", "0": "zero"}
    assert parse_fastjson(b"{\r\n  7:{ -20:[ 1, 2 ]},\n 8:true}") == {
        "7": {"-20": [1, 2]},
        "8": True,
    }


def test_parse_fastjson_strings_that_look_like_keys_are_untouched() -> None:
    tricky = [
        '{0:"x"}',
        ",1:y",
        "{,-2:z",
        'escaped \\" quote ,3:still inside',
        "back\\\\slash,4:",
    ]
    doc = {"k": tricky, "m": {"{5:": "}6:", ",7:": "v"}}
    text = json.dumps(doc, separators=(",", ":"))
    assert parse_fastjson(text.encode()) == doc


def test_parse_fastjson_plain_json_unchanged_and_utf8() -> None:
    doc = {"a": [1, -2, 3.5, None, False], "b": {"c": "é—✓"}, "d": "1:2,3:4"}
    assert parse_fastjson(json.dumps(doc).encode("utf-8")) == doc
    assert parse_fastjson(json.dumps(doc, ensure_ascii=False).encode("utf-8")) == doc


# -- Credentials ---------------------------------------------------------------


def reference_signature(secret: str, fields: dict[str, str], body: bytes) -> str:
    ordered = sorted(fields.items(), key=lambda kv: kv[0])
    content = "".join(v for _, v in ordered).encode("utf-8") + body
    mac = hmac.new(secret.encode("utf-8"), content, "sha1").digest()
    return base64.b64encode(mac).decode("ascii")


def test_sign_matches_independent_hmac_sha1() -> None:
    creds = Credentials(SecretStr("AK-test"), SecretStr("s3cr3t-value"))
    ext = {"topic": "orders", "queueId": "3", "consumerGroup": "g", "Zeta": "z"}
    body = b"\x00binary\xffbody"
    signed = creds.sign(ext, body)
    expected_fields = {**ext, "AccessKey": "AK-test"}
    # Key order: "AccessKey" < "Zeta" < "consumerGroup" < "queueId" < "topic".
    expected_content = ("AK-test" + "z" + "g" + "3" + "orders").encode() + body
    expected = base64.b64encode(
        hmac.new(b"s3cr3t-value", expected_content, hashlib.sha1).digest()
    ).decode()
    assert signed["Signature"] == expected
    assert signed["Signature"] == reference_signature("s3cr3t-value", expected_fields, body)
    assert signed["AccessKey"] == "AK-test"
    assert {k: v for k, v in signed.items() if k not in ("AccessKey", "Signature")} == ext
    assert ext == {"topic": "orders", "queueId": "3", "consumerGroup": "g", "Zeta": "z"}


def test_sign_depends_on_body_and_fields() -> None:
    creds = Credentials(SecretStr("ak"), SecretStr("sk"))
    a = creds.sign({"x": "1"}, b"")["Signature"]
    assert a == reference_signature("sk", {"x": "1", "AccessKey": "ak"}, b"")
    assert creds.sign({"x": "1"}, b"b")["Signature"] != a
    assert creds.sign({"x": "2"}, b"")["Signature"] != a
    assert Credentials(SecretStr("ak"), SecretStr("other")).sign({"x": "1"}, b"")["Signature"] != a


def test_credentials_never_show_secret() -> None:
    creds = Credentials(SecretStr("my-access-key-123"), SecretStr("my-secret-key-456"))
    for text in (repr(creds), str(creds), f"{creds}", f"{creds!r}"):
        assert "my-secret-key-456" not in text
        assert "my-access-key-123" not in text


def test_settings_never_show_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    direct = RocketMQSettings(
        access_key=SecretStr("ak-visible-nowhere"), secret_key=SecretStr("sk-hidden-789")
    )
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_ACCESS_KEY", "ak-visible-nowhere")
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_SECRET_KEY", "sk-hidden-789")
    from_env = RocketMQSettings()
    assert from_env.secret_key is not None
    assert from_env.secret_key.get_secret_value() == "sk-hidden-789"
    for settings in (direct, from_env):
        for text in (repr(settings), str(settings), f"{settings}", settings.model_dump_json()):
            assert "sk-hidden-789" not in text
            assert "ak-visible-nowhere" not in text


# -- RemotingConnection against a throwaway server ----------------------------


class ThrowawayServer:
    """A TCP server on 127.0.0.1 that runs ``handler(conn)`` per accepted connection."""

    def __init__(self, handler: Callable[[socket.socket], None]) -> None:
        self.handler = handler
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.requests: list[bytes] = []
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            self.handler(conn)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        for conn in self._conns:
            conn.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket], None]], ThrowawayServer]]:
    servers: list[ThrowawayServer] = []

    def start(handler: Callable[[socket.socket], None]) -> ThrowawayServer:
        server = ThrowawayServer(handler)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def echo_responder(server_ref: list[ThrowawayServer]) -> Callable[[socket.socket], None]:
    """Answers each request with code 0, its opaque, flag=1, its ext fields echoed."""

    def handle(conn: socket.socket) -> None:
        while True:
            frame = recv_frame(conn)
            server_ref[0].requests.append(frame)
            _, _, header, body = split_frame(frame)
            reply_fields = {"echoCode": str(header["code"]), **(header.get("extFields") or {})}
            conn.sendall(
                build_frame(
                    {"code": 0, "opaque": header["opaque"], "flag": 1, "extFields": reply_fields},
                    b"reply:" + body,
                )
            )

    return handle


def test_call_returns_matching_response(serve: Any) -> None:
    ref: list[ThrowawayServer] = []
    server = serve(echo_responder(ref))
    ref.append(server)
    conn = RemotingConnection(server.addr, timeout_s=5)
    try:
        reply = conn.call(RequestCode.GET_MAX_OFFSET, {"topic": "t", "queueId": 2}, b"\x00x")
        assert reply.code == 0
        assert reply.flag & 1
        assert reply.ext_fields["echoCode"] == str(int(RequestCode.GET_MAX_OFFSET))
        assert reply.ext_fields["topic"] == "t"
        assert reply.ext_fields["queueId"] == "2"  # values are sent as strings
        assert reply.body == b"reply:\x00x"
        second = conn.call(RequestCode.GET_MIN_OFFSET, {"topic": "u"})
        assert second.ext_fields["topic"] == "u"
    finally:
        conn.close()
    assert server.accepted == 1  # the connection is reused
    length, stype, header, body = split_frame(server.requests[0])
    assert length == len(server.requests[0]) - 4
    assert stype == 0
    assert header["code"] == int(RequestCode.GET_MAX_OFFSET)
    assert header["flag"] == 0
    assert body == b"\x00x"
    first_opaque = header["opaque"]
    assert split_frame(server.requests[1])[2]["opaque"] != first_opaque
    assert reply.opaque == first_opaque


def test_call_skips_frames_that_are_not_its_response(serve: Any) -> None:
    def handle(conn: socket.socket) -> None:
        while True:
            _, _, header, _ = split_frame(recv_frame(conn))
            opaque = header["opaque"]
            # A server-initiated request (flag 0) with the same opaque, then a
            # response to some other opaque, then the real response.
            conn.sendall(build_frame({"code": 40, "opaque": opaque, "flag": 0}))
            conn.sendall(build_frame({"code": 1, "opaque": opaque + 1000, "flag": 1}))
            conn.sendall(
                build_frame({"code": 0, "opaque": opaque, "flag": 1, "remark": "mine"}, b"ok")
            )

    server = serve(handle)
    conn = RemotingConnection(server.addr, timeout_s=5)
    try:
        reply = conn.call(RequestCode.GET_BROKER_CLUSTER_INFO, {})
    finally:
        conn.close()
    assert (reply.code, reply.remark, reply.body) == (0, "mine", b"ok")


def test_call_signs_requests_when_credentials_given(serve: Any) -> None:
    ref: list[ThrowawayServer] = []
    server = serve(echo_responder(ref))
    ref.append(server)
    creds = Credentials(SecretStr("AKID"), SecretStr("wire-secret"))
    conn = RemotingConnection(server.addr, timeout_s=5, credentials=creds)
    try:
        conn.call(RequestCode.QUERY_CONSUMER_OFFSET, {"topic": "t", "queueId": 1}, b"B")
    finally:
        conn.close()
    _, _, header, body = split_frame(server.requests[0])
    ext = header["extFields"]
    assert ext["AccessKey"] == "AKID"
    unsigned = {k: v for k, v in ext.items() if k != "Signature"}
    assert ext["Signature"] == reference_signature("wire-secret", unsigned, body)
    assert b"wire-secret" not in server.requests[0]


def test_server_that_never_answers_times_out_naming_address(serve: Any) -> None:
    release = threading.Event()

    def handle(conn: socket.socket) -> None:
        recv_frame(conn)
        release.wait(10)

    server = serve(handle)
    conn = RemotingConnection(server.addr, timeout_s=0.5, role="name server")
    start = time.monotonic()
    try:
        with pytest.raises(BrokerUnreachableError) as info:
            conn.call(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "t"})
    finally:
        release.set()
        conn.close()
    elapsed = time.monotonic() - start
    assert 0.4 <= elapsed < 3.0
    assert info.value.addr == server.addr
    assert server.addr in str(info.value)
    assert "name server" in str(info.value)
    assert "timeout" in str(info.value)


def test_per_call_timeout_overrides_default(serve: Any) -> None:
    release = threading.Event()

    def handle(conn: socket.socket) -> None:
        recv_frame(conn)
        release.wait(10)

    server = serve(handle)
    conn = RemotingConnection(server.addr, timeout_s=30)
    start = time.monotonic()
    try:
        with pytest.raises(BrokerUnreachableError):
            conn.call(RequestCode.PULL_MESSAGE, {}, timeout_s=0.3)
    finally:
        release.set()
        conn.close()
    assert time.monotonic() - start < 3.0


def test_connection_refused_names_address() -> None:
    # A bound socket that does not listen: connecting to it is refused, and
    # keeping it bound stops anyone else taking the port meanwhile.
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{holder.getsockname()[1]}"
    try:
        conn = RemotingConnection(addr, timeout_s=2, role="broker broker-a")
        start = time.monotonic()
        with pytest.raises(BrokerUnreachableError) as info:
            conn.call(RequestCode.GET_MAX_OFFSET, {"topic": "t"})
        assert time.monotonic() - start < 2.0
    finally:
        holder.close()
    assert info.value.addr == addr
    assert addr in str(info.value)
    assert "refused" in str(info.value)
    assert "broker broker-a" in str(info.value)


def test_peer_closing_mid_frame_is_unreachable_and_next_call_reconnects(serve: Any) -> None:
    calls = {"n": 0}

    def handle(conn: socket.socket) -> None:
        while True:
            _, _, header, _ = split_frame(recv_frame(conn))
            calls["n"] += 1
            if calls["n"] == 1:
                conn.sendall(struct.pack(">i", 100) + b"short")
                conn.close()
                return
            conn.sendall(build_frame({"code": 0, "opaque": header["opaque"], "flag": 1}))

    server = serve(handle)
    conn = RemotingConnection(server.addr, timeout_s=2)
    try:
        with pytest.raises(BrokerUnreachableError) as info:
            conn.call(RequestCode.GET_MAX_OFFSET, {})
        assert server.addr in str(info.value)
        reply = conn.call(RequestCode.GET_MAX_OFFSET, {})
        assert reply.code == 0
    finally:
        conn.close()
    assert server.accepted == 2


def test_connection_pool_reuses_per_address() -> None:
    pool = ConnectionPool(timeout_s=1.5)
    a = pool.get("127.0.0.1:1", "broker a")
    assert pool.get("127.0.0.1:1", "other role") is a
    b = pool.get("127.0.0.1:2", "broker b")
    assert b is not a
    assert (a.addr, a.role, a.timeout_s) == ("127.0.0.1:1", "broker a", 1.5)
    pool.close()
    assert pool.get("127.0.0.1:1", "broker a") is not a
