"""Terminal outputs of a stage (sinks, print) and dead letters, through a Sender.

Sinks are at-least-once: a batch replayed after a crash sends its outputs
again. Every output message therefore has a deterministic key, ``job/operator/
<origin>/<position>``, the same for a replayed copy and different for any
other output, so consumers can de-duplicate. The origin is the source record
(``topic/queue/offset``) before an aggregate, the result after one: window
and key, or for an unwindowed aggregate the key and its version
(``<result key>/v<version>``, see :mod:`~stream_assets.runtime.core.keyed.results`); the
position tells apart the outputs of one origin (a ``flat_map``, several sinks).
The sink queue is chosen by ``route_key``: the result key after an aggregate,
so one queue holds every update of a key in order; the source queue before
one, so a sink queue keeps each source queue's order.

No record can fail a batch here: every key part is bounded (:func:`message_key`
shortens a long one), and a message the broker would still refuse (a body over
the size limit, properties it cannot store) raises in ``Sender.send`` while
this record is handled, so it becomes this record's dead letter. Dead letters
themselves are always sendable (:func:`dead_letter`).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from stream_assets.plan import nodes as n
from stream_assets.rocketmq.records import Record, checked_body
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.core.ports import Sender

_PROPERTY_MAX = 400
#: UTF-8 bytes a part of a message key keeps once percent-encoded; a longer part
#: is shortened (:func:`message_key`). Far below what RocketMQ stores with a
#: message (32767 bytes of properties, keys included), so a sink key, which
#: holds a few parts, always fits next to tags and properties.
MAX_KEY_PART_BYTES = 512
#: Hex digits of the SHA-256 that stands for a shortened part (128 bits).
_DIGEST_HEX = 32


class StageOutputs:
    """Sends a stage's sink/print outputs; ``origin`` names what produced them."""

    def __init__(self, ctx: StageContext, sender: Sender, stats: TaskStats) -> None:
        self.ctx = ctx
        self.sender = sender
        self.stats = stats
        #: The key parts naming what fed the graph: ``("topic/queue/offset",)`` for
        #: a source record; for a result, its window or version and its result key
        #: as parts of their own, so a long result key is shortened alone.
        self.origin: tuple[str, ...] = ()
        #: What chooses the sink queue (by stable hash); None: the message key.
        self.route_key: str | None = None
        self._seq = 0
        self._last_origin: tuple[str, ...] = ()
        # Escaped once, not per output (the escaping was a tenth of emitting a result):
        # each node's ``job/op`` and the current origin's parts.
        self._prefixes: dict[str, str] = {}
        self._origin_key = ""

    def emit(self, node: n.Node, value: Any, ts: int) -> None:
        """An output of the graph fed by ``origin`` (a source record or a result key)."""
        if self.origin != self._last_origin:
            self._last_origin, self._seq = self.origin, 0
            self._origin_key = f"/{message_key(*self.origin)}" if self.origin else ""
        prefix = self._prefixes.get(node.op_id)
        if prefix is None:
            prefix = self._prefixes[node.op_id] = message_key(self.ctx.job_id, node.op_id)
        # The same key as message_key(job, op, *origin, seq): a number needs no escaping.
        key = f"{prefix}{self._origin_key}/{self._seq}"
        self._seq += 1
        if isinstance(node, n.Sink):
            # Checked here, not at the flush: a body the broker cannot take is
            # this record's dead letter, not the whole batch's failure (the
            # sender checks key, tags and properties as it queues them).
            body = checked_body(node.topic, node.serializer(value), self.ctx.max_message_size)
            route_key = self.route_key
            if node.key is not None:
                user_key = str(node.key(value))
                # The user's key first (what consumers look up), the engine's
                # de-duplication key last; the sink queue follows the user's key.
                key = f"{message_key(user_key)} {key}"
                route_key = user_key
            tags = None if node.tags is None else _property(str(node.tags(value)))
            properties = None
            if node.properties is not None:
                given = node.properties(value)
                if not isinstance(given, Mapping):
                    raise TypeError(
                        f"sink properties must be a dict of str, got {type(given).__name__}"
                    )
                properties = {str(k): _property(str(v)) for k, v in given.items()}
            self.sender.send(
                node.topic,
                body,
                key=key,
                route_key=route_key,
                tags=tags,
                properties=properties,
            )
        elif isinstance(node, n.Print):
            print(value, file=sys.stdout, flush=False)
        self.stats.outputs += 1

    def flush(self) -> None:
        """Flush printed output."""
        sys.stdout.flush()


