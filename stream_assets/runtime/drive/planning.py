"""Which offsets a stage reads next: its queues' start and end, ticks, idle origins.

Spark-free: the ``rocketmq`` Spark source (:mod:`stream_assets.runtime.spark.source`)
plans its micro-batches with it, and a real-time task
(:mod:`stream_assets.runtime.drive.interval`) plans each of its steps with it, so
idleness, ticks, the planned ends and the fair share of a budget are the same
in both modes.

Idleness (a stage's ``origin_topics``, ``idle_timeout_ms``): for a keyed stage
the planner also watches the topics its origins read (the input topics of
the upstream stages; ``topic=base`` pairs, an origin id being base + queue
id). An origin is idle when its queue's broker end offset has not moved for
the idle timeout and the stage that reads it has committed everything up to
that end; such origins are listed in each range's ``idle``, but only in a
plan that reads every stage queue to its end. Time between batches plays no
part, so a slow batch never fires a window.

Example::

    >>> StageOptions(topic="orders", queues=(0, 2)).to_json()["queues"]
    [0, 2]
    >>> _cap({"a": 0, "b": 0}, {"a": 10, "b": 2}, budget=6)
    ({'a': 4, 'b': 2}, True)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stream_assets.rocketmq.admin import MessageQueue, QueueOffsets, RocketMQAdmin
from stream_assets.rocketmq.errors import BrokerUnreachableError, RemotingError
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.runtime.drive.outage import (
    FAIL_AT_ONCE,
    OutagePolicy,
    ride_out_outage,
    stderr_log,
)

T = TypeVar("T")


@dataclass(frozen=True)
class QueueRange:
    """One queue's slice of a micro-batch, and the source queues idle when it was planned."""

    queue_id: int
    start: int
    end: int
    idle: tuple[int, ...] = ()
    #: The stage whose input queue this is.
    stage: int = 0


