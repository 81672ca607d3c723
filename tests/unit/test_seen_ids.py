"""SeenIds: which of a step's exactly-once messages a consumer of a sink queue sees yet.

Checks of several steps' messages in one sink queue come interleaved (keyed queues
share sink queues); each step's look goes on from where it stopped, so every stored
message is read once per step, not once per check.
"""

from __future__ import annotations

from collections import Counter

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.reader import PullBatch, PullStatus
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.sink_transactions import SeenIds

QUEUE = MessageQueue("counts", "broker-a", 0)


class Queue:
    """One sink queue; counts how often each offset was pulled."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.pulled: Counter[int] = Counter()

    def store(self, msg_id: str, at_ms: int) -> None:
        offset = len(self.records)
        self.records.append(
            Record(QUEUE.topic, 0, offset, b"", store_timestamp=at_ms, msg_id=msg_id)
        )

    def max_offset(self, queue: MessageQueue) -> int:
        return len(self.records)

    def min_offset(self, queue: MessageQueue) -> int:
        return 0

    def pull(self, queue: MessageQueue, offset: int, max_messages: int | None = None) -> PullBatch:
        got = self.records[offset : offset + (max_messages or 32)]
        self.pulled.update(r.queue_offset for r in got)
        status = PullStatus.FOUND if got else PullStatus.NO_NEW_MESSAGES
        end = offset + len(got)
        return PullBatch(queue, status, got, end, 0, len(self.records))


def test_interleaved_looks_at_two_steps_read_each_message_once_per_step() -> None:
    queue = Queue()
    seen = SeenIds(queue, queue)  # type: ignore[arg-type]
    first, second = ["a1", "a2"], ["b1", "b2"]
    queue.store("a1", 100_000)
    assert seen.unseen(QUEUE, 100_000, first) == ["a2"]
    assert seen.unseen(QUEUE, 100_000, second) == ["b1", "b2"]
    queue.store("b1", 100_100)
    queue.store("a2", 100_200)
    assert seen.unseen(QUEUE, 100_000, first) == []
    assert seen.unseen(QUEUE, 100_000, second) == ["b2"]
    queue.store("b2", 100_300)
    assert seen.unseen(QUEUE, 100_000, second) == []
    assert max(queue.pulled.values()) <= 2, (
        f"an offset read more than once per step: {queue.pulled}"
    )
