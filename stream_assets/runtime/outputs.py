"""Terminal outputs of a stage (sinks, print) and dead letters, through a Sender.

Sinks are at-least-once: a batch replayed after a crash sends its outputs
again. Every output message therefore has a deterministic key, ``job/operator/
<origin>/<position>``, the same for a replayed copy and different for any
other output, so consumers can de-duplicate. The origin is the source record
(``topic/queue/offset``) before an aggregate, the result after one: window
and key, or for an unwindowed aggregate the key and its version
(``<result key>/v<version>``, see :mod:`~stream_assets.runtime.stateful`); the
position tells apart the outputs of one origin (a ``flat_map``, several sinks).
The sink queue is chosen by ``route_key``: the result key after an aggregate,
so one queue holds every update of a key in order; the source queue before
one, so a sink queue keeps each source queue's order.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from stream_assets.plan import nodes as n
from stream_assets.rocketmq.records import Record, checked_body
from stream_assets.runtime.context import StageContext, TaskStats
from stream_assets.runtime.ports import Sender

_PROPERTY_MAX = 400


class StageOutputs:
    """Sends a stage's sink/print outputs; ``origin`` names what produced them."""

    def __init__(self, ctx: StageContext, sender: Sender, stats: TaskStats) -> None:
        self.ctx = ctx
        self.sender = sender
        self.stats = stats
        self.origin = ""
        #: What chooses the sink queue (by stable hash); None: the message key.
        self.route_key: str | None = None
        self._seq = 0
        self._last_origin = ""

    def emit(self, node: n.Node, value: Any, ts: int) -> None:
        """An output of the graph fed by ``origin`` (a source record or a result key)."""
        if self.origin != self._last_origin:
            self._last_origin, self._seq = self.origin, 0
        key = message_key(self.ctx.job_id, node.op_id, self.origin, str(self._seq))
        self._seq += 1
        if isinstance(node, n.Sink):
            # Checked here, not at the flush: a body the broker cannot take is
            # this record's dead letter, not the whole batch's failure.
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

    >>> message_key("wc", "sink-4", "new york", "0"), message_key("café\\x01%")
    ('wc/sink-4/new%20york/0', 'café%01%25')
    """
    return "/".join(_key_part(part) for part in parts)


def _key_part(part: str) -> str:
    # The common case (printable ASCII, no blank, no %) in C-speed checks: the
    # character loop was most of a passthrough task's time.
    if part.isascii() and part.isprintable() and " " not in part and "%" not in part:
        return part
    return "".join(quote(c) if c.isspace() or not c.isprintable() or c == "%" else c for c in part)


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
    """
    sender.send(
        ctx.dead_letter_topic,
        record.body,
        key=message_key(position or f"{record.topic}/{record.queue_id}/{record.queue_offset}"),
        properties={
            "reason": _property(f"{type(exc).__name__}: {exc}"),
            "operator": op_id,
            "source_topic": record.topic,
            "source_queue": str(record.queue_id),
            "source_offset": str(record.queue_offset),
        },
    )
    stats.dead_letters += 1


def _property(text: str) -> str:
    # Property values cannot hold RocketMQ's separators (\x01, \x02).
    clean = text.replace("\x01", " ").replace("\x02", " ")
    return clean[:_PROPERTY_MAX]
