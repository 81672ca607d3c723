"""Queue offsets, consumer-group offsets and timestamp search against the real broker."""

from __future__ import annotations

import time
import uuid

import pytest

from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.settings import RocketMQSettings
from tests.integration._util import wait_for

pytestmark = pytest.mark.integration


def _topic(prefix: str) -> str:
    return f"it-{prefix}-{uuid.uuid4().hex}"


def _read_all(admin: RocketMQAdmin, queue: MessageQueue) -> list[Record]:
    reader = QueueReader(admin, group=f"it-off-reader-{uuid.uuid4().hex[:8]}")
    try:
        return list(reader.read(queue, 0))
    finally:
        reader.close()


def _pull_as(admin: RocketMQAdmin, group: str, queue: MessageQueue) -> None:
    """Pull once as ``group``: the broker (autoCreateSubscriptionGroup) then knows the group.

    RocketMQ 5 refuses UPDATE_CONSUMER_OFFSET for a group it does not know
    (code 26); see test_commit_for_a_group_that_never_pulled.
    """
    reader = QueueReader(admin, group=group)
    try:
        reader.pull(queue, 0, max_messages=1)
    finally:
        reader.close()


def test_committed_offsets_round_trip_per_group_and_queue(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = _topic("commit")
    admin.create_topic(topic, queues=4)
    queues = admin.queues(topic)
    # Give every queue messages so the committed offsets lie inside the stored range.
    with Producer(client_settings) as producer:
        for q in queues:
            for n in range(10):
                producer.send(topic, f"m{n}".encode(), queue_id=q.queue_id)
    wait_for(lambda: all(admin.max_offset(q) == 10 for q in queues), 10.0, "10 messages per queue")
    groups = [f"it-group-{uuid.uuid4().hex[:10]}" for _ in range(3)]
    for group in groups:
        _pull_as(admin, group, queues[0])
    expected: dict[tuple[str, int], int] = {}
    for g_index, group in enumerate(groups):
        for q in queues:
            if (g_index + q.queue_id) % 3 == 2:
                continue  # some (group, queue) pairs never commit
            offset = (3 * g_index + 2 * q.queue_id + 1) % 11  # 0..10, distinct per pair
            admin.commit_consumer_offset(group, q, offset)
            expected[(group, q.queue_id)] = offset
    for group in groups:
        for q in queues:
            assert admin.query_consumer_offset(group, q) == expected.get((group, q.queue_id)), (
                f"group {group} queue {q.queue_id}"
            )
    # A later commit replaces the earlier one, also when it moves backwards.
    group, q = groups[0], queues[0]
    admin.commit_consumer_offset(group, q, 7)
    assert admin.query_consumer_offset(group, q) == 7
    admin.commit_consumer_offset(group, q, 2)
    assert admin.query_consumer_offset(group, q) == 2
    # Other groups on the same queue are untouched.
    assert admin.query_consumer_offset(groups[1], q) == expected.get((groups[1], q.queue_id))


def test_never_committed_group_returns_none(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = _topic("nocommit")
    admin.create_topic(topic, queues=2)
    queues = admin.queues(topic)
    group = f"it-never-{uuid.uuid4().hex[:10]}"
    # Both on an empty queue and on one holding messages.
    with Producer(client_settings) as producer:
        producer.send(topic, b"x", queue_id=1)
    wait_for(lambda: admin.max_offset(queues[1]) == 1, 10.0, "the message to be indexed")
    assert [admin.query_consumer_offset(group, q) for q in queues] == [None, None]
    # Committing on one queue does not make the other appear committed.
    _pull_as(admin, group, queues[1])
    admin.commit_consumer_offset(group, queues[1], 1)
    assert [admin.query_consumer_offset(group, q) for q in queues] == [None, 1]


def test_commit_for_a_group_that_never_pulled(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = _topic("freshgroup")
    admin.create_topic(topic, queues=1)
    (queue,) = admin.queues(topic)
    with Producer(client_settings) as producer:
        producer.send(topic, b"x", queue_id=0)
    group = f"it-fresh-{uuid.uuid4().hex[:10]}"
    admin.commit_consumer_offset(group, queue, 1)
    assert admin.query_consumer_offset(group, queue) == 1


def test_commit_rejects_negative_offset(admin: RocketMQAdmin) -> None:
    topic = _topic("neg")
    admin.create_topic(topic, queues=1)
    (queue,) = admin.queues(topic)
    with pytest.raises(ValueError, match="-1"):
        admin.commit_consumer_offset("it-neg", queue, -1)


def test_min_max_offsets_match_messages_sent_per_queue(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = _topic("minmax")
    counts = {0: 0, 1: 5, 2: 23, 3: 1}
    admin.create_topic(topic, queues=len(counts))
    receipts: dict[int, list[int]] = {q: [] for q in counts}
    with Producer(client_settings) as producer:
        # Interleave the queues so no queue is written in one run.
        for n in range(max(counts.values())):
            for qid, count in counts.items():
                if n < count:
                    receipts[qid].append(producer.send(topic, b"v", queue_id=qid).queue_offset)
    for qid, count in counts.items():
        assert receipts[qid] == list(range(count)), f"queue {qid} receipts"
    wait_for(
        lambda: sum(o.max_offset for o in admin.queue_offsets(topic)) == sum(counts.values()),
        10.0,
        "every message to be indexed",
    )
    offsets = admin.queue_offsets(topic)
    assert [o.queue.queue_id for o in offsets] == sorted(counts)
    for o in offsets:
        assert o.min_offset == 0, f"queue {o.queue.queue_id}"
        assert o.max_offset == counts[o.queue.queue_id], f"queue {o.queue.queue_id}"
        assert admin.min_offset(o.queue) == 0
        assert admin.max_offset(o.queue) == counts[o.queue.queue_id]
        assert len(_read_all(admin, o.queue)) == counts[o.queue.queue_id]


def test_offset_for_timestamp_finds_first_message_at_or_after(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = _topic("ts")
    admin.create_topic(topic, queues=2)
    queue = admin.queues(topic)[0]
    assert queue.queue_id == 0
    burst1, burst2 = 40, 30
    with Producer(client_settings) as producer:
        for n in range(burst1):
            producer.send(topic, b"one-%d" % n, queue_id=0)
        wait_for(lambda: admin.max_offset(queue) == burst1, 10.0, "burst 1 to be indexed")
        last_store_1 = _read_all(admin, queue)[-1].store_timestamp
        # The event separating the bursts: the clock passing burst 1's last store time.
        while time.time() * 1000 <= last_store_1 + 50:
            pass
        for n in range(burst2):
            producer.send(topic, b"two-%d" % n, queue_id=0)
    total = burst1 + burst2
    wait_for(lambda: admin.max_offset(queue) == total, 10.0, "burst 2 to be indexed")
    records = _read_all(admin, queue)
    assert [r.queue_offset for r in records] == list(range(total))
    assert [r.body for r in records[burst1:]] == [b"two-%d" % n for n in range(burst2)]
    stamps = [r.store_timestamp for r in records]
    assert stamps[burst1] >= last_store_1 + 50

    def first_at_or_after(t: int) -> int:
        return next((r.queue_offset for r in records if r.store_timestamp >= t), total)

    t2 = stamps[burst1]
    assert first_at_or_after(t2) == burst1
    assert admin.offset_for_timestamp(queue, t2) == burst1
    # Any time in the gap between the bursts also lands on burst 2's first message.
    assert admin.offset_for_timestamp(queue, last_store_1 + 1) == burst1
    assert admin.offset_for_timestamp(queue, t2 - 1) == burst1
    # Before everything: the min offset; far in the future: the max offset.
    assert admin.offset_for_timestamp(queue, 0) == admin.min_offset(queue) == 0
    assert admin.offset_for_timestamp(queue, stamps[0]) == 0
    future = int(time.time() * 1000) + 3_600_000
    assert admin.offset_for_timestamp(queue, future) == admin.max_offset(queue) == total
    # Inside a burst, ties included: the first offset stored at or after T.
    for probe in (
        stamps[burst1 // 2],
        stamps[burst1 - 1],
        stamps[total - 1],
        stamps[total - 1] + 1,
    ):
        assert admin.offset_for_timestamp(queue, probe) == first_at_or_after(probe), probe
