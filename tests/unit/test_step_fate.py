"""step_fate: what a state queue says of a step, for every shape the queue can take."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.reader import PullBatch, PullStatus
from stream_assets.rocketmq.records import Record
from stream_assets.state.meta import StateMeta
from stream_assets.state.records import decode_record, encode_delta, encode_snap_begin
from stream_assets.state.step_fate import StepFate, StepTag, step_fate

QUEUE = MessageQueue("job__state", "memory", 3)
OURS, THEIRS = b"\x01" * 8, b"\x02" * 8


class StateQueue:
    """One in-memory state queue: the offsets and reads step_fate asks for."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def min_offset(self, queue: MessageQueue) -> int:
        return 0

    def max_offset(self, queue: MessageQueue) -> int:
        return len(self.bodies)

    def pull(self, queue: MessageQueue, offset: int, max_messages: int | None = None) -> PullBatch:
        found = self.bodies[offset : offset + (max_messages or 1)]
        records = [Record(queue.topic, queue.queue_id, offset + i, b) for i, b in enumerate(found)]
        status = PullStatus.FOUND if records else PullStatus.NO_NEW_MESSAGES
        end = len(self.bodies)
        return PullBatch(queue, status, records, offset + len(records), 0, end)

    def read(self, queue: MessageQueue, start: int, end: int | None = None) -> Iterator[Record]:
        yield from self.pull(queue, start, (end or len(self.bodies)) - start).records

    def delta(self, seq: int, write_id: bytes, at: int, size: int = 10) -> list[bytes]:
        """The bodies of a delta of ``size`` bytes of value (parts of 2 KiB at most)."""
        changes = {b"k": b"v" * size}
        return encode_delta(seq, write_id, None, changes, StateMeta(seq=seq), 2048, at=at)

    def fate(self, tag: StepTag) -> StepFate:
        read = step_fate(self, self, QUEUE, tag)
        assert (read.meta is not None) == (read.fate is StepFate.LANDED)
        assert read.meta is None or read.meta.seq == self.seq_at(tag.at)
        return read.fate

    def seq_at(self, offset: int) -> int:
        record = decode_record(self.bodies[offset])
        return record.seq


def test_a_step_before_its_delta_is_stored_is_pending() -> None:
    q = StateQueue()
    q.bodies += q.delta(1, THEIRS, 0)
    assert q.fate(StepTag(QUEUE.topic, 3, 1, OURS)) is StepFate.PENDING


def test_a_landed_step_stays_landed_past_snapshots_and_later_commits() -> None:
    q = StateQueue()
    q.bodies += q.delta(1, OURS, 0)
    tag = StepTag(QUEUE.topic, 3, 0, OURS)
    assert q.fate(tag) is StepFate.LANDED
    q.bodies.append(encode_snap_begin(1, b"\x09" * 8, None, StateMeta(seq=1), at=1))
    q.bodies += q.delta(2, THEIRS, 2)
    assert q.fate(tag) is StepFate.LANDED
    assert q.fate(StepTag(QUEUE.topic, 3, 2, OURS)) is StepFate.VOID, "another's write at 2"


def test_another_write_at_the_offset_makes_the_step_void_even_if_ours_landed_after_it() -> None:
    q = StateQueue()
    q.bodies += q.delta(5, THEIRS, 0)
    q.bodies += q.delta(5, OURS, 0)  # stored at 1 though meant for 0: a lost race, void
    assert q.fate(StepTag(QUEUE.topic, 3, 0, OURS)) is StepFate.VOID
    assert q.fate(StepTag(QUEUE.topic, 3, 1, OURS)) is StepFate.VOID


def test_a_delta_in_parts_lands_only_whole() -> None:
    q = StateQueue()
    parts = q.delta(1, OURS, 0, size=5000)
    assert len(parts) >= 3
    tag = StepTag(QUEUE.topic, 3, 0, OURS)
    q.bodies += parts[:2]
    assert q.fate(tag) is StepFate.PENDING, "the writer may still be sending the rest"
    q.bodies += parts[2:]
    assert q.fate(tag) is StepFate.LANDED
    torn = StateQueue()
    torn.bodies += parts[:2] + torn.delta(1, THEIRS, 2)  # the writer died mid-way
    assert torn.fate(tag) is StepFate.VOID


@pytest.mark.parametrize(
    "text",
    ["v2/s/3/0/00", "v1/s/3/0", "v1/s/x/0/00", "v1/s/3/0/zz", "", "v1//3/0/00", "v1/s/3/0/00/x"],
)
def test_a_tag_that_is_not_one_says_so(text: str) -> None:
    with pytest.raises(ValueError, match="SA_STEP"):
        StepTag.decode(text)
