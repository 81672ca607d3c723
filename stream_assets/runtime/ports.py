"""The small interfaces the per-queue core talks to (no Spark, no sockets behind them).

The core (:mod:`~stream_assets.runtime.stateless`, :mod:`~stream_assets.runtime.stateful`)
reads records it is handed, writes through a :class:`Sender` and keeps state in
a :class:`~stream_assets.state.store.QueueStateStore`. The Spark adapter
(:mod:`~stream_assets.runtime.spark_task`) plugs in the real producer and the
broker-backed reader; the public test driver (:mod:`stream_assets.testing`)
plugs in in-memory topics.

Example: any object with ``send`` works::

    >>> from stream_assets.rocketmq.records import SendReceipt
    >>> class Collect:
    ...     def __init__(self): self.sent = []
    ...     def send(self, topic, body, *, key=None, queue_id=None, properties=None):
    ...         self.sent.append((topic, body))
    ...         return SendReceipt(topic, queue_id or 0, len(self.sent) - 1, "")
    >>> isinstance(Collect(), Sender)
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from stream_assets.rocketmq.records import SendReceipt


@runtime_checkable
class Sender(Protocol):
    """Sends one message and says where it was stored (a producer, or a list in tests).

    ``queue_id`` pins the queue; without it ``key`` chooses the queue by its
    stable hash. The receipt's offset is what the changelog's
    compare-and-append checks.
    """

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        key: str | None = None,
        queue_id: int | None = None,
        properties: Mapping[str, str] | None = None,
    ) -> SendReceipt: ...
