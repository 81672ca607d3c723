"""Messages and committed consumer offsets survive a broker stop/start.

Restarts the session's test broker (``broker.stop()`` then ``broker.start()``);
later tests reuse it once it serves again.
"""

from __future__ import annotations

import hashlib
import uuid

import pytest

from stream_assets.broker.local import LocalBroker
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.settings import RocketMQSettings
from tests.integration._util import wait_for

pytestmark = pytest.mark.integration

QUEUES = 4
MESSAGES = 400


def body_for(i: int) -> bytes:
    return b"\x00\xff" + i.to_bytes(4, "big") + hashlib.sha1(b"%d" % i).digest() * 3


def key_for(i: int) -> str:
    return f"restart-key-{i % 37}"


def reference_queue(key: str, queue_count: int) -> int:
    digest = hashlib.md5(key.encode("utf-8")).digest()
    return (int.from_bytes(digest[:4], "big") & 0x7FFFFFFF) % queue_count


def read_everything(admin: RocketMQAdmin, queues: list[MessageQueue]) -> dict[int, list[Record]]:
    reader = QueueReader(admin, group=f"it-restart-reader-{uuid.uuid4().hex[:8]}")
    try:
        return {q.queue_id: list(reader.read(q, 0)) for q in queues}
    finally:
        reader.close()


def test_messages_and_committed_offsets_survive_restart(
    restartable: LocalBroker, client_settings: RocketMQSettings
) -> None:
    topic = f"it-restart-{uuid.uuid4().hex}"
    groups = [f"it-restart-g{n}-{uuid.uuid4().hex[:8]}" for n in range(2)]
    never = f"it-restart-never-{uuid.uuid4().hex[:8]}"

    with RocketMQAdmin(client_settings) as admin:
        admin.create_topic(topic, queues=QUEUES)
        queues = admin.queues(topic)
        with Producer(client_settings, admin=admin) as producer:
            receipts = [
                producer.send(topic, body_for(i), key=key_for(i), tags="restart")
                for i in range(MESSAGES)
            ]
        counts = {q: sum(1 for r in receipts if r.queue_id == q) for q in range(QUEUES)}
        wait_for(
            lambda: [admin.max_offset(q) for q in queues] == [counts[q] for q in range(QUEUES)],
            10.0,
            "every message to be indexed",
        )
        before = read_everything(admin, queues)
        # A different position per group and queue (pull first: the broker must know the group).
        committed: dict[tuple[str, int], int] = {}
        for g_index, group in enumerate(groups):
            reader = QueueReader(admin, group=group)
            try:
                reader.pull(queues[0], 0, max_messages=1)
            finally:
                reader.close()
            for q in queues:
                offset = (counts[q.queue_id] * (g_index + 1)) // 3
                admin.commit_consumer_offset(group, q, offset)
                committed[(group, q.queue_id)] = offset
        assert admin.query_consumer_offset(groups[0], queues[0]) == committed[(groups[0], 0)]

    # Sanity of the input before the restart: everything is there, on the reference queue.
    assert sum(len(rs) for rs in before.values()) == MESSAGES
    for qid, records in before.items():
        for r in records:
            i = int.from_bytes(r.body[2:6], "big")
            assert r.body == body_for(i)
            assert reference_queue(key_for(i), QUEUES) == qid

    restartable.stop()
    stopped = restartable.status()
    assert not stopped.serving
    assert stopped.broker_pid is None and stopped.namesrv_pid is None
    restartable.start()
    assert restartable.status().serving

    # Connections of the old admin died with the broker: use a fresh one.
    with RocketMQAdmin(client_settings) as admin:
        wait_for(lambda: admin.topic_exists(topic), 30.0, f"topic {topic} to be routed again")
        queues_after = admin.queues(topic)
        assert queues_after == queues
        wait_for(
            lambda: [admin.max_offset(q) for q in queues] == [counts[q] for q in range(QUEUES)],
            30.0,
            "the queues to be reloaded",
        )
        assert [admin.min_offset(q) for q in queues] == [0] * QUEUES
        after = read_everything(admin, queues)
        # Byte-identical bodies, same offsets, keys, tags, ids and store timestamps.
        assert after == before
        for r in (r for rs in after.values() for r in rs):
            assert r.body == body_for(int.from_bytes(r.body[2:6], "big"))
        for group in groups:
            for q in queues:
                assert admin.query_consumer_offset(group, q) == committed[(group, q.queue_id)], (
                    f"group {group} queue {q.queue_id}"
                )
        assert admin.query_consumer_offset(never, queues[0]) is None

        # The restarted broker takes new messages after the old ones, on the same queue per key.
        with Producer(client_settings, admin=admin) as producer:
            receipt = producer.send(topic, body_for(MESSAGES), key=key_for(0))
        expected_queue = reference_queue(key_for(0), QUEUES)
        assert (receipt.queue_id, receipt.queue_offset) == (expected_queue, counts[expected_queue])
