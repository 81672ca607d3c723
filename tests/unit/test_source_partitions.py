"""A micro-batch's queues are grouped into about one Spark task per task slot."""

from __future__ import annotations

import random

import pytest

from stream_assets.runtime.spark.source import QueueRange, group_ranges


@pytest.mark.parametrize("seed", range(20))
def test_every_queue_once_in_at_most_the_slots_and_balanced(seed: int) -> None:
    rnd = random.Random(seed)
    sizes = [rnd.randint(0, 1_000) for _ in range(rnd.randint(1, 16))]
    ranges = [QueueRange(q, 100, 100 + n, (1, 2)) for q, n in enumerate(sizes)]
    slots = rnd.randint(1, 6)
    parts = group_ranges(ranges, slots)
    assert len(parts) == min(slots, len(ranges))
    placed = [r for p in parts for r in p.ranges]
    assert sorted(placed, key=lambda r: r.queue_id) == ranges  # each once, unchanged
    # Largest first, round-robin: no task exceeds another by more than the largest range.
    loads = [sum(r.end - r.start for r in p.ranges) for p in parts]
    assert max(loads) - min(loads) <= max(sizes)


def test_zero_slots_means_one_task_per_queue() -> None:
    ranges = [QueueRange(q, 0, 10) for q in range(5)]
    assert [p.ranges for p in group_ranges(ranges, 0)] == [(r,) for r in ranges]
    assert group_ranges([], 2) == []
