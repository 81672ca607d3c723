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
  commit per queue and key in flight at a time (the rest in parallel), in the
  order it was given: a key gets its messages in that order.
- A batch cannot be transactional: each half message is its own request
  (pipelined, :data:`_IN_FLIGHT` at a time per broker: more than a broker's
  send queue serves in 200 ms makes it answer "broker busy").
- A transaction its producer never ended (it died) is resolved by the
  broker's check-back, answered by ``transaction_checks.CheckResponder``.

Example::

    >>> with BatchProducer(settings) as producer:  # doctest: +SKIP
    ...     tx = TransactionalSender(producer, "wordcount-sink")
    ...     prepared = tx.prepare([OutgoingMessage("counts", b"3", key="apple")])
    ...     tx.commit(prepared)  # now a consumer of "counts" sees it
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

from stream_assets.rocketmq.batch_producer import (
    DEFAULT_TOPIC,
    DEFAULT_TOPIC_QUEUES,
    BatchProducer,
    check_message,
    own_properties,
)
from stream_assets.rocketmq.discarded import Discarded
from stream_assets.rocketmq.errors import SendError
from stream_assets.rocketmq.message_codec import PROPERTY_UNIQ_KEY, encode_properties
from stream_assets.rocketmq.records import OutgoingMessage, checked_body
from stream_assets.rocketmq.remoting import RemotingCommand, RequestCode

#: The properties that make a message a half message (MessageConst).
PROPERTY_TRANSACTION_PREPARED = "TRAN_MSG"
PROPERTY_PRODUCER_GROUP = "PGROUP"
#: sysFlag bit (MessageSysFlag) of a prepared message.
_PREPARED = 4
#: A half message's window for its producer's end (MessageConst): the broker refuses
#: a producer's commit or rollback after it (ILLEGAL_OPERATION) and checks it only
#: after it, so the producer and the check-back never both commit it.
PROPERTY_END_WINDOW = "CHECK_IMMUNITY_TIME_IN_SECONDS"
_ILLEGAL_OPERATION = 604
#: Requests (half sends, ends) one call pipelines to a broker before it waits for their
#: replies.
_IN_FLIGHT = 512


class EndWindowClosedError(SendError):
    """The broker refused an end of transaction that came after the message's window
    (:data:`PROPERTY_END_WINDOW`): from now on only its check-back decides it."""


class Outcome(IntEnum):
    """What an ``END_TRANSACTION`` asks of a half message (MessageSysFlag's values)."""

    #: Only as an answer to a check: the broker asks again at its next check.
    UNKNOWN = 0
    COMMIT = 8
    ROLLBACK = 12


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
    #: What it is kept in order with in its queue: its route key (None: the queue).
    order_key: str | None = None


def end_transaction_fields(
    prepared: Prepared, group: str, outcome: Outcome, from_check: bool = False
) -> dict[str, str]:
    """The ``END_TRANSACTION`` header for ``prepared`` (the broker finds the half
    message by its commit-log offset and checks the group and the half-queue offset).

    ``topic`` is the real topic: ACL 2.0 checks the sender may publish to it.
    """
    return {
        "topic": prepared.topic,
        "producerGroup": group,
        "tranStateTableOffset": str(prepared.tran_state_offset),
        "commitLogOffset": str(prepared.commit_log_offset),
        "commitOrRollback": str(int(outcome)),
        "fromTransactionCheck": str(from_check).lower(),
        "msgId": prepared.msg_id,
        "transactionId": prepared.msg_id,
        "bname": prepared.broker_name,
    }


