"""Batched, pipelined sends that speak RocketMQ's remoting protocol themselves.

Why not the C++ client (:mod:`~stream_assets.rocketmq.producer`): its C API
sends one message per synchronous round trip (~0.7 ms here). A
``SEND_BATCH_MESSAGE`` request (code 320) carries many messages of one queue,
and :meth:`RemotingConnection.call_many` puts the requests of many queues on
the wire at once, so one round trip stores thousands of messages.

Queue choice is the :class:`~stream_assets.rocketmq.producer.Producer`'s:
``queue_id`` if given, else the stable hash of ``route_key`` (default ``key``;
:func:`~stream_assets.rocketmq.hashing.queue_for_key`), else round-robin.
Within a queue, messages are stored in input order: a queue never has more
than one request in flight, and a failed request is retried before the
queue's next one goes. A retried request may be stored twice
(at-least-once), which is why stream-assets gives output messages
deterministic keys.

Every message carries its own ``UNIQ_KEY`` property (as the Java client's
batches do); that id is the receipt's ``msg_id`` and what
:attr:`Record.msg_id <stream_assets.rocketmq.records.Record.msg_id>` reads back.

Example::

    >>> with BatchProducer(RocketMQSettings()) as producer:  # doctest: +SKIP
    ...     receipts = producer.send_all(
    ...         [OutgoingMessage("orders", b'{"id": 1}', key="customer-7"),
    ...          OutgoingMessage("orders", b'{"id": 2}', key="customer-7")])
    >>> receipts[1].queue_offset - receipts[0].queue_offset  # doctest: +SKIP
    1
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from stream_assets.rocketmq.admin import RocketMQAdmin, TopicRoute, validate_topic_name
from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    RocketMQError,
    SendError,
    TopicNotFoundError,
)
from stream_assets.rocketmq.hashing import choose_queue
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.rocketmq.message_codec import (
    MAX_PROPERTIES_BYTES,
    NAME_VALUE_SEPARATOR,
    PROPERTY_KEYS,
    PROPERTY_SEPARATOR,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_KEY,
    encode_entry,
    encode_properties,
)
from stream_assets.rocketmq.records import OutgoingMessage, SendReceipt, checked_body
from stream_assets.rocketmq.remoting import ConnectionPool, RemotingCommand, RequestCode
from stream_assets.settings import RocketMQSettings

__all__ = [
    "DEFAULT_TOPIC",
    "DEFAULT_TOPIC_QUEUES",
    "MAX_OWN_PROPERTIES_BYTES",
    "BatchProducer",
    "InvalidMessageError",
    "OutgoingMessage",
    "check_message",
]

# What a RocketMQ 5.3.3 broker checks of a send's size (MessageExtEncoder, the
# "maxMessageBodySize" there being the broker's maxMessageSize):
# - a single message (SEND_MESSAGE_V2, encode(MessageExtBrokerInner)): its body
#   length <= maxMessageSize; its properties <= 32767 bytes; the whole stored
#   message <= maxMessageSize + 64 KiB (a 127-byte topic and 32 KiB of
#   properties always fit that reserve);
# - a batch (SEND_BATCH_MESSAGE, encode(MessageExtBatch)): the request's whole
#   body -- every entry with its 22 bytes of framing and its properties --
#   <= maxMessageSize, else it throws and the request is answered SYSTEM_ERROR;
#   nothing per message besides each one's properties length.
# ``settings.max_message_size`` is the broker's maxMessageSize. So a batch
# request's body is kept within it, and a message whose entry alone is over it
# (a body within the last few dozen bytes of the limit) goes as a single
# message, whose only bound is its body: every body up to the limit is sent.
#: Cap on a batch request's body (the broker's own default maxMessageSize):
#: with a larger limit, bigger messages still go, in requests of their own.
MAX_REQUEST_BYTES_CAP = 4 * 1024 * 1024
#: Messages per request. Throughput hardly depends on it (measured here: 200 000
#: 100-byte records over 8 queues, about 157 000 records/s with 256, 2 048 or
#: whole 4 MiB requests; encoding in Python dominates), so it is kept moderate:
#: one request then never holds the commit-log lock for long.
DEFAULT_MAX_REQUEST_MESSAGES = 2048

# Response codes (org.apache.rocketmq.remoting.protocol.ResponseCode). The Java
# client's processSendResponse counts these four as stored:
_STORED = {
    0: "SUCCESS",
    10: "FLUSH_DISK_TIMEOUT",
    11: "SLAVE_NOT_AVAILABLE",
    12: "FLUSH_SLAVE_TIMEOUT",
}
# ...and its producer retries these (DefaultMQProducer.retryResponseCodes, less
# the ones that ask it to pick another broker, which would reorder a queue):
_RETRYABLE = {1: "SYSTEM_ERROR", 2: "SYSTEM_BUSY", 14: "SERVICE_NOT_AVAILABLE", 1500: "GO_AWAY"}
_KNOWN_PERMANENT = {
    13: "MESSAGE_ILLEGAL",
    16: "NO_PERMISSION",
    17: "TOPIC_NOT_EXIST",
    29: "INVALID_PARAMETER",
}
#: The header's default topic and its queue count (what the Java client sends).
DEFAULT_TOPIC = "TBW102"
DEFAULT_TOPIC_QUEUES = "4"
# No request-level properties ("i") in a batch request, on purpose. Brokers up
# to 5.3.3 append the request's properties to every stored message of the
# batch (removed later, apache/rocketmq#9416): a request-level UNIQ_KEY, as the
# Java client sends, would come after each message's own and win when read
# back, giving every message of a request the same id. It would also turn the request into
# one "inner batch" message on a batch-consume-queue topic. WAIT is left out as
# the broker reads a missing WAIT as true (Message.isWaitStoreMsgOK).
#: Property bytes kept free for what the broker appends per message (CLUSTER,
#: MSG_REGION, TRACE_ON: about 70 bytes seen on 5.3.3) under the 32 KiB bound.
BROKER_PROPERTY_ROOM = 512
#: Hex digits of the per-message id (the UNIQ_KEY property) this producer writes.
_MSG_ID_CHARS = 32
#: What a message's own properties (user properties, KEYS, TAGS), UTF-8 encoded,
#: may take: the broker's 32767 (a stored message's properties length is a
#: signed 16-bit field; MessageExtEncoder answers PROPERTIES_SIZE_EXCEEDED, or
#: throws for a batch), less the room above and the UNIQ_KEY property.
MAX_OWN_PROPERTIES_BYTES = (
    MAX_PROPERTIES_BYTES - BROKER_PROPERTY_ROOM - (len(PROPERTY_UNIQ_KEY) + 2 + _MSG_ID_CHARS)
)


class InvalidMessageError(ValueError):
    """A message the broker would refuse or split apart; the text says which rule and what to do.

    Raised before anything is sent (:func:`check_message`), so the engine can
    make it one record's dead letter instead of a failed batch.
    """


def check_message(message: OutgoingMessage, max_message_size: int) -> OutgoingMessage:
    """``message`` with its body as ``bytes``, if a RocketMQ broker would store it as sent.

    Raises what :func:`~stream_assets.rocketmq.records.checked_body` raises for
    the body (not bytes, empty, over ``max_message_size``:
    :class:`~stream_assets.rocketmq.errors.MessageTooLargeError`), and
    :class:`InvalidMessageError` when its key, tags or properties hold
    ``\\x01``/``\\x02`` (the broker's separators), text that is not valid
    UTF-8 (a lone surrogate), an empty property name, or take more than
    :data:`MAX_OWN_PROPERTIES_BYTES` bytes together. Cheap enough to run
    for every message (the engine's send buffer does, as each is queued).

    >>> check_message(OutgoingMessage("t", bytearray(b"x"), key="k"), 10).body
    b'x'
    >>> try:
    ...     check_message(OutgoingMessage("t", b"x", key="k" * 40_000), 10)
    ... except InvalidMessageError as e:
    ...     print(str(e)[:68])
    message for topic 't': its key, tags and properties take 40006 bytes
    """
    body = checked_body(message.topic, message.body, max_message_size)
    own_properties(message)
    return message if body is message.body else replace(message, body=body)


class _TransientSendError(Exception):
    """A request that failed in a way worth another try."""

    def __init__(self, message: str, unreachable_only: bool = False) -> None:
        super().__init__(message)
        #: Every failure was a broker that did not answer (no refusal among them).
        self.unreachable_only = unreachable_only


@dataclass(frozen=True)
class _Slot:
    """One writable queue: where requests for it go."""

    broker_name: str
    addr: str
    queue_id: int


@dataclass
class _Request:
    """The messages of one ``SEND_BATCH_MESSAGE`` request, all of one queue."""

    topic: str
    slot: _Slot
    #: The slot's position: the queue index the messages were routed to.
    index: int
    positions: list[int] = field(default_factory=list)
    entries: list[bytes] = field(default_factory=list)
    msg_ids: list[str] = field(default_factory=list)
    size: int = 0
    #: ``(body, property string)`` of a message too large for any batch (its
    #: entry is over maxMessageSize though its body is not): it is this
    #: request's only message and goes as a single message (SEND_MESSAGE_V2).
    single: tuple[bytes, str] | None = None

    def describe(self) -> str:
        return (
            f"topic {self.topic!r} queue {self.slot.queue_id} on broker "
            f"{self.slot.broker_name} ({self.slot.addr})"
        )


class BatchProducer:
    """Sends many messages per request, many requests at once; thread-safe.

    One per process is the normal use: sends from several threads share its
    connections (one per broker address).
    """

    def __init__(
        self,
        settings: RocketMQSettings,
        admin: RocketMQAdmin | None = None,
        group: str | None = None,
        max_request_bytes: int | None = None,
        max_request_messages: int = DEFAULT_MAX_REQUEST_MESSAGES,
    ) -> None:
        self.settings = settings
        self._admin = admin or RocketMQAdmin(settings)
        self._owns_admin = admin is None
        self._group = group or settings.producer_group
        if max_request_bytes is None:
            max_request_bytes = min(settings.max_message_size, MAX_REQUEST_BYTES_CAP)
        if max_request_bytes <= 0 or max_request_messages <= 0:
            raise ValueError(
                f"max_request_bytes ({max_request_bytes}) and max_request_messages "
                f"({max_request_messages}) must be positive"
            )
        self.max_request_bytes = max_request_bytes
        self.max_request_messages = max_request_messages
        self._routes: dict[str, tuple[TopicRoute, list[_Slot]]] = {}
        self._routes_lock = threading.Lock()
        self._layouts: dict[str, TopicLayout] = {}
        self._turn = itertools.count().__next__  # round-robin
        # Unique ids: per producer, the pid and 8 random bytes; per message, a
        # counter. 32 hex digits like the Java client's ids; the broker only
        # stores them (for the index and for consumers).
        self._id_prefix = f"{os.getpid() & 0xFFFF:04X}{os.urandom(8).hex().upper()}"
        self._id_counter = itertools.count()
        self._pool: ConnectionPool | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lifecycle = threading.Lock()

    @property
    def max_message_size(self) -> int:
        """The broker's body limit this producer enforces (``settings.max_message_size``)."""
        return self.settings.max_message_size

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> BatchProducer:
        """Check the name server answers (bounded), then open the connection pool."""
        self._admin.master_brokers()  # raises BrokerUnreachableError naming the address
        with self._lifecycle:
            if self._pool is None:
                # Connections of its own, so sends never queue behind admin calls.
                self._pool = self._admin.new_pool()
        return self

    def close(self) -> None:
        """Close the connections (and the admin client if this producer made it)."""
        with self._lifecycle:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
        if self._owns_admin:
            self._admin.close()

    def __enter__(self) -> BatchProducer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- routes ------------------------------------------------------------

    def route(self, topic: str) -> TopicRoute:
        """The (cached) route of ``topic``; raises TopicNotFoundError if it has none."""
        return self._route(topic)[0]

    def _route(self, topic: str) -> tuple[TopicRoute, list[_Slot]]:
        with self._routes_lock:
            cached = self._routes.get(topic)
        if cached is not None:
            return cached
        validate_topic_name(topic)
        route = self._admin.route(topic)
        layout = self._layouts.get(topic)
        if layout is not None:
            # A pinned layout: index i is always the same queue. A group without a
            # master keeps its slots with no address; sends to them wait (retried
            # as unreachable) rather than go to another queue.
            slots = [
                _Slot(b, route.brokers[b].master if b in route.brokers else "", q)
                for b, q in layout.pairs
            ]
        else:
            # Queue index -> (broker, queue id), brokers by name: the order of
            # TopicRoute.read_queues, so with one broker the index is the queue id.
            # Groups without a master are left out, as RocketMQ's producers do.
            slots = [
                _Slot(name, route.brokers[name].master, qid)
                for name in sorted(route.brokers)
                if route.brokers[name].master
                for qid in range(route.brokers[name].write_queues)
            ]
        if not slots:
            raise BrokerUnreachableError(
                f"topic {topic!r}", self.settings.namesrv_addr, "no broker group has a master"
            )
        with self._routes_lock:
            self._routes[topic] = (route, slots)
        return route, slots

    def pin(self, layouts: Iterable[TopicLayout]) -> None:
        """Send by these layouts: ``queue_id=i`` is the layout's queue ``i`` for its topic.

        The engine pins its shuffle and state topics, whose queue index must
        keep its meaning while a broker group is down or gone from the route.
        """
        with self._routes_lock:
            for layout in layouts:
                if self._layouts.get(layout.topic) != layout:
                    self._layouts[layout.topic] = layout
                    self._routes.pop(layout.topic, None)

    def _forget_routes(self, addrs: set[str]) -> None:
        # After a broker was unreachable its address may have moved (a slave promoted
        # under a controller): every route through it is asked of the name server again.
        with self._routes_lock:
            stale = [
                t for t, (_, slots) in self._routes.items() if any(s.addr in addrs for s in slots)
            ]
            for topic in stale:
                self._routes.pop(topic, None)

    def _repoint(self, requests: list[_Request]) -> None:
        """Send ``requests`` (which found their broker unreachable) to their queue's
        address in a fresh route: the same queue, wherever its group's master is now."""
        for request in requests:
            try:
                slots = self._route(request.topic)[1]
            except (BrokerUnreachableError, TopicNotFoundError):
                continue  # no route now: the next attempt tries the old address again
            same = [
                s
                for s in slots
                if (s.broker_name, s.queue_id) == (request.slot.broker_name, request.slot.queue_id)
            ]
            if same:
                request.slot = same[0]
            elif request.topic not in self._layouts:
                # Not pinned (a sink): the group has no master now and is left out of
                # the route, so the request goes to a queue of a group that has one,
                # as RocketMQ's own producers do. (A pinned queue keeps its meaning.)
                request.index %= len(slots)
                request.slot = slots[request.index]

    def place(self, m: OutgoingMessage) -> tuple[int, str, str, int]:
        """Where ``m`` goes, as :meth:`send_all` would send it: (queue index, broker
        group, its master's address, queue id)."""
        slots = self._route(m.topic)[1]
        index = self._queue_index(m, len(slots))
        slot = slots[index]
        return index, slot.broker_name, slot.addr, slot.queue_id

    def index_of(self, topic: str, broker_name: str, queue_id: int) -> int:
        """The index :meth:`send_all` sends ``queue_id=`` by for ``broker_name``'s queue
        ``queue_id`` of ``topic``; RocketMQError if the route has no such queue now."""
        for index, slot in enumerate(self._route(topic)[1]):
            if (slot.broker_name, slot.queue_id) == (broker_name, queue_id):
                return index
        raise RocketMQError(
            f"topic {topic!r} has no queue {queue_id} on {broker_name} in its route now "
            "(its broker group down, or the topic's queues changed): try again when it is back"
        )

    def next_msg_id(self) -> str:
        """A new message id (UNIQ_KEY), unique across this producer's messages."""
        return f"{self._id_prefix}{next(self._id_counter):012X}"

    @property
    def pool(self) -> ConnectionPool:
        """The started producer's connections (one per broker address)."""
        if self._pool is None:
            raise RocketMQError("producer is not started; call start() or use it as a context")
        return self._pool

    # -- sending -----------------------------------------------------------

    def send_all(self, messages: Sequence[OutgoingMessage]) -> list[SendReceipt]:
        """Send ``messages`` and return where each was stored, in input order.

        Every message is validated and encoded before anything is sent, so a
        bad one (not bytes, empty, too large, unknown topic, bad queue id, a
        key or property the broker would refuse: :func:`check_message`)
        sends nothing. A request the broker refuses for good, or that still
        fails after ``settings.send_retries`` retries, raises
        :class:`SendError`; requests answered before it are stored.
        """
        receipts, _ = self._send(messages, skip=(), hold=False)
        return [r for r in receipts if r is not None]

    def send_reachable(
        self, messages: Sequence[OutgoingMessage], skip: Collection[str] = ()
    ) -> tuple[list[SendReceipt | None], dict[int, str]]:
        """Send what the broker groups that answer can store; hold back the rest.

        Messages for a broker group named in ``skip``, or whose group still does
        not answer after the retries of :meth:`send_all`, are not sent, and
        neither is any later message of the same queue, so a queue's order
        holds when they are sent later. Returns a receipt per message (None
        where unsent) and, per unsent message's position, its broker group.
        A refusal still raises, as in :meth:`send_all`.

        Example::

            >>> receipts, unsent = producer.send_reachable(messages)  # doctest: +SKIP
            >>> sorted(set(unsent.values()))  # doctest: +SKIP
            ['broker-b']
        """
        return self._send(messages, skip=skip, hold=True)

    def _send(
        self, messages: Sequence[OutgoingMessage], skip: Collection[str], hold: bool
    ) -> tuple[list[SendReceipt | None], dict[int, str]]:
        if not messages:
            return [], {}
        pool = self._pool
        if pool is None:
            raise RocketMQError("producer is not started; call start() or use it as a context")
        queues = self._plan(messages)
        receipts: list[SendReceipt | None] = [None] * len(messages)
        unsent: dict[int, str] = {}

        def hold_back(q: deque[_Request]) -> None:
            for request in q:
                unsent.update(dict.fromkeys(request.positions, request.slot.broker_name))
            q.clear()

        for q in queues.values():
            if q and q[0].slot.broker_name in skip:
                hold_back(q)
        # Waves: each queue's first unsent request, all at once. A queue's next
        # request waits for its previous one's answer, so retries cannot reorder it.
        active = [q for q in queues.values() if q]
        while active:
            heads = [q[0] for q in active]
            replies = self._send_wave(pool, heads, hold)
            for q, request, reply in zip(active, heads, replies, strict=True):
                if reply is None:
                    hold_back(q)
                    continue
                self._record(request, reply, receipts)
                q.popleft()
            active = [q for q in active if q]
        return receipts, unsent

    def _plan(self, messages: Sequence[OutgoingMessage]) -> dict[tuple[str, int], deque[_Request]]:
        """Choose queues, encode, and cut each queue's messages into requests.

        The per-message loop is the client's main cost (a few microseconds a
        message), hence the local caches and the property string built by hand.

        A message's limits are its body's, ``settings.max_message_size`` (the
        broker's maxMessageSize), and its properties' (:func:`check_message`,
        the same rules). A message whose entry is over
        ``max_request_bytes`` gets a request of its own (queue order is kept:
        the queue's messages before and after it are in the requests before
        and after), as a batch of one if the broker takes its entry as a batch,
        else as a single message.
        """
        body_limit = self.settings.max_message_size
        # The broker refuses a batch whose whole body is over its maxMessageSize.
        limit = min(self.max_request_bytes, body_limit)
        max_count = self.max_request_messages
        id_prefix, id_counter = self._id_prefix, self._id_counter
        slots_of: dict[str, list[_Slot]] = {}
        queues: dict[tuple[str, int], deque[_Request]] = {}
        for position, m in enumerate(messages):
            topic = m.topic
            body = checked_body(topic, m.body, body_limit)
            own = own_properties(m)
            slots = slots_of.get(topic)
            if slots is None:
                slots = slots_of[topic] = self._route(topic)[1]
            index = self._queue_index(m, len(slots))
            msg_id = f"{id_prefix}{next(id_counter):012X}"
            props = own + f"{PROPERTY_UNIQ_KEY}\x01{msg_id}\x02".encode()
            entry = encode_entry(body, props)
            size = len(entry)
            pending = queues.get((topic, index))
            if pending is None:
                pending = queues[(topic, index)] = deque()
            request = pending[-1] if pending else None
            # An entry over ``limit`` always starts a request, and no other joins it
            # (its size is over ``limit`` too).
            if request is None or request.size + size > limit or len(request.entries) >= max_count:
                request = _Request(topic, slots[index], index)
                pending.append(request)
                if size > body_limit:
                    request.single = (body, props.decode())
            request.positions.append(position)
            request.entries.append(entry)
            request.msg_ids.append(msg_id)
            request.size += size
        return queues

    def _queue_index(self, m: OutgoingMessage, queue_count: int) -> int:
        route_key = m.route_key if m.route_key is not None else m.key
        return choose_queue(m.topic, queue_count, m.queue_id, route_key, self._turn)

    def _send_wave(
        self, pool: ConnectionPool, heads: list[_Request], hold: bool = False
    ) -> list[RemotingCommand | None]:
        """Send ``heads`` (one request per queue) until each is stored; replies in order.

        ``hold``: a request whose broker still does not answer after the retries
        gets None instead of failing the wave (when that is all that failed).
        """
        done: dict[int, RemotingCommand] = {}
        attempts = self.settings.send_retries + 1
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(attempts),
                wait=wait_exponential(multiplier=0.05, max=2.0),
                retry=retry_if_exception_type(_TransientSendError),
                reraise=False,
            ):
                with attempt:
                    self._attempt(pool, heads, done)
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            if not (hold and isinstance(cause, _TransientSendError) and cause.unreachable_only):
                raise SendError(f"batch send failed after {attempts} attempts: {cause}") from cause
        return [done.get(i) for i in range(len(heads))]

    def _attempt(
        self, pool: ConnectionPool, heads: list[_Request], done: dict[int, RemotingCommand]
    ) -> None:
        """One try of every request of the wave not yet stored; raises if any is left."""
        by_addr: dict[str, list[int]] = {}
        for i, request in enumerate(heads):
            if i not in done:
                by_addr.setdefault(request.slot.addr, []).append(i)
        failures: list[str] = []
        unreachable: set[str] = set()
        moved: list[_Request] = []
        results = self._call_brokers(pool, heads, by_addr)
        for addr, outcome in results.items():
            if isinstance(outcome, BrokerUnreachableError):
                # Which of the requests took effect is unknown: resend them all
                # (at-least-once), queue order is still kept.
                failures.append(str(outcome))
                unreachable.add(addr)
                moved.extend(heads[i] for i in by_addr[addr])
                continue
            for i, reply in zip(by_addr[addr], outcome, strict=True):
                request = heads[i]
                if reply.code in _STORED:
                    done[i] = reply
                elif reply.code in _RETRYABLE:
                    failures.append(
                        f"{request.describe()}: broker answered {_code_name(reply.code)}: "
                        f"{reply.remark or 'no remark'}"
                    )
                else:
                    raise SendError(
                        f"send to {request.describe()} refused: {_code_name(reply.code)}: "
                        f"{reply.remark or 'no remark'}"
                    )
        if unreachable:
            self._forget_routes(unreachable)
            self._repoint(moved)
        if failures:
            raise _TransientSendError(
                "; ".join(failures), unreachable_only=len(failures) == len(unreachable)
            )

    def _call_brokers(
        self, pool: ConnectionPool, heads: list[_Request], by_addr: dict[str, list[int]]
    ) -> dict[str, list[RemotingCommand] | BrokerUnreachableError]:
        timeout_s = max(self.settings.request_timeout_s, self.settings.send_timeout_ms / 1000)
        born = str(int(time.time() * 1000))

        def call(addr: str) -> list[RemotingCommand] | BrokerUnreachableError:
            role = f"broker {heads[by_addr[addr][0]].slot.broker_name}"
            if not addr:
                return BrokerUnreachableError(
                    role, "-", "it has no master now (down, or gone from the route)"
                )
            requests = [self._frame(heads[i], born) for i in by_addr[addr]]
            try:
                return pool.get(addr, role).call_many(requests, timeout_s=timeout_s)
            except BrokerUnreachableError as exc:
                return exc

        if len(by_addr) == 1:
            (addr,) = by_addr
            return {addr: call(addr)}
        # Several brokers: one thread per address, so they work at the same time.
        with self._lifecycle:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=8, thread_name_prefix="batch-producer"
                )
            executor = self._executor
        futures = {addr: executor.submit(call, addr) for addr in by_addr}
        return {addr: f.result() for addr, f in futures.items()}

    def _frame(self, request: _Request, born: str) -> tuple[int, dict[str, str], bytes]:
        # SendMessageRequestHeaderV2's one-letter fields. "m" (batch) is what
        # sends the broker down its batch path (SendMessageProcessor checks
        # requestHeader.isBatch(), not the request code); without it the whole
        # encoded batch would be stored as one message.
        fields = {
            "a": self._group,
            "b": request.topic,
            "c": DEFAULT_TOPIC,
            "d": DEFAULT_TOPIC_QUEUES,
            "e": str(request.slot.queue_id),
            "f": "0",  # sys flag: not compressed, not transactional
            "g": born,
            "h": "0",
            "j": "0",
            "k": "false",
            "m": "true",
            "n": request.slot.broker_name,
        }
        if request.single is None:
            return RequestCode.SEND_BATCH_MESSAGE, fields, b"".join(request.entries)
        # A message too large for a batch of one: the broker checks only its body
        # against maxMessageSize (MessageExtEncoder.encode(MessageExtBrokerInner)).
        # Its properties go in the header ("i"), with its own UNIQ_KEY as in a batch.
        # (A caller's property named like a reserved one -- DELAY, TIMER_*,
        # TRAN_MSG -- takes effect on this path; a batch stores it verbatim.)
        body, properties = request.single
        return RequestCode.SEND_MESSAGE_V2, {**fields, "i": properties, "m": "false"}, body

    @staticmethod
    def _record(
        request: _Request, reply: RemotingCommand, receipts: list[SendReceipt | None]
    ) -> None:
        try:
            first = int(reply.ext_fields["queueOffset"])
            stored_in = int(reply.ext_fields.get("queueId", request.slot.queue_id))
        except (KeyError, ValueError) as exc:
            raise SendError(
                f"send to {request.describe()}: the broker's answer has no queue offset "
                f"({reply.ext_fields})"
            ) from exc
        if stored_in != request.slot.queue_id:
            raise SendError(
                f"send to {request.describe()}: the broker stored it in queue {stored_in}"
            )
        # The broker stores a batch contiguously and answers with the offset of
        # its first message (CommitLog's batch append: beginQueueOffset).
        broker = request.slot.broker_name
        for j, position in enumerate(request.positions):
            receipts[position] = SendReceipt(
                request.topic, request.index, first + j, request.msg_ids[j], broker
            )


