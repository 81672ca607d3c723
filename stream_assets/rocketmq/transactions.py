"""Transactional (half) messages: stored where no consumer sees them, then committed or rolled back.

RocketMQ's mechanism for output that appears exactly once (issue 33). A half
message is a ``SEND_MESSAGE_V2`` with the properties ``TRAN_MSG=true`` and
``PGROUP`` (the producer group); the broker keeps it in
``RMQ_SYS_TRANS_HALF_TOPIC`` until an ``END_TRANSACTION`` commits it (the broker
then stores it in its real queue) or rolls it back. The wire facts are in
docs/notes/transactions.md; those this module relies on were confirmed
against the 5.3.3 broker (tests/integration/test_transactions.py).

Hand-written: neither Python client on PyPI sends half messages to a chosen
queue, pipelined (docs/notes/transactions.md, section 5).

What a caller must know, because the broker does not hide it:

- **A commit is not idempotent**: every accepted ``END_TRANSACTION`` commit
  stores the message again. Commit each :class:`Prepared` once.
- **The broker stores a commit when it processes it**, and it processes
  concurrent ones in any order. So :meth:`TransactionalSender.commit` has one
  commit per queue in flight at a time (queues in parallel), in the order it
  was given: a queue gets the messages in that order.
- A batch cannot be transactional: each half message is its own request (all
  of them pipelined, one round trip per broker).
- Not built here: the broker's check-back (``CHECK_TRANSACTION_STATE`` to a
  producer of the group) for a transaction its producer never ended.

Example::

    >>> with BatchProducer(settings) as producer:  # doctest: +SKIP
    ...     tx = TransactionalSender(producer, "wordcount-sink")
    ...     prepared = tx.prepare([OutgoingMessage("counts", b"3", key="apple")])
    ...     tx.commit(prepared)  # now a consumer of "counts" sees it
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from stream_assets.rocketmq.batch_producer import (
    DEFAULT_TOPIC,
    DEFAULT_TOPIC_QUEUES,
    BatchProducer,
    check_message,
    own_properties,
)
from stream_assets.rocketmq.errors import SendError
from stream_assets.rocketmq.message_codec import PROPERTY_UNIQ_KEY
from stream_assets.rocketmq.records import OutgoingMessage, checked_body
from stream_assets.rocketmq.remoting import RemotingCommand, RequestCode

#: The properties that make a message a half message (MessageConst).
PROPERTY_TRANSACTION_PREPARED = "TRAN_MSG"
PROPERTY_PRODUCER_GROUP = "PGROUP"
#: sysFlag bits (MessageSysFlag): a prepared message; what END_TRANSACTION asks.
_PREPARED, _COMMIT, _ROLLBACK = 4, 8, 12


@dataclass(frozen=True)
class Prepared:
    """A half message the broker stored: what ``END_TRANSACTION`` names it by."""

    topic: str
    #: The queue it goes to once committed: index in the topic's route, group and id.
    queue_index: int
    broker_name: str
    addr: str
    queue_id: int
    #: Its UNIQ_KEY: the message id a consumer reads once it is committed.
    msg_id: str
    #: Its offset in the broker's half queue, and in its commit log.
    tran_state_offset: int
    commit_log_offset: int


class TransactionalSender:
    """Half messages through a started :class:`BatchProducer`'s routes and connections.

    ``group``: the producer group the half messages name (``PGROUP``); the
    broker accepts an end of transaction only from that group, and a
    check-back goes to any producer of it, so give each sink its own.
    """

    def __init__(self, producer: BatchProducer, group: str) -> None:
        self.producer = producer
        self.group = group

    def prepare(self, messages: Sequence[OutgoingMessage]) -> list[Prepared]:
        """Store ``messages`` as half messages, queues chosen as :meth:`BatchProducer.send_all`
        chooses them; one :class:`Prepared` each, in order.

        Raises :class:`SendError` if a broker does not store one; those it
        stored are rolled back first, so nothing of a failed call is left.
        """
        limit = self.producer.max_message_size
        born = str(int(time.time() * 1000))
        by_addr: dict[str, list[tuple[int, tuple[int, dict[str, str], bytes]]]] = {}
        places = []
        for position, message in enumerate(messages):
            m = check_message(message, limit)
            body = checked_body(m.topic, m.body, limit)
            index, broker, addr, queue_id = self.producer.place(m)
            msg_id = self.producer.next_msg_id()
            properties = own_properties(m).decode() + (
                f"{PROPERTY_TRANSACTION_PREPARED}\x01true\x02"
                f"{PROPERTY_PRODUCER_GROUP}\x01{self.group}\x02"
                f"{PROPERTY_UNIQ_KEY}\x01{msg_id}\x02"
            )
            fields = {
                "a": self.group,
                "b": m.topic,
                "c": DEFAULT_TOPIC,
                "d": DEFAULT_TOPIC_QUEUES,
                "e": str(queue_id),
                "f": str(_PREPARED),
                "g": born,
                "h": "0",
                "i": properties,
                "j": "0",
                "k": "false",
                "m": "false",
                "n": broker,
            }
            places.append((m.topic, index, broker, addr, queue_id, msg_id))
            by_addr.setdefault(addr, []).append(
                (position, (RequestCode.SEND_MESSAGE_V2, fields, body))
            )
        prepared: list[Prepared | None] = [None] * len(messages)
        failures = []
        for addr, requests in by_addr.items():
            replies = self._call(addr, [r for _, r in requests])
            for (position, _), reply in zip(requests, replies, strict=True):
                topic, index, broker, _addr, queue_id, msg_id = places[position]
                if reply.code != 0:
                    failures.append(f"{topic} queue {queue_id} on {broker}: {_said(reply)}")
                    continue
                prepared[position] = Prepared(
                    topic,
                    index,
                    broker,
                    addr,
                    queue_id,
                    msg_id,
                    int(reply.ext_fields["queueOffset"]),
                    # The offset message id: store host and port, then the 8-byte
                    # commit-log offset (MessageDecoder.createMessageId).
                    int(reply.ext_fields["msgId"][-16:], 16),
                )
        if failures:
            self.rollback([p for p in prepared if p is not None])
            raise SendError(f"half messages not stored: {'; '.join(failures[:3])}")
        return [p for p in prepared if p is not None]

    def commit(self, prepared: Sequence[Prepared]) -> None:
        """Make ``prepared`` visible, each queue's in the order given (one commit per
        queue in flight at a time). Raises :class:`SendError` if a broker refuses one;
        the ones before it, and other queues', are committed."""
        queues: dict[tuple[str, str, int], list[Prepared]] = {}
        for p in prepared:
            queues.setdefault((p.topic, p.broker_name, p.queue_id), []).append(p)
        turn = 0
        while True:
            wave = [q[turn] for q in queues.values() if turn < len(q)]
            if not wave:
                return
            self._end(wave, _COMMIT)
            turn += 1

    def rollback(self, prepared: Sequence[Prepared]) -> None:
        """Drop ``prepared``: no consumer ever sees them."""
        self._end(prepared, _ROLLBACK)

    def _end(self, prepared: Sequence[Prepared], kind: int) -> None:
        by_addr: dict[str, list[Prepared]] = {}
        for p in prepared:
            by_addr.setdefault(p.addr, []).append(p)
        for addr, ends in by_addr.items():
            requests: list[tuple[int, dict[str, str], bytes]] = [
                (
                    RequestCode.END_TRANSACTION,
                    {
                        "topic": p.topic,
                        "producerGroup": self.group,
                        "tranStateTableOffset": str(p.tran_state_offset),
                        "commitLogOffset": str(p.commit_log_offset),
                        "commitOrRollback": str(kind),
                        "fromTransactionCheck": "false",
                        "msgId": p.msg_id,
                        "transactionId": p.msg_id,
                        "bname": p.broker_name,
                    },
                    b"",
                )
                for p in ends
            ]
            for p, reply in zip(ends, self._call(addr, requests), strict=True):
                if reply.code != 0:
                    what = "commit" if kind == _COMMIT else "rollback"
                    raise SendError(
                        f"{what} of {p.msg_id} ({p.topic} queue {p.queue_id} on "
                        f"{p.broker_name}) refused: {_said(reply)}"
                    )

    def _call(
        self, addr: str, requests: list[tuple[int, dict[str, str], bytes]]
    ) -> list[RemotingCommand]:
        conn = self.producer.pool.get(addr, "broker")
        return conn.call_many(requests, timeout_s=self.producer.settings.request_timeout_s)


def _said(reply: RemotingCommand) -> str:
    return f"code {reply.code}: {reply.remark or 'no remark'}"
