"""Collects a task's sends and makes them durable together, at the points that matter.

The core calls ``send`` as results appear and ``flush`` where order matters:
sink outputs and dead letters are flushed before the changelog is written,
the changelog before the local commit, and everything before a task reports
its offsets. Between flushes nothing waits for the broker; a flush hands the
lot to a transport that batches and pipelines it
(:class:`~stream_assets.rocketmq.batch_producer.BatchProducer`, or the
in-memory broker of :mod:`stream_assets.testing`).

Each message is checked as it is queued
(:func:`~stream_assets.rocketmq.batch_producer.check_message`: body size,
key, tags and properties as a broker takes them), so a message the broker
would refuse raises in ``send``, inside the code handling that one record,
which makes it the record's dead letter; it never fails a flush, which
carries a whole batch.

Example::

    >>> from stream_assets.rocketmq.records import SendReceipt
    >>> class Log:
    ...     def send_all(self, messages):
    ...         return [SendReceipt(m.topic, 0, i, "") for i, m in enumerate(messages)]
    >>> buffer = SendBuffer(Log())
    >>> buffer.send("out", b"a"); buffer.send("out", b"b", key="k")
    >>> [r.queue_offset for r in buffer.flush()], buffer.flush()
    ([0, 1], [])
    >>> try:
    ...     buffer.send("out", b"c", key="k" * 40_000)
    ... except ValueError as exc:
    ...     (type(exc).__name__, buffer.pending)
    ('InvalidMessageError', 0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from stream_assets.rocketmq.batch_producer import check_message
from stream_assets.rocketmq.records import OutgoingMessage, SendReceipt
from stream_assets.settings import DEFAULT_MAX_MESSAGE_SIZE

if TYPE_CHECKING:
    from stream_assets.runtime.core.sink_transactions import StepTransaction


class Transport(Protocol):
    """Sends many messages at once; one receipt per message, in order."""

    def send_all(self, messages: Sequence[OutgoingMessage]) -> list[SendReceipt]: ...


class SendBuffer:
    """A :class:`~stream_assets.runtime.core.ports.Sender` that sends on :meth:`flush`.

    ``max_message_size``: the broker's body limit; default the transport's
    ``max_message_size`` (the batch producer's and the in-memory broker's
    setting), else RocketMQ's default 4 MiB. ``transaction``: a step's
    exactly-once sinks, whose messages a flush prepares instead of sending.
    """

    def __init__(
        self,
        transport: Transport,
        max_message_size: int | None = None,
        transaction: StepTransaction | None = None,
    ) -> None:
        self.transport = transport
        self.transaction = transaction
        if max_message_size is None:
            max_message_size = getattr(transport, "max_message_size", DEFAULT_MAX_MESSAGE_SIZE)
        self.max_message_size: int = max_message_size
        self._pending: list[OutgoingMessage] = []

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
    ) -> None:
        """Queue one message (see :class:`OutgoingMessage` for how its queue is chosen).

        Raises (and queues nothing) for a message the broker would refuse:
        :class:`~stream_assets.rocketmq.batch_producer.InvalidMessageError` for
        its key, tags or properties,
        :class:`~stream_assets.rocketmq.errors.MessageTooLargeError` for its body.
        """
        props = dict(properties) if properties is not None else None
        message = OutgoingMessage(topic, body, key, tags, props, queue_id, route_key)
        self._pending.append(check_message(message, self.max_message_size))

    def flush(self) -> list[SendReceipt]:
        """Send everything queued; returns once it is stored (receipts in send order;
        none for the transaction's messages, which are prepared, not yet in a queue).

        Raises whatever the transport raises; the messages of a failed flush
        are dropped from the buffer (the task fails, and its retry sends anew).
        """
        pending, self._pending = self._pending, []
        tx = self.transaction
        if tx is not None:
            tx.prepare([m for m in pending if tx.takes(m.topic)])
            pending = [m for m in pending if not tx.takes(m.topic)]
        return self.transport.send_all(pending) if pending else []

    @property
    def pending(self) -> int:
        """Messages queued since the last flush."""
        return len(self._pending)