def message_key(*parts: str) -> str:
    """A message key RocketMQ stores as one key: parts joined by ``/``.

    RocketMQ splits message keys at whitespace, so a result key like
    ``new york`` would otherwise arrive as two keys: whitespace, unprintable
    characters and ``%`` itself are percent-encoded; everything else is kept.

    A part over :data:`MAX_KEY_PART_BYTES` (512) UTF-8 bytes once encoded is
    shortened, deterministically: its first bytes (up to 479, cut at a
    character and outside a ``%XX`` escape), ``~``, and the first 32 hex
    digits of the SHA-256 of the whole encoded part. The same part always
    gives the same key and two different parts different keys (a collision
    needs a SHA-256 collision on 128 bits), so de-duplication by key still
    works; the other parts (a version, a position) stay readable.

    >>> message_key("wc", "sink-4", "new york", "0"), message_key("café\\x01%")
    ('wc/sink-4/new%20york/0', 'café%01%25')
    >>> long = message_key("wc", "x" * 40_000, "v7")
    >>> len(long), long[:6], long[-38:]
    (518, 'wc/xxx', 'xx~6285332e3072b27e5b095c5c7d6e37ea/v7')
    """
    return "/".join(_key_part(part) for part in parts)


def _key_part(part: str) -> str:
    # The common case (printable ASCII, no blank, no %) in C-speed checks: the
    # character loop was most of a passthrough task's time.
    if part.isascii() and part.isprintable() and " " not in part and "%" not in part:
        return part if len(part) <= MAX_KEY_PART_BYTES else _shortened(part)
    # surrogatepass: a lone surrogate (valid in a Python str, not in UTF-8) is
    # escaped like any other unprintable character instead of raising.
    encoded = "".join(
        quote(c, errors="surrogatepass") if c.isspace() or not c.isprintable() or c == "%" else c
        for c in part
    )
    if len(encoded.encode()) <= MAX_KEY_PART_BYTES:
        return encoded
    return _shortened(encoded)


def _shortened(encoded: str) -> str:
    """A percent-encoded part cut to :data:`MAX_KEY_PART_BYTES`: prefix, ``~``, digest."""
    raw = encoded.encode()
    digest = hashlib.sha256(raw).hexdigest()[:_DIGEST_HEX]
    # Cut at a character boundary ("ignore" drops only a split last character) ...
    prefix = raw[: MAX_KEY_PART_BYTES - 1 - _DIGEST_HEX].decode("utf-8", "ignore")
    # ... and not inside a %XX escape, so the prefix still percent-decodes.
    escape = prefix.rfind("%", len(prefix) - 2)
    if escape != -1:
        prefix = prefix[:escape]
    return f"{prefix}~{digest}"


def dead_letter(
    ctx: StageContext,
    sender: Sender,
    stats: TaskStats,
    record: Record,
    op_id: str,
    exc: BaseException,
    position: str | None = None,
) -> None:
    """Send a record that failed in ``op_id`` to the dead-letter topic, with the reason.

    Keyed by the record's position (or ``position``, e.g. the origin of one
    entry of a shuffle message), so a replayed batch's copy de-duplicates and
    two different failures never share a key.

    A dead letter can never be refused itself, or its batch would fail on
    every retry: the key is bounded (:func:`message_key`), the properties are
    cleaned and cut, and a body over the broker's limit is cut to it (an empty
    one sent as one zero byte); then ``original_bytes`` says how long the body was.
    """
    body = record.body
    properties = {
        "reason": _property(_reason(exc)),
        "operator": _property(op_id),
        "source_topic": _property(record.topic),
        "source_queue": str(record.queue_id),
        "source_offset": str(record.queue_offset),
    }
    if not body or len(body) > ctx.max_message_size:
        properties["original_bytes"] = str(len(body))
        body = body[: ctx.max_message_size] or b"\x00"
    sender.send(
        ctx.dead_letter_topic,
        body,
        key=message_key(position or f"{record.topic}/{record.queue_id}/{record.queue_offset}"),
        properties=properties,
    )
    stats.dead_letters += 1


def _reason(exc: BaseException) -> str:
    """``Type: message``, even for an exception whose ``__str__`` itself fails."""
    try:
        text = str(exc)
    except Exception:
        text = f"<{type(exc).__name__} whose str() failed>"
    return f"{type(exc).__name__}: {text}"


def _property(text: str) -> str:
    """``text`` as a property value RocketMQ stores unchanged: no separators, valid UTF-8, cut."""
    clean = text.replace("\x01", " ").replace("\x02", " ")
    if not clean.isascii():
        # A lone surrogate cannot be UTF-8 encoded: it is written as the text \udc80.
        clean = clean.encode("utf-8", "backslashreplace").decode("utf-8")
    return clean[:_PROPERTY_MAX]
