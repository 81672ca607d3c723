"""Half messages the broker gave up on, and the plain messages that take their place.

A half message still unresolved after ``transactionCheckMax`` check-backs is
*discarded*: the broker stores a copy in ``TRANS_CHECK_MAX_TIME_TOPIC`` (queue 0
of its own broker; body, flag and every property kept, the real topic and queue
in ``REAL_TOPIC`` / ``REAL_QID``, its id in ``UNIQ_KEY``) and never delivers it.
That happens only when no producer of its group answered for that long (every
instance of a job stopped after a crash for an hour on our brokers). Its step
had committed (the next step waits only for a landed step's messages), so the
message is due: :meth:`Discarded.resent` is the plain message that delivers it,
to the same queue, carrying the original id in :data:`PROPERTY_ORIGINAL_ID`, so
a reader looking for the step's ids finds either (and a re-send that died
half-way is not repeated for what it delivered).

Behaviour read in RocketMQ 5.3.3's ``DefaultTransactionalMessageCheckListener``
and proven in tests/integration/test_transactions.py.

Example::

    >>> from stream_assets.rocketmq.records import Record
    >>> copy = Record(DISCARD_TOPIC, 0, 7, b"3", keys=("wc/apple/v2/0",), msg_id="A1",
    ...               properties={"REAL_TOPIC": "counts", "REAL_QID": "2", "TRAN_MSG": "true",
    ...                           "PGROUP": "wc__sink-tx", "UNIQ_KEY": "A1", "user": "x"})
    >>> gone = Discarded("broker-a", copy)
    >>> gone.queue
    MessageQueue(topic='counts', broker_name='broker-a', queue_id=2)
    >>> m = gone.resent(queue_index=2)
    >>> m.topic, m.key, m.queue_id, m.properties
    ('counts', 'wc/apple/v2/0', 2, {'user': 'x', 'SA_ORIGINAL_ID': 'A1'})
"""

from __future__ import annotations

from dataclasses import dataclass

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.records import OutgoingMessage, Record

#: Where a broker keeps the copies of the half messages it discarded (queue 0).
DISCARD_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
#: On a re-sent message: the id (UNIQ_KEY) of the half message it delivers.
PROPERTY_ORIGINAL_ID = "SA_ORIGINAL_ID"
#: What a half message carries beside its sender's own properties (MessageConst, and the
#: engine's step tag): left off the message that takes its place.
_NOT_THE_SENDERS = frozenset(
    {
        "TRAN_MSG",
        "PGROUP",
        "REAL_TOPIC",
        "REAL_QID",
        "UNIQ_KEY",
        "KEYS",
        "TAGS",
        "WAIT",
        "TRANSACTION_CHECK_TIMES",
        "CHECK_IMMUNITY_TIME_IN_SECONDS",
        "MSG_REGION",
        "TRACE_ON",
        "SA_STEP",
    }
)


def discard_queue(broker_name: str) -> MessageQueue:
    """The queue holding ``broker_name``'s discarded half messages."""
    return MessageQueue(DISCARD_TOPIC, broker_name, 0)


@dataclass(frozen=True)
class Discarded:
    """A discarded half message: its copy, read from ``broker_name``'s discard queue."""

    broker_name: str
    record: Record

    @property
    def queue(self) -> MessageQueue:
        """The queue it was to be delivered to."""
        props = self.record.properties
        return MessageQueue(props["REAL_TOPIC"], self.broker_name, int(props["REAL_QID"]))

    def resent(self, queue_index: int) -> OutgoingMessage:
        """The plain message that delivers it to :attr:`queue` (``queue_index``: that
        queue's index in the sender's route of the topic)."""
        r = self.record
        props = {k: v for k, v in r.properties.items() if k not in _NOT_THE_SENDERS}
        props[PROPERTY_ORIGINAL_ID] = r.msg_id
        key = " ".join(r.keys) if r.keys else None
        return OutgoingMessage(self.queue.topic, r.body, key, r.tags, props, queue_index)


def ids_of(record: Record) -> set[str]:
    """The ids ``record`` answers to: its own, and the discarded one it delivers."""
    original = record.properties.get(PROPERTY_ORIGINAL_ID)
    return {record.msg_id} if original is None else {record.msg_id, original}
