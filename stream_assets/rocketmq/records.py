"""What the data plane hands out: one stored message, as read from a queue."""

from __future__ import annotations

from dataclasses import dataclass, field

from stream_assets.rocketmq.errors import MessageTooLargeError


# Not frozen, though nothing may change a record: a frozen dataclass sets each field
# through object.__setattr__ (1.1 against 0.25 us a record), a fifth of decoding a
# pulled message, which every record of every source and shuffle queue pays.
@dataclass(slots=True)
class Record:
    """One message of one queue, with its position and broker timestamps; read-only.

    ``body`` is the exact bytes that were sent (never decoded). ``keys`` are
    the message keys (RocketMQ allows several, space-separated on the wire).

    Example::

        >>> r = Record("t", 0, 7, b"\\xff\\x00", keys=("k",))
        >>> (r.queue_id, r.queue_offset, r.body)
        (0, 7, b'\\xff\\x00')
    """

    topic: str
    queue_id: int
    queue_offset: int
    body: bytes
    keys: tuple[str, ...] = ()
    tags: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    born_timestamp: int = 0
    store_timestamp: int = 0
    msg_id: str = ""

    @property
    def key(self) -> str | None:
        """The first message key, or None."""
        return self.keys[0] if self.keys else None


@dataclass(frozen=True, slots=True)
class SendReceipt:
    """Where a sent message was stored.

    ``queue_id`` is the queue *index* the producer chose (``queue_id`` given,
    key hash, round-robin) over the topic's queues in layout order; with one
    broker group that is the queue's id. ``broker_name`` says which group
    stored it ("" where the client does not tell).
    """

    topic: str
    queue_id: int
    queue_offset: int
    msg_id: str
    broker_name: str = ""


@dataclass(slots=True)  # not frozen, as Record: one is made per result a keyed step sends
class OutgoingMessage:
    """One message to send, and how its queue is chosen; read-only once made.

    The queue is ``queue_id`` if given, else the stable hash of ``route_key``
    (default: ``key``), else round-robin. ``route_key`` lets a message carry a
    unique key (for de-duplication) while going to the queue of a result key,
    so one queue holds all updates of that key in order.

    Example::

        >>> m = OutgoingMessage("counts", b"3", key="wc/apple/7", route_key="apple")
        >>> m.queue_id is None and m.route_key
        'apple'
    """

    topic: str
    body: bytes
    key: str | None = None
    tags: str | None = None
    properties: dict[str, str] | None = None
    queue_id: int | None = None
    route_key: str | None = None


def checked_body(topic: str, body: object, max_size: int) -> bytes:
    """``body`` as bytes, or the error every sender of the project raises for it.

    ``max_size`` is ``RocketMQSettings.max_message_size``, the broker's
    maxMessageSize: the broker checks a message's body against it, so bodies
    up to it are accepted and a longer one raises :class:`MessageTooLargeError`
    naming its size and that limit.

    >>> checked_body("t", bytearray(b"x"), 10)
    b'x'
    >>> try:
    ...     checked_body("t", b"xyz", 2)
    ... except MessageTooLargeError as e:
    ...     (e.size, e.limit, "STREAM_ASSETS_ROCKETMQ_MAX_MESSAGE_SIZE" in str(e))
    (3, 2, True)
    """
    if type(body) is not bytes:
        if not isinstance(body, bytearray | memoryview):
            raise TypeError(f"message body must be bytes, got {type(body).__name__}")
        body = bytes(body)
    if not body:
        raise ValueError(f"message for topic {topic!r}: RocketMQ rejects an empty body")
    if len(body) > max_size:
        raise MessageTooLargeError(topic, len(body), max_size)
    return body
