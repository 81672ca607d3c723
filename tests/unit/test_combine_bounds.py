"""combine_bounds: from where stage 0 may pre-combine each source queue after a (re)start.

A bound too low pre-combines records a crashed run already sent, so the keyed stage
counts them twice; too high only costs speed. So the planned ends are read from each
group's master, and a group without one (its slave's copy may be a sync interval old)
goes per record.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stream_assets.rocketmq.admin import MessageQueue, QueueOffsets
from stream_assets.rocketmq.errors import BrokerUnreachableError
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.runtime.drive.planning import combine_bounds

TOPIC = "lines"
LAYOUT = TopicLayout.of(
    [MessageQueue(TOPIC, b, q) for b in ("broker-a", "broker-b") for q in range(2)]
)


class Admin:
    """Offsets per queue index; ``no_master``: groups whose master is down."""

    def __init__(
        self,
        planned: dict[int, int | None],
        committed: dict[int, int | None],
        no_master: frozenset[str] = frozenset(),
    ) -> None:
        self.planned, self.committed, self.no_master = planned, committed, no_master

    def topic_offsets(
        self, topic: str, queues: Iterable[MessageQueue]
    ) -> dict[MessageQueue, QueueOffsets]:
        return {q: QueueOffsets(q, 10, 100) for q in queues}

    def group_offsets(
        self,
        group: str,
        topic: str,
        queues: Iterable[MessageQueue],
        *,
        from_master: bool = False,
    ) -> dict[MessageQueue, int | None]:
        queues = list(queues)
        if group.endswith("-planned"):
            down = {q.broker_name for q in queues} & self.no_master
            if down and from_master:
                raise BrokerUnreachableError(f"broker group {min(down)}", "-", "no master")
            return {q: self.planned.get(LAYOUT.index(q)) for q in queues}
        return {q: self.committed.get(LAYOUT.index(q)) for q in queues}


def bounds(admin: Any) -> dict[int, int]:
    return dict(combine_bounds(admin, TOPIC, LAYOUT, "g", "g-planned"))


def test_the_planned_end_bounds_a_queue_and_without_one_its_history_decides() -> None:
    admin = Admin(planned={0: 40, 2: 70}, committed={0: 30, 1: 50, 2: 60})
    # Planned: there. Committed but never planned (an older version): the end now.
    # Neither: nothing was ever sent, combine from the first offset.
    assert bounds(admin) == {0: 40, 1: 100, 2: 70, 3: 10}


def test_a_group_without_a_master_goes_per_record_not_by_its_slaves_copy() -> None:
    admin = Admin(planned={0: 40, 2: 70}, committed={}, no_master=frozenset({"broker-b"}))
    assert bounds(admin) == {0: 40, 1: 10}, "broker-b's queues left out: per record"


def test_a_bound_never_goes_below_the_ends_a_running_planner_planned() -> None:
    # A slave promoted since the last interval holds an older copy of the planned ends
    # (40 and 70): the planner's own (55, 65) win where higher, the master's elsewhere.
    admin = Admin(planned={0: 40, 2: 70}, committed={0: 30, 1: 50, 2: 60})
    floors = {0: 55, 2: 65}
    got = dict(combine_bounds(admin, TOPIC, LAYOUT, "g", "g-planned", floors=floors))
    assert got == {0: 55, 1: 100, 2: 70, 3: 10}
    down = Admin(planned={0: 40}, committed={}, no_master=frozenset({"broker-a"}))
    assert combine_bounds(down, TOPIC, LAYOUT, "g", "g-planned", floors=floors) == (
        (2, 65),
        (3, 10),
    ), "a group without a master goes per record, whatever it planned"