def own_properties(m: OutgoingMessage) -> bytes:
    """The encoded property string of ``m`` without its UNIQ_KEY; raises InvalidMessageError.

    Hand-built (it runs once per message sent): the user's properties, then
    KEYS and TAGS, which win over same-named user properties as in Producer.
    """
    key, tags, user = m.key, m.tags, m.properties
    if user and (PROPERTY_KEYS in user or PROPERTY_TAGS in user or PROPERTY_UNIQ_KEY in user):
        user = {
            k: v
            for k, v in user.items()
            if not (
                (k == PROPERTY_KEYS and key is not None)
                or (k == PROPERTY_TAGS and tags is not None)
                or k == PROPERTY_UNIQ_KEY
            )
        }
    try:
        text = encode_properties(user) if user else ""
    except ValueError as exc:
        raise InvalidMessageError(f"message for topic {m.topic!r}: {exc}") from exc
    if key is not None:
        _check_value(m.topic, "key", key)
        text += f"{PROPERTY_KEYS}\x01{key}\x02"
    if tags is not None:
        _check_value(m.topic, "tags", tags)
        text += f"{PROPERTY_TAGS}\x01{tags}\x02"
    try:
        encoded = text.encode()
    except UnicodeEncodeError as exc:
        bad = ascii(exc.object[exc.start : exc.end])
        raise InvalidMessageError(
            f"message for topic {m.topic!r}: its key, tags or properties hold {bad}, which "
            "is not valid UTF-8 (a lone surrogate); remove it before sending"
        ) from exc
    if len(encoded) > MAX_OWN_PROPERTIES_BYTES:
        raise InvalidMessageError(
            f"message for topic {m.topic!r}: its key, tags and properties take {len(encoded)} "
            f"bytes, over the {MAX_OWN_PROPERTIES_BYTES} a RocketMQ broker stores with a "
            "message (32767 in all); shorten the key or send fewer or shorter properties"
        )
    return encoded


def _check_value(topic: str, name: str, value: str) -> None:
    if NAME_VALUE_SEPARATOR in value or PROPERTY_SEPARATOR in value:
        shown = value if len(value) <= 60 else value[:57] + "..."
        raise InvalidMessageError(
            f"message for topic {topic!r}: its {name} {shown!r} must not contain "
            "\\x01 or \\x02 (RocketMQ's property separators)"
        )


def _code_name(code: int) -> str:
    name = _STORED.get(code) or _RETRYABLE.get(code) or _KNOWN_PERMANENT.get(code)
    return f"code {code} ({name})" if name else f"code {code}"
