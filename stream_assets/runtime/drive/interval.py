"""One long-running task of the real-time mode: its queues, step after step, for an interval.

In micro-batch mode a record waits for the batch it arrived in to be
planned, scheduled and finished, and a keyed record for a second batch
downstream. In real-time mode an instance runs every stage at once as a
few long-running tasks (:mod:`stream_assets.runtime.spark.real_time`), and
each task runs :func:`run_interval`: it polls its queues' end offsets, runs
the per-queue core on whatever arrived (one *step*: the same
:func:`~stream_assets.runtime.drive.queues.run_range` a micro-batch runs,
so the same exactly-once protocol; a stateless source stage's queues
together, their counts pre-combined across them where they can be:
:func:`~stream_assets.runtime.drive.queues.run_source_queues`), sends its
stats to the instance at once (which commits the offsets), and polls again.
What stage 0 sends to the shuffle is read by the keyed stage's task moments
later: the shuffle topic is a pipelined shuffle.

What holds across a crash of the task (a Spark worker killed mid-interval):
- a retried task resumes from the later of the plan's positions and the
  group's committed offsets, so steps the instance committed are not redone;
- a redone step of stage 0 goes per record wherever an earlier attempt may
  have sent combined messages: the combine bound is read afresh from the
  planned ends each step recorded before it ran (``combine_bounds``);
- a keyed step proves its store current and fences as in a micro-batch.

Judging time: idleness and ticks are the planner's, by the broker's offsets
and event time, the same as in micro-batch mode; the poll's back-off (1 ms
doubling to ``idle_poll_ms`` while nothing arrives) only bounds how soon
new records are seen.

Example::

    >>> positions = run_interval(plan)  # doctest: +SKIP
    >>> positions[0]["q"]  # doctest: +SKIP
    {'broker-a:0': 1200, 'broker-a:1': 1187}
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Any

from stream_assets.runtime.core.context import TaskStats
from stream_assets.runtime.drive.channel import ChannelClient
from stream_assets.runtime.drive.clients import admin_for
from stream_assets.runtime.drive.held_sends import GroupWentDown, HeldSends
from stream_assets.runtime.drive.planning import (
    QueueRange,
    StageOptions,
    StagePlanner,
    combine_bounds,
)
from stream_assets.runtime.drive.queues import TaskContext, run_range, run_source_queues

#: Allocations (net of frees) between two collections of the youngest generation
#: (Python's default: 700). A step keeps thousands of objects alive until it ends, so
#: at the default every collection met them and promoted them, and collections took
#: a sixth of a real-time WordCount task's time; at this threshold, 0.3 %. Garbage in
#: reference cycles waits a little longer for its collection: 20 000 objects, a few MiB.
_GC_YOUNGEST = 20_000
#: The first wait when nothing arrived; it doubles up to the plan's ``idle_poll_s``.
_FIRST_WAIT_S = 0.001
#: A stage that is behind (its step took its whole budget) doubles its next step's
#: budget, up to this many times ``step_max_records``; one that caught up goes back.
#: Each step's results (a count per key it touched) and fixed costs are paid per
#: step, so a backlog read in larger steps is read sooner; a step stays short
#: enough for a stop or a rebalance to wait on (a WordCount task's step with stage 0
#: at 8 000 messages, 160 000 lines, took 0.3-0.7 s on two cores).
CATCH_UP_GROWTH = 4
#: A position's entry for the ends stage 0 planned, per queue: the next interval's
#: combine bounds never go below them.
PLANNED = "planned"


@dataclass(frozen=True)
class IntervalPlan:
    """What one real-time task runs: some queues of some stages, from where, for how long."""

    #: Per stage this task reads: its context (pickled to the task, as in a micro-batch).
    contexts: dict[int, TaskContext]
    #: Per stage: what the planner reads, only this task's queues.
    options: dict[int, StageOptions]
    #: Per stage: the planner offsets to start from (``StagePlanner.initial`` form).
    positions: dict[int, dict[str, Any]]
    group: str
    #: The group that holds stage 0's planned ends (``Instance._planned_group``).
    planned_group: str
    interval_s: float
    step_max_records: int
    idle_poll_s: float
    #: Bytes of messages this task may hold for a group without a master (held_sends.py).
    held_send_bytes: int
    #: The instance's channel: address and token (:mod:`~stream_assets.runtime.drive.channel`).
    channel: tuple[str, str]


def run_interval(plan: IntervalPlan) -> dict[int, dict[str, Any]]:
    """Run ``plan`` until its interval ends or the instance says stop; the end positions."""
    youngest, older, oldest = gc.get_threshold()
    gc.set_threshold(max(_GC_YOUNGEST, youngest), older, oldest)
    client = ChannelClient(*plan.channel)
    try:
        task = _Task(plan)
        task.resume()
        # What lives before the first step (modules, clients, open stores, caches) lives
        # all interval: out of the collector's sight, a full collection walks only what
        # the interval made. It walked everything: 55-108 ms, a few times a run, a pause
        # for every record in flight. Back in sight when the interval ends.
        gc.freeze()
        deadline = time.monotonic() + plan.interval_s
        wait = _FIRST_WAIT_S
        while time.monotonic() < deadline and not client.stop_requested():
            rows, moved = task.step(client)
            if rows:
                client.send_rows(rows)
            if moved:
                wait = _FIRST_WAIT_S
                continue
            if client.wait(min(wait, max(0.0, deadline - time.monotonic()))):
                break
            wait = min(wait * 2, plan.idle_poll_s)
        rows = task.finish()
        if rows:
            client.send_rows(rows)
        return task.positions
    finally:
        gc.unfreeze()
        client.close()


def next_budget(budget: int, taken: int, base: int) -> int:
    """The next step's budget of records after a step that took ``taken`` of ``budget``:
    doubled while the stage is behind (it took all of it), up to
    :data:`CATCH_UP_GROWTH` times ``base``; ``base`` once it has caught up.

    >>> next_budget(2_000, 2_000, 2_000), next_budget(8_000, 8_000, 2_000)
    (4000, 8000)
    >>> next_budget(8_000, 1_200, 2_000)
    2000
    """
    if taken < budget:
        return base
    return min(budget * 2, base * CATCH_UP_GROWTH)


class _Task:
    """The planners and contexts of one task, and where each stage has got to."""

    def __init__(self, plan: IntervalPlan) -> None:
        self.plan = plan
        first = next(iter(plan.contexts.values()))
        settings = first.rocketmq
        outage = first.outage
        self.planners = {
            index: StagePlanner(index, opts, plan.group, lambda: admin_for(settings), outage)
            for index, opts in sorted(plan.options.items())
        }
        self.contexts = dict(plan.contexts)
        self.positions = {i: dict(p) for i, p in plan.positions.items()}
        #: Per stage, its next step's budget of records (see CATCH_UP_GROWTH).
        self.budgets = dict.fromkeys(plan.contexts, plan.step_max_records)
        # Pinned by every stage's layouts (one producer per process), as a step's own.
        producers = [ctx.producer for ctx in self.contexts.values()]
        for pin in producers:
            pin()
        self.held = HeldSends(
            producers[0], plan.held_send_bytes, retry_every_s=outage.backoff_max_s
        )

    def resume(self) -> None:
        """Start from what the group committed where that is later than the plan (a retry),
        with stage 0's combine bounds as the planned ends now say, never below the ends
        the last interval planned (carried in the plan: a master's successor may hold an
        older copy). A broker group that is down keeps its queues where the plan has
        them, and its source queues go per record (their bounds unknown)."""
        for index, planner in self.planners.items():
            committed = planner.committed_where_reachable()
            at = self.positions[index]
            at["q"] = {k: max(int(v), int(committed.get(k, v))) for k, v in at["q"].items()}
            ctx = self.contexts[index]
            stage = ctx.stage.stage
            if stage.source is not None and planner.opts.planned_group:
                planner.remember_planned(at.get(PLANNED, {}))
                self.contexts[index] = dataclasses.replace(
                    ctx, stage=dataclasses.replace(ctx.stage, combine_from=self._bounds(index))
                )

    def _bounds(self, index: int) -> tuple[tuple[int, int], ...]:
        ctx, planner = self.contexts[index], self.planners[index]
        topic = ctx.stage.stage.input_topic
        layout = planner.opts.layouts[topic]
        indices = planner.opts.queues if planner.opts.queues is not None else range(len(layout))
        known = planner.planned_ends()
        return combine_bounds(
            admin_for(ctx.rocketmq),
            topic,
            layout,
            self.plan.group,
            self.plan.planned_group,
            [layout.queue(q) for q in indices],
            floors={q: known[k] for q in indices if (k := planner.key_of(q)) in known},
        )

    def step(self, client: ChannelClient) -> tuple[list[dict[str, Any]], bool]:
        """One step of every stage: the stats rows, and whether any record was read."""
        # Before this step's rows, which win for a queue that holds messages again.
        self.held.retry()
        rows = [self._cleared(queue) for queue in self.held.take_cleared()]
        moved = False
        for index, planner in self.planners.items():
            start = self.positions[index]
            budget = self.budgets[index]
            end = planner.latest(start, budget)
            stage = self.contexts[index].stage.stage
            # A positioned stage's sends are all stored before its delta: never held.
            source = stage.source is not None and not stage.positioned
            ranges = planner.ranges(start, end)
            self.budgets[index] = next_budget(
                budget, sum(r.end - r.start for r in ranges), self.plan.step_max_records
            )
            moved = moved or any(r.end > r.start for r in ranges)
            together = self._together(index, ranges, client) if source else None
            if together is not None:
                rows += [stats.as_row() for stats in together]
                ranges = []
            for r in ranges:
                key = (index, r.queue_id)
                transport = self.held.transport(key, r.start) if source else None
                stats = run_range(self.contexts[index], r, client, transport)
                held = self.held.held_from(key) if source else None
                stats.held_from = -1 if held is None else held
                rows.append(stats.as_row())
            self.positions[index] = end
        return rows, moved

    def _together(
        self, index: int, ranges: list[QueueRange], client: ChannelClient
    ) -> list[TaskStats] | None:
        """A stateless source stage's ranges as one step, their partials pre-combined
        across the queues (stage0/across_queues.py); None: queue by queue, as when fewer
        than two read anything, or messages are held for a group without a master (a
        queue's must not overtake its held ones), or this step found one."""
        if sum(r.end > r.start for r in ranges) < 2 or self.held.groups:
            return None
        try:
            return run_source_queues(
                self.contexts[index], ranges, client, self.held.unheld_transport()
            )
        except GroupWentDown:  # what it sent is sent again per queue: replays, skipped
            return None

    def finish(self) -> list[dict[str, Any]]:
        """At the interval's end: send what is held if its group is back (the rows that
        commit it); a queue that still holds messages starts the next interval where
        they began, derived again from its source."""
        self.held.retry(force=True)
        rows = [self._cleared(queue) for queue in self.held.take_cleared()]
        for index, queue_id in self.held.queues():
            held = self.held.held_from((index, queue_id))
            assert held is not None
            self.positions[index]["q"][self.planners[index].key_of(queue_id)] = held
        for index, planner in self.planners.items():
            if planner.opts.planned_group:
                self.positions[index][PLANNED] = planner.planned_ends()
        return rows

    def _cleared(self, queue: tuple[int, int]) -> dict[str, Any]:
        """The row that commits ``queue`` to where the task has read it: nothing held now."""
        index, queue_id = queue
        at = int(self.positions[index]["q"][self.planners[index].key_of(queue_id)])
        return TaskStats(stage=index, queue_id=queue_id, end_offset=at).as_row()
