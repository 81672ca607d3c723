"""An instance's side of a rebalance in place, against a fake instance (no Spark, no Dagster)."""

from __future__ import annotations

from stream_assets.control.allocation import Allocation, allocate
from stream_assets.control.desired_state import DesiredState
from stream_assets.control.rebalance import RebalanceFollower, gained

QUEUES = {"src": [0, 1, 2, 3], "shuffle": [0, 1, 2, 3]}


class FakeInstance:
    """Records what the follower asks of it."""

    def __init__(self, running: bool) -> None:
        self._running = running
        self.calls: list[tuple[str, object]] = []

    @property
    def running(self) -> bool:
        return self._running

    def warm_up(self, gained: dict[str, list[int]]) -> int:
        self.calls.append(("warm_up", gained))
        return 0

    def stop_queries(self, timeout_s: float = 120.0) -> None:
        self.calls.append(("stop", None))
        self._running = False

    def reassign(self, assignment: dict[str, list[int]], generation: int) -> None:
        self.calls.append(("reassign", (assignment, generation)))
        self._running = True


def _phases(follower: RebalanceFollower, target: int, new: Allocation) -> list[str | None]:
    return [follower.step(DesiredState(target, new, phase=p)) for p in ("warm", "release", "run")]


def test_a_changed_instance_warms_releases_then_takes_its_new_share() -> None:
    old = allocate(QUEUES, 1)
    new = allocate(QUEUES, 2, previous=old)
    inst = FakeInstance(running=True)
    follower = RebalanceFollower(inst, 0, old.generation, old.for_instance(0))
    assert _phases(follower, 2, new) == [None, None, None]
    assert [c[0] for c in inst.calls] == ["warm_up", "stop", "reassign"]
    assert inst.calls[0][1] == {}  # instance 0 only loses queues: nothing to warm
    assert inst.calls[2][1] == (new.for_instance(0), new.generation)
    p = follower.progress
    assert p.warmed == p.released == p.running == new.generation
    assert 0 < p.released_at <= p.running_at


def test_an_unchanged_instance_keeps_running_through_a_rebalance() -> None:
    old = allocate(QUEUES, 2)
    new = allocate(QUEUES, 3, strategy="sticky", previous=old)
    keep = next(i for i in range(2) if old.for_instance(i) == new.for_instance(i))
    inst = FakeInstance(running=True)
    follower = RebalanceFollower(inst, keep, old.generation, old.for_instance(keep))
    assert _phases(follower, 3, new) == [None, None, None]
    assert [c[0] for c in inst.calls] == ["warm_up"]
    assert follower.generation == new.generation and follower.progress.running == new.generation


def test_a_new_instance_joins_only_when_told_to_run() -> None:
    old = allocate(QUEUES, 1)
    new = allocate(QUEUES, 2, previous=old)
    inst = FakeInstance(running=False)
    follower = RebalanceFollower(inst, 1, new.generation - 1, new.for_instance(1))
    assert follower.step(DesiredState(2, new, phase="warm")) is None
    assert follower.step(DesiredState(2, new, phase="release")) is None
    assert not inst.running and follower.progress.released == new.generation
    assert follower.step(DesiredState(2, new, phase="run")) is None
    assert inst.calls[-1] == ("reassign", (new.for_instance(1), new.generation))


def test_instances_beyond_the_new_count_release_and_exit() -> None:
    old = allocate(QUEUES, 3)
    new = allocate(QUEUES, 2, previous=old)
    inst = FakeInstance(running=True)
    follower = RebalanceFollower(inst, 2, old.generation, old.for_instance(2))
    warm, release, run = _phases(follower, 2, new)
    assert (warm, release) == (None, None)
    assert run is not None and "not part of generation" in run
    assert [c[0] for c in inst.calls] == ["stop"]


def test_a_stopped_topology_stops_its_instances() -> None:
    alloc = allocate(QUEUES, 2)
    follower = RebalanceFollower(FakeInstance(True), 1, alloc.generation, alloc.for_instance(1))
    assert follower.step(DesiredState(2, alloc)) is None
    assert follower.step(DesiredState(0, alloc)) == "the topology was stopped"


def test_a_called_off_rebalance_leaves_a_joining_instance_out() -> None:
    old = allocate(QUEUES, 1)
    new = allocate(QUEUES, 2, previous=old)
    inst = FakeInstance(running=False)
    follower = RebalanceFollower(inst, 1, new.generation - 1, new.for_instance(1))
    assert follower.step(DesiredState(2, new, phase="warm")) is None
    # The scale job put the old allocation back (a warm-up failed elsewhere).
    reason = follower.step(DesiredState(1, old))
    assert reason is not None and "not part of generation" in reason


def test_gained_queues() -> None:
    assert gained({"a": [0, 1], "b": [2]}, None) == {"a": [0, 1], "b": [2]}
    assert gained({"a": [0]}, {"a": [0, 1]}) == {}