class TransactionalSender:
    """Half messages through a started :class:`BatchProducer`'s routes and connections.

    ``group``: the producer group the half messages name (``PGROUP``); the
    broker accepts an end of transaction only from that group, and a
    check-back goes to any producer of it, so give each sink its own.
    """

    def __init__(self, producer: BatchProducer, group: str) -> None:
        self.producer = producer
        self.group = group

    def prepare(
        self, messages: Sequence[OutgoingMessage], properties: Mapping[str, str] | None = None
    ) -> list[Prepared]:
        """Store ``messages`` as half messages, queues chosen as :meth:`BatchProducer.send_all`
        chooses them; one :class:`Prepared` each, in order. ``properties`` go on every one
        (what a check-back decides by).

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
            half = {
                PROPERTY_TRANSACTION_PREPARED: "true",
                PROPERTY_PRODUCER_GROUP: self.group,
                PROPERTY_UNIQ_KEY: msg_id,
                **(properties or {}),
            }
            wire_properties = own_properties(m).decode() + encode_properties(half)
            fields = {
                "a": self.group,
                "b": m.topic,
                "c": DEFAULT_TOPIC,
                "d": DEFAULT_TOPIC_QUEUES,
                "e": str(queue_id),
                "f": str(_PREPARED),
                "g": born,
                "h": "0",
                "i": wire_properties,
                "j": "0",
                "k": "false",
                "m": "false",
                "n": broker,
            }
            order_key = m.route_key if m.route_key is not None else m.key
            places.append((m.topic, index, broker, addr, queue_id, msg_id, order_key))
            by_addr.setdefault(addr, []).append(
                (position, (RequestCode.SEND_MESSAGE_V2, fields, body))
            )
        prepared: list[Prepared | None] = [None] * len(messages)
        failures = []
        for addr, requests in by_addr.items():
            replies = self._call(addr, [r for _, r in requests])
            for (position, _), reply in zip(requests, replies, strict=True):
                topic, index, broker, _addr, queue_id, msg_id, order_key = places[position]
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
                    order_key,
                )
        if failures:
            self.rollback([p for p in prepared if p is not None])
            raise SendError(f"half messages not stored: {'; '.join(failures[:3])}")
        return [p for p in prepared if p is not None]

    def commit(self, prepared: Sequence[Prepared]) -> None:
        """Make ``prepared`` visible, in the order given wherever it matters: per queue
        and order key (one commit of each in flight at a time; messages without a key
        keep their queue's order). Raises :class:`SendError` if a broker refuses one;
        the ones before it, and other queues' and keys', are committed.

        A step's results have one message per result key and sink, so its whole
        commit is one round trip per broker.
        """
        queues: dict[tuple[str, str, int, str | None], list[Prepared]] = {}
        for p in prepared:
            queues.setdefault((p.topic, p.broker_name, p.queue_id, p.order_key), []).append(p)
        turn = 0
        while True:
            wave = [q[turn] for q in queues.values() if turn < len(q)]
            if not wave:
                return
            self._end(wave, Outcome.COMMIT)
            turn += 1

    def rollback(self, prepared: Sequence[Prepared]) -> None:
        """Drop ``prepared``: no consumer ever sees them."""
        self._end(prepared, Outcome.ROLLBACK)

    def resend(self, discarded: Sequence[Discarded]) -> None:
        """Deliver half messages the broker discarded, as plain messages to their queues,
        in the order given (:mod:`~stream_assets.rocketmq.discarded`); all stored when it
        returns."""
        messages = []
        for d in discarded:
            q = d.queue
            messages.append(d.resent(self.producer.index_of(q.topic, q.broker_name, q.queue_id)))
        self.producer.send_all(messages)

    def _end(self, prepared: Sequence[Prepared], outcome: Outcome) -> None:
        by_addr: dict[str, list[Prepared]] = {}
        for p in prepared:
            by_addr.setdefault(p.addr, []).append(p)
        for addr, ends in by_addr.items():
            requests: list[tuple[int, dict[str, str], bytes]] = [
                (RequestCode.END_TRANSACTION, end_transaction_fields(p, self.group, outcome), b"")
                for p in ends
            ]
            for p, reply in zip(ends, self._call(addr, requests), strict=True):
                if reply.code != 0:
                    what = "commit" if outcome == Outcome.COMMIT else "rollback"
                    late = reply.code == _ILLEGAL_OPERATION
                    raise (EndWindowClosedError if late else SendError)(
                        f"{what} of {p.msg_id} ({p.topic} queue {p.queue_id} on "
                        f"{p.broker_name}) refused: {_said(reply)}"
                    )

    def _call(
        self, addr: str, requests: list[tuple[int, dict[str, str], bytes]]
    ) -> list[RemotingCommand]:
        # At most _IN_FLIGHT at a time: a broker whose send queue holds a request longer
        # than its waitTimeMillsInSendQueue (200 ms) answers "broker busy" (flow control),
        # which a step of 10 000 pipelined half messages meets on a 2-core machine.
        conn = self.producer.pool.get(addr, "broker")
        timeout_s = self.producer.settings.request_timeout_s
        replies: list[RemotingCommand] = []
        for start in range(0, len(requests), _IN_FLIGHT):
            replies += conn.call_many(requests[start : start + _IN_FLIGHT], timeout_s=timeout_s)
        return replies


def _said(reply: RemotingCommand) -> str:
    return f"code {reply.code}: {reply.remark or 'no remark'}"
