"""Transactional (half) messages against the real 5.3.3 broker: what a plain consumer sees.

The foundation of exactly-once sinks (issue 33): a prepared message is seen by
no consumer; a committed one is seen once, each queue's in the order
committed; a rolled-back one never. Read back with the project's QueueReader,
as any consumer reads, with no de-duplication.
"""

from __future__ import annotations

import collections
import uuid

import pytest

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer, OutgoingMessage
from stream_assets.rocketmq.errors import SendError
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.rocketmq.transactions import TransactionalSender
from stream_assets.settings import RocketMQSettings

pytestmark = pytest.mark.integration

QUEUES = 4


def _stored(admin: RocketMQAdmin, topic: str) -> dict[int, list[Record]]:
    reader = QueueReader(admin, group=f"it-tx-{uuid.uuid4().hex[:8]}")
    try:
        return {q.queue_id: list(reader.read(q, 0)) for q in admin.queues(topic)}
    finally:
        reader.close()


def test_prepared_messages_are_unseen_until_committed_then_seen_once_in_order(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = f"it-tx-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, QUEUES)
    messages = [
        OutgoingMessage(topic, f"result {i}".encode(), key=f"k{i % 7}", tags="sum")
        for i in range(60)
    ]
    with BatchProducer(client_settings) as producer:
        tx = TransactionalSender(producer, f"it-tx-group-{uuid.uuid4().hex[:6]}")
        prepared = tx.prepare(messages)
        # Each where send_all would have put it: the key's queue.
        assert [p.queue_id for p in prepared] == [
            queue_for_key(m.key or "", QUEUES) for m in messages
        ]
        assert all(not records for records in _stored(admin, topic).values())
        keep, drop = prepared[:45], prepared[45:]
        tx.commit(keep)
        tx.rollback(drop)
        # A broker refuses what is not a prepared message of the group.
        stranger = TransactionalSender(producer, "it-tx-another-group")
        with pytest.raises(SendError, match="commit of"):
            stranger.commit(tx.prepare([messages[0]]))

    stored = _stored(admin, topic)
    seen = [r for records in stored.values() for r in records]
    assert len(seen) == len({r.msg_id for r in seen}) == 45  # each once, nothing else
    by_id = {p.msg_id: m for p, m in zip(prepared, messages, strict=True)}
    expected: dict[int, list[bytes]] = collections.defaultdict(list)
    for p in keep:
        expected[p.queue_id].append(by_id[p.msg_id].body)
    assert {q: [r.body for r in rs] for q, rs in stored.items() if rs} == expected
    for r in seen:
        m = by_id[r.msg_id]
        assert (r.keys, r.tags) == ((m.key,), m.tags)
