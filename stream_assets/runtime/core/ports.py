"""The small interfaces the per-queue core talks to (no Spark, no sockets behind them).

The core (:mod:`~stream_assets.runtime.core.stage0.stateless`,
:mod:`~stream_assets.runtime.core.keyed.batch`)
reads records it is handed, writes through a :class:`Sender` and keeps state in
a :class:`~stream_assets.state.store.QueueStateStore`. The Spark adapter
(:mod:`~stream_assets.runtime.spark.task`) plugs in a
:class:`~stream_assets.runtime.core.send_buffer.SendBuffer` over the batching
producer; the public test driver (:mod:`stream_assets.testing`) one over
in-memory topics. What a stateful batch reads offsets and records through
(to prove its store current, to restore it) are the state layer's ports:
:mod:`stream_assets.state.ports`.

Example: any object with ``send`` and ``flush`` works::

    >>> class Collect:
    ...     def __init__(self): self.sent = []
    ...     def send(self, topic, body, *, key=None, queue_id=None, properties=None,
    ...              route_key=None, tags=None):
    ...         self.sent.append((topic, body))
    ...     def flush(self): return []
    >>> isinstance(Collect(), Sender)
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from stream_assets.rocketmq.records import SendReceipt


@runtime_checkable
class Sender(Protocol):
    """Queues messages; :meth:`flush` makes every queued one durable.

    ``queue_id`` pins the queue; without it ``route_key`` (default ``key``)
    chooses the queue by its stable hash. Nothing is known to be stored until
    :meth:`flush` returns: the core flushes outputs before it writes the
    changelog, and the changelog checks the offsets in the receipts.
    """

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        key: str | None = None,
        queue_id: int | None = None,
        properties: Mapping[str, str] | None = None,
        route_key: str | None = None,
        tags: str | None = None,
    ) -> None: ...

    def flush(self) -> list[SendReceipt]: ...
