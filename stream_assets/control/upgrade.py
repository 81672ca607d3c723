"""Accepting a change of a topology on purpose: drop the state of the operators named.

A start refuses a change that would lose or misread state
(:mod:`~stream_assets.plan.upgrade`). The user's way through is to name the
operators whose state may go (``stream-assets upgrade <job> --drop-state NAME``,
or the Dagster job ``upgrade_job``), with the topology stopped (drained first
if its shuffle topics may hold records in flight: ``stop_topology_job`` with
``drain: true``). :func:`apply_upgrade` then:

1. plans the start with those operators accepted and refuses on anything else;
2. empties the state of each accepted operator that keeps its topics (a changed
   state format, a retired operator coming back): its shuffle topic's queues go
   to their ends and its state topic gets an empty snapshot whose seq is above
   everything it held (:func:`~stream_assets.control.reset.plan_reset` with
   ``operators``), so its results' versions keep growing; refused, changing
   nothing, if any of those topics moved meanwhile (an instance still runs);
3. records the topology, so the next start carries over everything else.

An accepted operator that is gone, or an unclaimed state topic, needs no
change on the broker: its state is left where it is and never read again.

Example::

    >>> with RocketMQAdmin(settings) as admin:  # doctest: +SKIP
    ...     outcome = apply_upgrade(topology, admin, drop=["counts"], say=print)
    wordcount: state carried over for ...; state dropped for counts
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from stream_assets.control.reset import EARLIEST, apply_reset, format_time, plan_reset
from stream_assets.plan.topology import Topology
from stream_assets.plan.upgrade import UpgradePlan
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.provision import plan_topology_upgrade, upgrade_topology
from stream_assets.rocketmq.reader import QueueReader

Say = Callable[[str], None]


@dataclass(frozen=True)
class UpgradeOutcome:
    """What :func:`apply_upgrade` found and did."""

    plan: UpgradePlan
    #: State queues that got an empty snapshot.
    emptied: int = 0
    applied: bool = False

    def describe(self) -> str:
        """One line."""
        if not self.applied:
            return f"{self.plan.job_id}: dry run, nothing was changed"
        return (
            f"{self.plan.job_id}: recorded; state dropped for "
            f"{', '.join(self.plan.dropped) or 'no operator'} ({self.emptied} state queues "
            "emptied); start it now"
        )


def apply_upgrade(
    topology: Topology,
    admin: RocketMQAdmin,
    drop: Collection[str] = (),
    state_root: Path | None = None,
    say: Say | None = None,
    apply: bool = True,
) -> UpgradeOutcome:
    """Plan ``topology``'s start with ``drop`` accepted; with ``apply``, empty their state
    and record it. Raises ValueError (an :class:`~stream_assets.plan.upgrade.
    UpgradeRefusedError` for a refusal) naming what to do; ``state_root``: this
    machine's stores of the dropped operators are wiped too."""
    tell = say or (lambda _line: None)
    plan = plan_topology_upgrade(admin, topology, accepted=drop)
    unknown = sorted(set(drop) - _droppable(plan))
    if unknown:
        raise ValueError(
            f"--drop-state {' '.join(unknown)}: {topology.job_id} has no such operator now or "
            f"in its record (operators: {', '.join(sorted(_droppable(plan))) or 'none'})"
        )
    tell(plan.describe())
    if not apply:
        return UpgradeOutcome(plan)
    plan.refuse_if_needed()
    emptied = 0
    keeps_topics = {s.head.op_id for s in plan.topology.stages if s.head is not None}
    ids = [op.op_id for op in plan.record.operators if op.name in plan.dropped]
    to_empty = [i for i in ids if i in keeps_topics]
    if to_empty:
        reader = QueueReader(admin, f"{topology.job_id}-upgrade")
        try:
            reset = plan_reset(
                topology, EARLIEST, admin, reader, state_root=state_root, operators=to_empty
            )
            writer = f"upgrade:{format_time(int(time.time() * 1000))}"
            emptied = len(apply_reset(reset, admin, progress=tell, writer=writer).snapshots)
        finally:
            reader.close()
    upgrade_topology(admin, topology, tell, accepted=drop)
    return UpgradeOutcome(plan, emptied, applied=True)


def _droppable(plan: UpgradePlan) -> set[str]:
    """Names ``--drop-state`` may give: operators now, recorded ones, unclaimed topics'."""
    return {op.name for op in plan.record.operators} | set(plan.unclaimed)