@dataclass(frozen=True)
class StageOptions:
    """What the source reads for one stage: its input queues, ticks and origins.

    Example::

        >>> StageOptions(topic="orders", queues=(0, 2)).to_json()["queues"]
        [0, 2]
    """

    topic: str
    #: Queue indices in the topic's layout (None: all of them).
    queues: tuple[int, ...] | None = None
    tick_ms: int = 0
    #: (topic, origin id of its queue 0) per upstream input topic of a keyed stage.
    origin_topics: tuple[tuple[str, int], ...] = ()
    idle_timeout_ms: int = 0
    #: Where the planner records each batch's end before the batch runs (see
    #: _planned_group in runtime/spark/instance.py); None: not recorded.
    planned_group: str | None = None
    #: The layouts of ``topic`` and of the origin topics (queue index -> broker, id).
    layouts: dict[str, TopicLayout] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """This stage's part of the ``stages`` option (no secrets: safe in a plan)."""
        return {
            "topic": self.topic,
            "queues": None if self.queues is None else list(self.queues),
            "tick_ms": self.tick_ms,
            "origin_topics": [list(pair) for pair in self.origin_topics],
            "idle_timeout_ms": self.idle_timeout_ms,
            "planned_group": self.planned_group,
            "layouts": {t: layout.encode() for t, layout in self.layouts.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageOptions:
        """What :meth:`to_json` wrote."""
        queues = data.get("queues")
        return cls(
            topic=str(data["topic"]),
            # [] is an assignment of no queues (an idle instance), not "all queues".
            queues=None if queues is None else tuple(int(q) for q in queues),
            tick_ms=int(data.get("tick_ms", 0)),
            origin_topics=tuple((str(t), int(b)) for t, b in data.get("origin_topics", ())),
            idle_timeout_ms=int(data.get("idle_timeout_ms", 0)),
            planned_group=data.get("planned_group") or None,
            layouts={t: TopicLayout.decode(t, code) for t, code in data.get("layouts", {}).items()},
        )


def encode_stages(stages: Mapping[int, StageOptions]) -> str:
    """The ``stages`` option: stage index -> what the source reads for it, as JSON."""
    return json.dumps({str(index): opts.to_json() for index, opts in stages.items()})


def position_key(queue: MessageQueue) -> str:
    """A queue's key in a planner offset's ``q`` map (broker groups repeat queue ids)."""
    return f"{queue.broker_name}:{queue.queue_id}"


class StagePlanner:
    """One stage's part of the plan: its queues' start and end offsets, ticks, idle origins.

    An offset here is ``{"q": {queue key: offset}, "tick": n, "idle": [origin ids]}``.
    """

    def __init__(
        self,
        index: int,
        opts: StageOptions,
        group: str,
        admin: Callable[[], RocketMQAdmin],
        outage: OutagePolicy = FAIL_AT_ONCE,
    ) -> None:
        self.index = index
        self.opts = opts
        self._group = group
        self._outage = outage
        self._admin = admin
        # Per source queue: (end offset, monotonic time it was first seen at that end).
        self._origin_ends: dict[tuple[str, MessageQueue], tuple[int, float]] = {}
        self._planned: dict[str, int] = {}  # ends recorded in the planned group
        self._planned_loaded: set[str] = set()  # broker groups whose stored ends are in it
        # Spark may create the reader late (a query's first batch), even while
        # the broker restarts: every broker call here rides out an outage.
        layout = opts.layouts.get(opts.topic)
        if layout is None:
            layout = self._ride(lambda: TopicLayout.of(self._admin().queues(opts.topic)), "queues")
        self._layout = layout
        indices = opts.queues if opts.queues is not None else range(len(layout))
        self._queues = [layout.queue(i) for i in indices]
        #: Broker groups found unreachable, reported once per outage.
        self._down: set[tuple[str, str]] = set()

    def _ride(self, step: Callable[[], T], what: str) -> T:
        return ride_out_outage(step, policy=self._outage, what=f"source {self.opts.topic}: {what}")

    def _key(self, queue: MessageQueue) -> str:
        return position_key(queue)

    def initial(self) -> dict[str, Any]:
        """The committed offset of every queue (the min offset where never committed)."""

        def start_offsets() -> dict[str, int]:
            # One round trip per broker for the committed offsets, and one more
            # for the min offsets only if some queue was never committed.
            admin = self._admin()
            committed = admin.group_offsets(self._group, self.opts.topic, self._queues)
            never = [q for q, offset in committed.items() if offset is None]
            floors = admin.topic_offsets(self.opts.topic, never)
            return {
                self._key(q): offset if offset is not None else floors[q].min_offset
                for q, offset in committed.items()
            }

        return {"q": self._ride(start_offsets, "start offsets"), "tick": 0, "idle": []}

    def key_of(self, queue_index: int) -> str:
        """The position key of this stage's queue of index ``queue_index``."""
        return self._key(self._layout.queue(queue_index))

    def planned_ends(self) -> dict[str, int]:
        """Per queue (position key), the highest batch end planned that this planner knows."""
        return dict(self._planned)

    def remember_planned(self, ends: Mapping[str, int]) -> None:
        """Take ``ends`` an earlier planner of the stage recorded: a planned end never goes
        down, yet a slave promoted since may hold an older copy of them (a slave syncs
        consumer offsets every few seconds)."""
        for key, end in ends.items():
            self._planned[key] = max(int(end), self._planned.get(key, -1))

    def committed_where_reachable(self) -> dict[str, int]:
        """The committed offsets of the queues whose broker group answers now.

        A real-time task resuming while a group is down keeps that group's
        queues where its plan has them (they are not read until it is back)
        rather than wait for it, as :meth:`initial` would.
        """
        return {
            self._key(q): o
            for committed in self._reachable_group_offsets(self._group).values()
            for q, o in committed.items()
            if o is not None
        }

    def _reachable_group_offsets(
        self, group: str, skip: set[str] | frozenset[str] = frozenset()
    ) -> dict[str, dict[MessageQueue, int | None]]:
        """``group``'s offsets of this stage's queues, per broker group that answers
        (one round trip each; those in ``skip`` are not asked)."""
        found = {}
        for broker, on_broker in by_group(self._queues).items():
            if broker in skip:
                continue
            try:
                found[broker] = self._admin().group_offsets(group, self.opts.topic, on_broker)
            except (BrokerUnreachableError, RemotingError):
                continue  # its queues are not read, nor planned forward, while it is down
        return found

    def latest(self, start: dict[str, Any], budget: int | None) -> dict[str, Any]:
        """The next batch's end: what is available, at most ``budget`` records."""
        # Idle source queues first: their committed ends were durable (shuffle
        # sent) before the stage queues' end offsets are read below.
        idle = self._ride(self._idle_origins, "idle check") if self.opts.origin_topics else []
        begin: dict[str, int] = start["q"]
        available = self._ride(lambda: self._end_offsets(begin), "latest offsets")
        end, capped = _cap(begin, available, budget)
        if self.opts.planned_group:
            end = self._ride(lambda: self._record_planned(begin, end), "planned offsets")
        tick = int(start.get("tick", 0))
        if self.opts.tick_ms > 0:
            tick = max(tick, int(time.time() * 1000) // self.opts.tick_ms)
        # A batch that stops short of the end has input still to read: nothing is idle.
        return {"q": end, "tick": tick, "idle": [] if capped else idle}

    def _record_planned(self, begin: dict[str, int], end: dict[str, int]) -> dict[str, int]:
        """Store the batch's end offsets before any task runs: the most a run that
        crashes in this batch can have sent, which bounds what a later run must
        not pre-combine (``StageContext.combine_from``). Returns the ends to
        plan: a broker group whose master cannot store them now keeps its
        queues at ``begin`` for this batch."""
        assert self.opts.planned_group is not None
        self._load_planned()
        moved: dict[str, dict[MessageQueue, int]] = {}
        for q in self._queues:
            if end[self._key(q)] > self._planned.get(self._key(q), -1):
                moved.setdefault(q.broker_name, {})[q] = end[self._key(q)]
        planned = dict(end)
        for on_broker in moved.values():
            try:
                self._admin().commit_consumer_offsets(self.opts.planned_group, on_broker)
            except BrokerUnreachableError:
                for q in on_broker:
                    planned[self._key(q)] = begin[self._key(q)]
                continue
            self._planned.update({self._key(q): off for q, off in on_broker.items()})
        return planned

    def _load_planned(self) -> None:
        """The planned ends already stored, once per broker group: a planned end never
        goes down. A run that starts below it (after a crash, or a real-time task
        deriving a held range again) must not lower it, or a later start would
        pre-combine records an earlier run already sent (``combine_bounds``)."""
        assert self.opts.planned_group is not None
        stored_by_group = self._reachable_group_offsets(
            self.opts.planned_group, self._planned_loaded
        )
        for broker, stored in stored_by_group.items():
            self._planned_loaded.add(broker)
            for q, offset in stored.items():
                if offset is not None:
                    key = self._key(q)
                    self._planned[key] = max(offset, self._planned.get(key, -1))

    def _end_offsets(self, begin: dict[str, int]) -> dict[str, int]:
        """The broker's end offset of every assigned queue (one request per broker);
        a broker group that cannot be reached holds its queues at ``begin``."""
        found = self._reachable_offsets(self.opts.topic, self._queues)
        return {
            self._key(q): found[q].max_offset if q in found else begin[self._key(q)]
            for q in self._queues
        }

    def _reachable_offsets(
        self, topic: str, queues: list[MessageQueue]
    ) -> dict[MessageQueue, QueueOffsets]:
        """Offsets of ``queues``, leaving out those of broker groups unreachable now.

        A group that is down (master and slave, or gone from the route) is an
        outage the other groups' queues do not wait for; with only its master
        down, reads go to its slave.
        """
        found: dict[MessageQueue, QueueOffsets] = {}
        for broker, on_broker in by_group(queues).items():
            try:
                found.update(self._admin().topic_offsets(topic, on_broker))
            except (BrokerUnreachableError, RemotingError) as exc:
                # RemotingError: e.g. a slave that has not learnt the topic yet.
                if (topic, broker) not in self._down:
                    self._down.add((topic, broker))
                    stderr_log(f"source {topic}: {exc}; its queues wait, the others go on")
                continue
            if (topic, broker) in self._down:
                self._down.discard((topic, broker))
                stderr_log(f"source {topic}: broker group {broker} is back")
        return found

    def _idle_origins(self) -> list[int]:
        """Origins idle by the broker's offsets: end unmoved for the idle timeout,
        and committed to that end by the stage that reads them. An origin whose
        broker group cannot be reached is not idle: its records may yet come."""
        now = time.monotonic()
        idle = []
        for topic, base in self.opts.origin_topics:
            layout = self.opts.layouts.get(topic) or TopicLayout.of(self._admin().queues(topic))
            ranges = self._reachable_offsets(topic, layout.queues)
            unmoved = []
            for queue, offsets in ranges.items():
                end = offsets.max_offset
                seen = self._origin_ends.get((topic, queue))
                if seen is None or seen[0] != end:
                    self._origin_ends[(topic, queue)] = seen = (end, now)
                if (now - seen[1]) * 1000 >= self.opts.idle_timeout_ms:
                    unmoved.append(queue)
            # Committed offsets after the ends: a commit at or past the end read
            # above means the stage processed everything the queue held then.
            try:
                committed = self._admin().group_offsets(self._group, topic, unmoved)
            except BrokerUnreachableError:
                continue
            for queue in unmoved:
                floor = committed[queue]
                if floor is None:
                    floor = ranges[queue].min_offset
                if floor >= ranges[queue].max_offset:
                    idle.append(base + layout.index(queue))
        return idle

    def ranges(self, start: dict[str, Any], end: dict[str, Any]) -> list[QueueRange]:
        """The queues this stage reads in the batch from ``start`` to ``end``."""
        ticked = end.get("tick", 0) != start.get("tick", 0)
        idle = tuple(end.get("idle", ()))
        ranges = []
        for queue in self._queues:
            if (self.opts.topic, queue.broker_name) in self._down:
                continue  # a tick must not send a task to a group that is down
            key = self._key(queue)
            lo, hi = int(start["q"].get(key, 0)), int(end["q"][key])
            if hi > lo or ticked:
                ranges.append(QueueRange(self._layout.index(queue), lo, hi, idle, self.index))
        return ranges


def by_group(queues: list[MessageQueue]) -> dict[str, list[MessageQueue]]:
    """``queues`` per broker group, in order."""
    by_group: dict[str, list[MessageQueue]] = {}
    for q in queues:
        by_group.setdefault(q.broker_name, []).append(q)
    return by_group


def _cap(
    begin: dict[str, int], available: dict[str, int], budget: int | None
) -> tuple[dict[str, int], bool]:
    """End offsets: all that is available, or at most ``budget`` records shared fairly;
    with whether the budget cut anything short.

    Fair share: every queue with a backlog gets an equal slice; slices a queue
    cannot use go to the others, so one busy queue does not starve.
    """
    backlog = {k: max(0, available[k] - begin.get(k, available[k])) for k in available}
    if budget is None or sum(backlog.values()) <= budget:
        return {k: begin.get(k, available[k]) + backlog[k] for k in available}, False
    take = dict.fromkeys(available, 0)
    left = budget
    pending = [k for k in available if backlog[k] > 0]
    while left > 0 and pending:
        share = max(1, left // len(pending))
        for k in list(pending):
            step = min(share, backlog[k] - take[k], left)
            take[k] += step
            left -= step
            if take[k] >= backlog[k]:
                pending.remove(k)
            if left == 0:
                break
    return {k: begin.get(k, available[k]) + take[k] for k in available}, True


def combine_bounds(
    admin: RocketMQAdmin,
    topic: str,
    layout: TopicLayout,
    group: str,
    planned_group: str,
    queues: list[MessageQueue] | None = None,
    floors: Mapping[int, int] | None = None,
) -> tuple[tuple[int, int], ...]:
    """Per source queue index (of ``queues``, default all), the offset from which
    stage 0 may pre-combine (``StageContext.combine_from``), never below its
    ``floors`` entry (the ends a running planner knows it planned); a queue left
    out goes per record.

    A run that crashed may have sent shuffle messages, cut at its own batch
    boundaries, up to the end of the batch it had planned; a combined
    message only de-duplicates against exactly those boundaries, so below
    that end records go per record. Where no end was ever planned, a group
    that never committed sent nothing (combine everything); one that
    committed without planned ends (an older version) is bounded only by
    the queue's end now. The planned ends are the master's: a slave's copy
    may be a sync interval old, and a bound too low pre-combines records
    already sent (their counts doubled), so a group without a master now
    goes per record.
    """
    wanted = layout.queues if queues is None else queues
    floors = floors or {}
    out = []
    for on_broker in by_group(list(wanted)).values():
        try:
            planned = admin.group_offsets(planned_group, topic, on_broker, from_master=True)
            ends = admin.topic_offsets(topic, on_broker)
            committed = admin.group_offsets(group, topic, on_broker)
        except (BrokerUnreachableError, RemotingError):
            continue
        for queue, offsets in ends.items():
            bound = planned.get(queue)
            if bound is None:
                bound = offsets.min_offset if committed.get(queue) is None else offsets.max_offset
            index = layout.index(queue)
            out.append((index, max(bound, floors.get(index, bound))))
    return tuple(out)
