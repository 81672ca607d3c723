"""RocketMQ's remoting protocol, the small subset stream-assets speaks itself.

Written by hand because no maintained Python library speaks it: the PyPI
``rocketmq`` client (the C++ client) exposes produce and a NUL-truncating pull
only, with no admin calls (see docs/rocketmq-client.md). A frame is::

    int32 length | int32 (serialize type << 24 | header length) | JSON header | body

with big-endian integers, the JSON header carrying ``code``, ``opaque``,
``flag`` (bit 0: response) and string ``extFields``.

Example::

    >>> conn = RemotingConnection("127.0.0.1:9876", timeout_s=5)  # doctest: +SKIP
    >>> reply = conn.call(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "t"})  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import socket
import struct
import threading
from dataclasses import dataclass, field
from enum import IntEnum

from pydantic import SecretStr

from stream_assets.rocketmq.errors import BrokerUnreachableError

#: MQVersion.Version.V5_3_3.ordinal() of the Java code base; sent as "version".
PROTOCOL_VERSION = 497
_RESPONSE_FLAG = 1
#: Flag bit of a request that gets no reply (RemotingCommand.markOnewayRPC).
ONEWAY_FLAG = 2
_FRAME_HEAD = struct.Struct(">ii")


class RequestCode(IntEnum):
    """Request codes used here (org.apache.rocketmq.remoting.protocol.RequestCode)."""

    PULL_MESSAGE = 11
    #: Controller mode: elect a group's master (designated: the node named), and a
    #: group's SyncStateSet.
    CONTROLLER_ELECT_MASTER = 1002
    CONTROLLER_GET_SYNC_STATE_DATA = 1006
    QUERY_CONSUMER_OFFSET = 14
    UPDATE_CONSUMER_OFFSET = 15
    UPDATE_AND_CREATE_TOPIC = 17
    DELETE_TOPIC_IN_BROKER = 215
    DELETE_TOPIC_IN_NAMESRV = 216
    DELETE_SUBSCRIPTIONGROUP = 207
    #: A broker's runtime configuration (a Java properties text), and changes to it.
    UPDATE_BROKER_CONFIG = 25
    GET_BROKER_CONFIG = 26
    SEARCH_OFFSET_BY_TIMESTAMP = 29
    GET_MAX_OFFSET = 30
    GET_MIN_OFFSET = 31
    PUT_KV_CONFIG = 100
    GET_KV_CONFIG = 101
    DELETE_KV_CONFIG = 102
    GET_ROUTEINFO_BY_TOPIC = 105
    GET_ALL_TOPIC_LIST_FROM_NAMESERVER = 206
    UPDATE_AND_CREATE_SUBSCRIPTIONGROUP = 200
    GET_ALL_SUBSCRIPTIONGROUP_CONFIG = 201
    GET_BROKER_CLUSTER_INFO = 106
    GET_TOPIC_STATS_INFO = 202
    GET_CONSUME_STATS = 208
    #: A client names its producer (and consumer) groups; the broker sends checks
    #: of a group's transactions only to channels that did.
    HEART_BEAT = 34
    #: Commit or roll back a transactional (half) message.
    END_TRANSACTION = 37
    #: Broker -> producer: what became of this half message? (one-way, no reply)
    CHECK_TRANSACTION_STATE = 39
    SEND_MESSAGE_V2 = 310
    SEND_BATCH_MESSAGE = 320


class ResponseCode(IntEnum):
    """Response codes used here (ResponseCode)."""

    SUCCESS = 0
    TOPIC_NOT_EXIST = 17
    PULL_NOT_FOUND = 19
    PULL_RETRY_IMMEDIATELY = 20
    PULL_OFFSET_MOVED = 21
    QUERY_NOT_FOUND = 22
    SUBSCRIPTION_GROUP_NOT_EXIST = 26


@dataclass(frozen=True)
class Credentials:
    """ACL access key and secret; the secret only ever leaves as an HMAC."""

    access_key: SecretStr
    secret_key: SecretStr

    def sign(self, ext_fields: dict[str, str], body: bytes) -> dict[str, str]:
        """Return ``ext_fields`` plus AccessKey and Signature, as RocketMQ's ACL expects.

        The signed content is every ext field value in key order, then the body,
        HMAC-SHA1 with the secret, base64 (AclClientRPCHook's scheme, also
        accepted by ACL 2.0 for remoting clients).
        """
        fields = dict(ext_fields)
        fields["AccessKey"] = self.access_key.get_secret_value()
        content = "".join(fields[k] for k in sorted(fields)).encode() + body
        digest = hmac.new(self.secret_key.get_secret_value().encode(), content, hashlib.sha1)
        fields["Signature"] = base64.b64encode(digest.digest()).decode()
        return fields


@dataclass
class RemotingCommand:
    """One decoded frame."""

    code: int
    opaque: int
    flag: int = 0
    remark: str | None = None
    ext_fields: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def encode(self) -> bytes:
        """Serialize to one wire frame (JSON header)."""
        header = json.dumps(
            {
                "code": self.code,
                "language": "PYTHON",
                "version": PROTOCOL_VERSION,
                "opaque": self.opaque,
                "flag": self.flag,
                "remark": self.remark,
                "extFields": self.ext_fields,
                "serializeTypeCurrentRPC": "JSON",
            },
            separators=(",", ":"),
        ).encode()
        return _FRAME_HEAD.pack(4 + len(header) + len(self.body), len(header)) + header + self.body

    @classmethod
    def decode(cls, frame: bytes) -> RemotingCommand:
        """Parse a frame without its leading length word."""
        (mark,) = struct.unpack_from(">i", frame, 0)
        serialize_type, header_len = (mark >> 24) & 0xFF, mark & 0xFFFFFF
        if serialize_type != 0:
            raise ValueError(f"unsupported remoting serialize type {serialize_type}")
        header = json.loads(frame[4 : 4 + header_len])
        return cls(
            code=int(header["code"]),
            opaque=int(header.get("opaque", 0)),
            flag=int(header.get("flag", 0)),
            remark=header.get("remark"),
            ext_fields={str(k): str(v) for k, v in (header.get("extFields") or {}).items()},
            body=bytes(frame[4 + header_len :]),
        )


class RemotingConnection:
    """A blocking, thread-safe request/response connection to one server.

    Requests on one connection are serialized; open one connection per
    concurrent caller where that matters. Any socket failure closes the
    connection; the next call reconnects.
    """

    _opaques = itertools.count(1)

    def __init__(
        self,
        addr: str,
        timeout_s: float,
        role: str = "server",
        credentials: Credentials | None = None,
    ) -> None:
        self.addr = addr
        self.role = role
        self.timeout_s = timeout_s
        self._credentials = credentials
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(
        self,
        code: int,
        ext_fields: dict[str, str],
        body: bytes = b"",
        timeout_s: float | None = None,
    ) -> RemotingCommand:
        """Send one request and wait for its response (bounded by ``timeout_s``)."""
        fields = {k: str(v) for k, v in ext_fields.items()}
        if self._credentials is not None:
            fields = self._credentials.sign(fields, body)
        request = RemotingCommand(
            code=code, opaque=next(self._opaques), ext_fields=fields, body=body
        )
        with self._lock:
            # A pooled socket may have been closed by the server while idle (the
            # name server drops channels idle for 120 s): one retry on a fresh one.
            attempts = 2 if self._sock is not None else 1
            for attempt in range(attempts):
                try:
                    return self._exchange(request, timeout_s or self.timeout_s)
                except (OSError, ValueError) as exc:
                    self._close()
                    if attempt + 1 == attempts:
                        raise BrokerUnreachableError(
                            self.role, self.addr, describe_socket_error(exc)
                        ) from exc
            raise AssertionError("unreachable")

    def call_many(
        self,
        requests: list[tuple[int, dict[str, str], bytes]],
        timeout_s: float | None = None,
    ) -> list[RemotingCommand]:
        """Send every ``(code, ext_fields, body)`` request at once, then await all replies.

        Pipelined: one write of all frames, then replies in whatever order the
        server answers, returned in request order. One round trip instead of
        ``len(requests)``. Not retried: a socket failure closes the connection
        and raises :class:`BrokerUnreachableError`; which requests took effect
        is unknown, so only the caller can decide whether repeating is safe.

        Example::

            >>> requests = [(RequestCode.GET_MAX_OFFSET, f, b"") for f in fields]  # doctest: +SKIP
            >>> replies = conn.call_many(requests)  # doctest: +SKIP
        """
        if not requests:
            return []
        commands = []
        for code, ext_fields, body in requests:
            fields = {k: str(v) for k, v in ext_fields.items()}
            if self._credentials is not None:
                fields = self._credentials.sign(fields, body)
            commands.append(
                RemotingCommand(code=code, opaque=next(self._opaques), ext_fields=fields, body=body)
            )
        with self._lock:
            try:
                sock = self._connect()
                sock.settimeout(timeout_s or self.timeout_s)
                sock.sendall(b"".join(c.encode() for c in commands))
                waiting = {c.opaque: i for i, c in enumerate(commands)}
                replies: list[RemotingCommand | None] = [None] * len(commands)
                while waiting:
                    reply = RemotingCommand.decode(read_frame(sock))
                    if reply.flag & _RESPONSE_FLAG and reply.opaque in waiting:
                        replies[waiting.pop(reply.opaque)] = reply
            except (OSError, ValueError) as exc:
                self._close()
                raise BrokerUnreachableError(
                    self.role, self.addr, describe_socket_error(exc)
                ) from exc
        return [r for r in replies if r is not None]

    def _exchange(self, request: RemotingCommand, timeout_s: float) -> RemotingCommand:
        sock = self._connect()
        sock.settimeout(timeout_s)
        sock.sendall(request.encode())
        while True:
            reply = RemotingCommand.decode(read_frame(sock))
            if reply.flag & _RESPONSE_FLAG and reply.opaque == request.opaque:
                return reply

    def close(self) -> None:
        """Close the socket (a later call reconnects)."""
        with self._lock:
            self._close()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            host, _, port = self.addr.rpartition(":")
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def read_frame(sock: socket.socket) -> bytes:
    """One frame from ``sock`` without its length word, for :meth:`RemotingCommand.decode`."""
    (length,) = struct.unpack(">i", _read_exact(sock, 4))
    return _read_exact(sock, length)


def is_response(command: RemotingCommand) -> bool:
    """Whether ``command`` answers a request (rather than being one)."""
    return bool(command.flag & _RESPONSE_FLAG)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return bytes(buf)


def describe_socket_error(exc: BaseException) -> str:
    """A socket failure in a few words, as errors and logs give it."""
    if isinstance(exc, TimeoutError | socket.timeout):
        return "no answer within the timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return f"{type(exc).__name__}: {exc}"


def parse_fastjson(body: bytes) -> object:
    """Parse a JSON body written by fastjson, which leaves integer map keys unquoted.

    Route data looks like ``{"brokerAddrs":{0:"127.0.0.1:10911"}}``; quote such
    keys (only where a key may start, after ``{`` or ``,``) before parsing.
    """
    text = body.decode("utf-8")
    out: list[str] = []
    i, n, in_string = 0, len(text), False
    while i < n:
        ch = text[i]
        out.append(ch)
        if in_string:
            if ch == "\\":
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{,":
            j = i + 1
            while j < n and text[j] in " \n\r\t":
                j += 1
            k = j + (1 if j < n and text[j] == "-" else 0)
            while k < n and text[k].isdigit():
                k += 1
            if k > j and k < n and text[k] == ":":
                out.append(f'"{text[j:k]}"')
                i = k - 1
        i += 1
    return json.loads("".join(out))


_JSON_SPACE = " \t\n\r"
_JSON_SCALARS = json.JSONDecoder()


def parse_fastjson_keyed(body: bytes) -> object:
    """Parse a fastjson body whose maps may have any JSON value as a key.

    fastjson writes a ``Map<MessageQueue, ...>`` (TopicStatsTable, ConsumeStats)
    with each key as a JSON object, ``{{"brokerName":"b","queueId":0,"topic":"t"}:{...}}``,
    which no JSON parser accepts. Here every key that is not a string becomes
    its compact JSON text with sorted keys -- ``json.loads`` of it gives the
    key back -- so the result is plain JSON data. Integer keys come out as
    :func:`parse_fastjson` gives them (``0`` -> ``"0"``).

    Example::

        >>> parse_fastjson_keyed(b'{"t":{{"queueId":0,"topic":"a%b"}:{"maxOffset":5}}}')
        {'t': {'{"queueId":0,"topic":"a%b"}': {'maxOffset': 5}}}
        >>> parse_fastjson_keyed(b'{"brokerAddrs":{0:"127.0.0.1:10911"}}')
        {'brokerAddrs': {'0': '127.0.0.1:10911'}}
    """
    text = body.decode("utf-8")
    value, end = _keyed_value(text, _skip_space(text, 0))
    if _skip_space(text, end) != len(text):
        raise ValueError(f"unexpected data at character {end} of a fastjson body")
    return value


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_SPACE:
        i += 1
    return i


def _keyed_value(text: str, i: int) -> tuple[object, int]:
    """The value starting at ``text[i]`` and the index just past it."""
    if text.startswith("{", i):
        return _keyed_object(text, i)
    if text.startswith("[", i):
        items: list[object] = []
        i = _skip_space(text, i + 1)
        if text.startswith("]", i):
            return items, i + 1
        while True:
            item, i = _keyed_value(text, i)
            items.append(item)
            i = _expect(text, i, ",]")
            if text[i - 1] == "]":
                return items, i
            i = _skip_space(text, i)
    # Strings (escapes included), numbers, true, false, null: the standard decoder's.
    value, end = _JSON_SCALARS.raw_decode(text, i)
    return value, end


def _keyed_object(text: str, i: int) -> tuple[object, int]:
    out: dict[str, object] = {}
    i = _skip_space(text, i + 1)
    if text.startswith("}", i):
        return out, i + 1
    while True:
        raw_key, i = _keyed_value(text, i)
        key = (
            raw_key
            if isinstance(raw_key, str)
            else json.dumps(raw_key, sort_keys=True, separators=(",", ":"))
        )
        i = _expect(text, i, ":")
        out[key], i = _keyed_value(text, _skip_space(text, i))
        i = _expect(text, i, ",}")
        if text[i - 1] == "}":
            return out, i
        i = _skip_space(text, i)


def _expect(text: str, i: int, allowed: str) -> int:
    """Skip space, check the next character is one of ``allowed``; the index past it."""
    i = _skip_space(text, i)
    if i >= len(text) or text[i] not in allowed:
        found = repr(text[i]) if i < len(text) else "the end"
        raise ValueError(
            f"expected one of {allowed!r} at character {i} of a fastjson body, found {found}"
        )
    return i + 1


class ConnectionPool:
    """One :class:`RemotingConnection` per address, created on first use."""

    def __init__(self, timeout_s: float, credentials: Credentials | None = None) -> None:
        self.timeout_s = timeout_s
        self._credentials = credentials
        self._conns: dict[str, RemotingConnection] = {}
        self._lock = threading.Lock()

    def get(self, addr: str, role: str) -> RemotingConnection:
        """The connection to ``addr`` (``role`` names it in errors)."""
        with self._lock:
            conn = self._conns.get(addr)
            if conn is None:
                conn = RemotingConnection(addr, self.timeout_s, role, self._credentials)
                self._conns[addr] = conn
            return conn

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
