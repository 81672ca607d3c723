"""Queue-level reads: pull one queue from an explicit offset, in batches.

Uses the remoting PULL_MESSAGE call rather than the C++ client's ``Pull``:
the C++ client's C API returns a message body as a NUL-terminated ``char*``
with no length, so any body containing a zero byte comes back truncated
(measured: ``b"ab\\x00cd\\xff"`` reads back as ``b"ab"``). See
docs/rocketmq-client.md.

Example::

    >>> reader = QueueReader(admin, group="my-job")  # doctest: +SKIP
    >>> batch = reader.pull(MessageQueue("orders", "broker-a", 0), offset=0)  # doctest: +SKIP
    >>> [r.queue_offset for r in batch.records][:3]  # doctest: +SKIP
    [0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.errors import BrokerUnreachableError, RemotingError
from stream_assets.rocketmq.message_codec import decode_messages
from stream_assets.rocketmq.records import Record
from stream_assets.rocketmq.remoting import RemotingCommand, RequestCode, ResponseCode
from stream_assets.rocketmq.tags import TagFilter

#: Every message (no tag filter).
_EVERY = TagFilter(None)

_FLAG_SUBSCRIPTION = 0x4  # subscription sent with the request; no group registration needed


class PullStatus(Enum):
    """Outcome of one pull."""

    FOUND = "found"
    NO_NEW_MESSAGES = "no_new_messages"
    OFFSET_ILLEGAL = "offset_illegal"


@dataclass(frozen=True)
class PullBatch:
    """Records of one pull and where the next pull starts."""

    queue: MessageQueue
    status: PullStatus
    records: list[Record]
    next_offset: int
    min_offset: int
    max_offset: int


class QueueReader:
    """Pulls explicit queues from explicit offsets; holds no position of its own.

    ``group`` only names the reader to the broker (its stats); offsets are
    never committed by a pull: commit them with
    :meth:`RocketMQAdmin.commit_consumer_offset` when the work is durable.
    """

    def __init__(self, admin: RocketMQAdmin, group: str, max_batch: int = 1024) -> None:
        self.admin = admin
        self.group = group
        self.max_batch = max_batch
        # A connection of its own so long reads never queue behind admin calls.
        self._pool = admin.new_pool()

    def close(self) -> None:
        """Close the reader's connections."""
        self._pool.close()

    def pull(
        self,
        queue: MessageQueue,
        offset: int,
        max_messages: int | None = None,
        tags: TagFilter = _EVERY,
    ) -> PullBatch:
        """Read up to ``max_messages`` records of ``queue`` starting at ``offset``, only
        those ``tags`` selects (the broker filters; ``next_offset`` passes the rest)."""
        # The master, else the group's slave (which serves pulls alike).
        addr = self.admin.read_addr(queue)
        try:
            reply = self._pull(addr, queue, offset, max_messages, tags)
        except BrokerUnreachableError:
            self.admin.forget_route(queue)
            raise
        fields = reply.ext_fields
        bounds = (
            int(fields.get("nextBeginOffset", offset)),
            int(fields.get("minOffset", 0)),
            int(fields.get("maxOffset", 0)),
        )
        if reply.code == ResponseCode.SUCCESS:
            records = decode_messages(reply.body)
            if tags.tags is not None:
                # The broker matched tag hashes; two tags can share one.
                records = [r for r in records if tags.matches(r.tags)]
            return PullBatch(queue, PullStatus.FOUND, records, *bounds)
        if reply.code in (ResponseCode.PULL_NOT_FOUND, ResponseCode.PULL_RETRY_IMMEDIATELY):
            return PullBatch(queue, PullStatus.NO_NEW_MESSAGES, [], *bounds)
        if reply.code == ResponseCode.PULL_OFFSET_MOVED:
            return PullBatch(queue, PullStatus.OFFSET_ILLEGAL, [], *bounds)
        raise RemotingError(
            f"pull {queue.topic}[{queue.queue_id}] at {offset}", reply.code, reply.remark
        )

    def _pull(
        self,
        addr: str,
        queue: MessageQueue,
        offset: int,
        max_messages: int | None,
        tags: TagFilter,
    ) -> RemotingCommand:
        return self._pool.get(addr, f"broker {queue.broker_name}").call(
            RequestCode.PULL_MESSAGE,
            {
                "consumerGroup": self.group,
                "topic": queue.topic,
                "queueId": str(queue.queue_id),
                "queueOffset": str(offset),
                "maxMsgNums": str(max_messages or self.max_batch),
                "sysFlag": str(_FLAG_SUBSCRIPTION),
                "commitOffset": "0",
                "suspendTimeoutMillis": "0",
                "subscription": tags.expression,
                "subVersion": "0",
                "expressionType": "TAG",
            },
        )

    def read(
        self, queue: MessageQueue, start: int, end: int | None = None, tags: TagFilter = _EVERY
    ) -> Iterator[Record]:
        """Every record of ``queue`` from ``start`` up to ``end`` (default: what is stored
        now), only those ``tags`` selects.

        With ``end`` given, the read never stops short of it: were the broker to serve
        nothing at an offset below it (a slave read while its master is down that does
        not hold the offset yet), a caller would commit records it never saw. It
        raises a :class:`RemotingError` instead, which an engine step rides out.
        """
        stop = self.admin.max_offset(queue) if end is None else end
        offset = start
        while offset < stop:
            batch = self.pull(queue, offset, min(self.max_batch, stop - offset), tags)
            if batch.status is PullStatus.OFFSET_ILLEGAL:
                raise RemotingError(
                    f"read {queue.topic}[{queue.queue_id}] from {offset}",
                    int(ResponseCode.PULL_OFFSET_MOVED),
                    f"offset outside the stored range {batch.min_offset}..{batch.max_offset}",
                )
            if not batch.records:
                if tags.tags is not None and batch.next_offset > offset:
                    offset = batch.next_offset  # all filtered out up to there: read on
                    continue
                if end is None:
                    return  # what the queue held when the read began, all read
                raise RemotingError(
                    f"read {queue.topic}[{queue.queue_id}] on {queue.broker_name} up to {end}",
                    int(ResponseCode.PULL_NOT_FOUND),
                    f"the broker served nothing from offset {offset} (it can be read up to "
                    f"{batch.max_offset}; a slave behind its master?): read again, not cut short",
                )
            for record in batch.records:
                if record.queue_offset >= stop:
                    return
                yield record
            offset = batch.next_offset
