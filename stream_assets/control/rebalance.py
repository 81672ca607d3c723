"""An instance's side of a rebalance in place: follow the desired state's phases.

The scale job (jobs/scale.py) moves a topology to a new allocation in three
phases, written into the desired state; every instance run polls it and
answers through its heartbeat (:class:`Progress`):

1. ``warm``: instances of the new allocation get ready while the old one
   still runs. A new instance brings its SparkSession up; every instance
   brings the local stores of queues it gains up to date (NewSplit, from the
   state topic). Answer: ``warmed``.
2. ``release``: an instance whose share changes finishes its batch in
   flight and stops its stage queries (RemoveSplit; stores handed back).
   One whose share stays keeps running. Answer: ``released`` (and when).
3. ``run``: every instance of the new allocation starts its queries over its
   new share as the new generation; instances beyond the new count exit.
   Answer: ``running`` (and when).

The scale job moves to the next phase only when every live instance has
answered, so no queue ever has two owners, and a queue has none only from
its old owner's release to its new owner's start: the pause.

Example::

    >>> follower = RebalanceFollower(inst, 1, generation=3, assignment=share)  # doctest: +SKIP
    >>> reason = follower.step(DesiredStateStore(instance).get("wordcount"))  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from stream_assets.control.desired_state import DesiredState

Assignment = dict[str, list[int]]
#: The reason :meth:`RebalanceFollower.step` gives for a stop that drains first.
DRAIN = "the topology was stopped, draining first"


class Rebalanceable(Protocol):
    """What a follower needs of an instance (runtime.spark.instance.Instance has it)."""

    @property
    def running(self) -> bool: ...

    def warm_up(self, gained: dict[str, list[int]]) -> int: ...

    def stop_queries(self, timeout_s: float = 120.0) -> None: ...

    def reassign(self, assignment: dict[str, list[int]], generation: int) -> None: ...


@dataclass(frozen=True)
class Progress:
    """How far this instance is in the latest rebalance (sent with every heartbeat).

    Frozen, and replaced whole at each step: the heartbeat thread reads it while
    the run loop moves it, and must never send a half-made step (released
    without its time).
    """

    warmed: int = -1
    released: int = -1
    released_at: float = 0.0
    running: int = -1
    running_at: float = 0.0


def _normal(share: Mapping[str, Sequence[int]] | None) -> dict[str, list[int]]:
    return {t: sorted(qs) for t, qs in (share or {}).items() if qs}


def gained(new: Mapping[str, Sequence[int]], old: Mapping[str, Sequence[int]] | None) -> Assignment:
    """The queues of ``new`` not in ``old``, by topic.

    >>> gained({"a": [0, 1], "b": [2]}, {"a": [1]})
    {'a': [0], 'b': [2]}
    """
    before = _normal(old)
    out = {t: sorted(set(qs) - set(before.get(t, []))) for t, qs in _normal(new).items()}
    return {t: qs for t, qs in out.items() if qs}


class RebalanceFollower:
    """Drives one instance through the phases of each new generation.

    ``generation``/``assignment``: what the instance runs now. An instance
    launched for a generation whose rebalance is still under way starts
    without queries; pass ``generation - 1`` so it takes part in it.
    """

    def __init__(
        self,
        inst: Rebalanceable,
        index: int,
        generation: int,
        assignment: Assignment | None,
        log: Callable[[str], None] = lambda _line: None,
    ) -> None:
        self.inst = inst
        self.index = index
        self.generation = generation
        self.assignment = assignment
        self.log = log
        now = time.time()
        self.progress = Progress(
            warmed=generation,
            released=generation,
            running=generation if inst.running else -1,
            running_at=now if inst.running else 0.0,
        )

    def step(self, state: DesiredState | None) -> str | None:
        """Act on the desired state; a reason to stop this instance, or None."""
        if state is None or state.paused or state.allocation is None:
            return None
        alloc = state.allocation
        gen = alloc.generation
        share = alloc.for_instance(self.index) if self.index < alloc.instances else None
        if gen <= self.generation:
            if state.phase != "run":
                return None
            if state.target_instances == 0:
                return DRAIN if state.drain else "the topology was stopped"
            if share is None:
                return f"not part of generation {gen} ({alloc.instances} instances)"
            if not self.inst.running:
                self._take(share, gen)  # launched into a rebalance that was called off
            return None
        if state.phase == "warm":
            if self.progress.warmed < gen:
                if share is not None:
                    self.inst.warm_up(gained(share, self.assignment))
                self.progress = replace(self.progress, warmed=gen)
                self.log(f"generation {gen}: warmed up")
            return None
        self._release(gen, share)
        if state.phase == "release":
            return None
        # phase "run"
        if share is None or state.target_instances == 0:
            self.generation = gen
            return f"not part of generation {gen} ({alloc.instances} instances)"
        self._take(share, gen)
        return None

    def _release(self, gen: int, share: Assignment | None) -> None:
        if self.progress.released >= gen:
            return
        released_at = 0.0  # nothing released: this instance's queues were never unowned
        if self.inst.running and _normal(share) != _normal(self.assignment):
            self.log(f"generation {gen}: releasing my queues (finishing the batch in flight)")
            self.inst.stop_queries()
            # From here until their new owner starts, these queues have none: the pause.
            released_at = time.time()
        self.progress = replace(
            self.progress,
            released=gen,
            released_at=released_at,
            warmed=max(self.progress.warmed, gen),
        )

    def _take(self, share: Assignment, gen: int) -> None:
        if not (self.inst.running and _normal(share) == _normal(self.assignment)):
            owned = "; ".join(f"{t}: {q}" for t, q in sorted(share.items()) if q) or "no queue"
            self.log(f"generation {gen}: running {owned}")
            self.inst.reassign(share, gen)
        self.assignment, self.generation = share, gen
        self.progress = Progress(
            warmed=max(self.progress.warmed, gen),
            released=max(self.progress.released, gen),
            released_at=self.progress.released_at,
            running=gen,
            running_at=time.time(),
        )
