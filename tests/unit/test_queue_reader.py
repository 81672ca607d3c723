"""QueueReader.read: a range asked for is read whole or the read raises (never cut short)."""

from __future__ import annotations

from typing import Any

import pytest

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.errors import RemotingError
from stream_assets.rocketmq.reader import PullBatch, PullStatus, QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.rocketmq.tags import TagFilter

QUEUE = MessageQueue("t", "broker-a", 0)


class _Admin:
    def __init__(self, readable: int) -> None:
        self.readable = readable

    def new_pool(self) -> Any:
        return None

    def max_offset(self, queue: MessageQueue) -> int:
        return self.readable


class _Reader(QueueReader):
    """Serves offsets below ``readable`` (a slave that holds less than its master did),
    two a pull; tagged records only where ``tagged`` says."""

    def __init__(self, readable: int, tagged: set[int] | None = None) -> None:
        super().__init__(_Admin(readable), group="g")  # type: ignore[arg-type]
        self.readable, self.tagged = readable, tagged

    def pull(
        self, queue: MessageQueue, offset: int, max_messages: int | None = None, tags: Any = None
    ) -> PullBatch:
        upto = min(offset + 2, self.readable)
        offsets = range(offset, upto)
        if self.tagged is not None:
            chosen = [o for o in offsets if o in self.tagged]  # the broker filters
            return PullBatch(
                queue,
                PullStatus.FOUND if chosen else PullStatus.NO_NEW_MESSAGES,
                [Record("t", 0, o, b"x") for o in chosen],
                upto,
                0,
                self.readable,
            )
        status = PullStatus.FOUND if offsets else PullStatus.NO_NEW_MESSAGES
        records = [Record("t", 0, o, b"x") for o in offsets]
        return PullBatch(queue, status, records, max(upto, offset), 0, self.readable)


def test_a_range_the_broker_holds_is_read_whole() -> None:
    assert [r.queue_offset for r in _Reader(readable=7).read(QUEUE, 2, 7)] == [2, 3, 4, 5, 6]


def test_a_range_past_what_the_broker_serves_raises_instead_of_ending_short() -> None:
    reader = _Reader(readable=5)
    read: list[int] = []
    with pytest.raises(RemotingError, match=r"nothing from offset 5 .*read again"):
        read.extend(r.queue_offset for r in reader.read(QUEUE, 2, 9))
    assert read == [2, 3, 4]  # what came before: the caller's step fails and is retried


def test_without_an_end_the_read_stops_where_the_queue_ended() -> None:
    assert [r.queue_offset for r in _Reader(readable=4).read(QUEUE, 1)] == [1, 2, 3]


def test_filtered_pulls_read_on_to_the_end() -> None:
    reader = _Reader(readable=10, tagged={1, 8})
    got = [r.queue_offset for r in reader.read(QUEUE, 0, 10, TagFilter.parse("a"))]
    assert got == [1, 8]
