"""Reset a topology to its first offset or to a time, so its results are recomputed from there.

What a reset changes, and why each part is needed (nothing else is touched;
sinks keep what they received):

1. **Source topics**: the consumer group's committed offset of every queue
   goes to the first message stored at or after the time (RocketMQ's search
   by store timestamp), or to the queue's first stored offset. The same
   offsets go to ``<group>-planned``, the group where stage 0 records planned
   batch ends (see ``Instance._combine_from``): nothing of the new run was sent
   yet, so it may pre-combine from there.
2. **Shuffle topics**: each queue's committed offset goes to the queue's end.
   Shuffle messages from before the reset must never be applied again; the
   sources send anew everything that is recomputed.
3. **State topics**: every queue that holds state gets an empty snapshot
   appended (:mod:`stream_assets.state.reset`). Stores live on executors,
   maybe other machines, so deleting directories cannot reach them all; the
   state topic can. Every stateful batch proves its store current against its
   state queue first, so each store is found behind and restores from that
   snapshot: no values, no applied origins (so nothing recomputed is skipped
   as a duplicate), no watermark.
4. **Local stores** of the job under the given state root (this machine):
   wiped, which saves each of them a restore.

It refuses to run while anything still runs the topology: the Dagster checks
are in :mod:`stream_assets.control.reset_guard`; here, :func:`apply_reset`
first re-reads everything the plan recorded and refuses if a committed
offset or a shuffle or state queue moved since, or a local store is open in
another process, changing nothing. A reset that fails half-way is completed
by running it again (every step sets a value; none adds to one).

Example::

    >>> plan = plan_reset(topology, parse_reset_time("2025-11-21T14:30:00Z"),
    ...                   admin, reader, state_root=Path(".local/state"))  # doctest: +SKIP
    >>> print(plan.describe())  # doctest: +SKIP
    >>> apply_reset(plan, admin, progress=print)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer
from stream_assets.rocketmq.errors import TopicNotFoundError
from stream_assets.rocketmq.layout import current_layout
from stream_assets.rocketmq.provision import plan_topology_upgrade
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.runtime.core.send_buffer import SendBuffer
from stream_assets.state.changelog import MessageSender
from stream_assets.state.errors import StateLockedError
from stream_assets.state.paths import StoreLocation, job_dir, job_stores
from stream_assets.state.reset import (
    EmptySnapshot,
    StateQueueHead,
    append_empty_snapshot,
    inspect_state_queue,
)
from stream_assets.state.store import QueueStateStore

#: Reset to each queue's first stored offset.
EARLIEST: Literal["earliest"] = "earliest"
ResetTarget = int | Literal["earliest"]
Progress = Callable[[str], None]

#: Epoch milliseconds below this are taken for a mistake (seconds, most likely): 1973-03-03.
_MIN_EPOCH_MS = 100_000_000_000
#: How many differences a refusal lists by name.
_NAMED = 5


class ResetRefusedError(RuntimeError):
    """The reset would not be safe now (something still runs the topology); nothing was changed."""


def parse_reset_time(text: str) -> ResetTarget:
    """``"earliest"`` (or empty) or a time: epoch milliseconds, or ISO 8601 with a UTC offset.

    >>> parse_reset_time("2025-11-21T14:30:00Z"), parse_reset_time("1763735400000")
    (1763735400000, 1763735400000)
    >>> parse_reset_time("2025-11-21T15:30:00.5+01:00"), parse_reset_time("")
    (1763735400500, 'earliest')
    """
    value = text.strip()
    if value in ("", EARLIEST):
        return EARLIEST
    if value.isdigit():
        ms = int(value)
        if ms < _MIN_EPOCH_MS:
            raise ValueError(
                f"reset time {value} as epoch milliseconds is {format_time(ms)}; epoch seconds? "
                f"Give milliseconds ({ms * 1000}) or an ISO 8601 time such as "
                "2025-11-21T14:30:00Z"
            )
        return ms
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"reset time {value!r} is neither epoch milliseconds nor an ISO 8601 time; "
            "examples: 1763735400000, 2025-11-21T14:30:00Z, 2025-11-21T15:30:00+01:00"
        ) from None
    if when.tzinfo is None:
        raise ValueError(
            f"reset time {value!r} has no UTC offset, so it could mean any time zone; "
            f"add one: {value}Z for UTC, or e.g. {value}+01:00"
        )
    return (when - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)


def format_time(ms: int) -> str:
    """Epoch milliseconds as an ISO 8601 UTC time.

    >>> format_time(1763735400123)
    '2025-11-21T14:30:00.123Z'
    """
    when = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


@dataclass(frozen=True)
class OffsetMove:
    """One committed offset to set: ``group`` on ``queue``, from ``current`` (None: never
    committed) to ``new``."""

    group: str
    queue: MessageQueue
    current: int | None
    new: int

    def describe(self) -> str:
        """``queue 0: 1200 -> 600`` with what the move means."""
        was = "not committed" if self.current is None else str(self.current)
        line = f"queue {self.queue.queue_id}: {was} -> {self.new}"
        if self.current is not None and self.new != self.current:
            moved = self.current - self.new
            line += f" (replays {moved})" if moved > 0 else f" (skips {-moved})"
        return line


@dataclass(frozen=True)
class TopicReset:
    """The offsets of one stage input topic: a ``source`` or a ``shuffle`` topic."""

    topic: str
    role: Literal["source", "shuffle"]
    moves: tuple[OffsetMove, ...]
    #: Shuffle topics: each queue's end when planned (anything appended since means
    #: a stage still writes to it).
    ends: tuple[tuple[MessageQueue, int], ...] = ()


@dataclass(frozen=True)
class ResetPlan:
    """What :func:`apply_reset` will do; :meth:`describe` says it in words.

    Example::

        >>> plan = plan_reset(topology, EARLIEST, admin, reader)  # doctest: +SKIP
        >>> [m.new for t in plan.topics for m in t.moves]  # doctest: +SKIP
        [0, 0, 0, 0, 0, 0, 0, 0, 12, 9, 14, 7]
    """

    job_id: str
    group: str
    planned_group: str
    target: ResetTarget
    topics: tuple[TopicReset, ...]
    state: tuple[StateQueueHead, ...]
    #: None: local stores are not touched.
    state_root: Path | None
    local_stores: tuple[StoreLocation, ...]
    #: Local stores another process had open when planned.
    held_stores: tuple[StoreLocation, ...] = ()
    #: Topics of the topology the broker does not have (it never ran): nothing to reset there.
    missing_topics: tuple[str, ...] = ()
    planned_at_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    @property
    def target_text(self) -> str:
        """The target in words."""
        if isinstance(self.target, int):
            return f"{format_time(self.target)} ({self.target} ms, broker store time)"
        return "the earliest offsets"

    def describe(self) -> str:
        """The plan, step by step and queue by queue, for a person to confirm."""
        lines = [
            f"Reset of topology {self.job_id!r} (consumer group {self.group!r}) to "
            f"{self.target_text}:"
        ]
        step = 0
        for topic in self.topics:
            step += 1
            if topic.role == "source":
                where = (
                    "its first stored message"
                    if self.target == EARLIEST
                    else "its first message stored at or after that time"
                )
                lines.append(
                    f"{step}. source topic {topic.topic}: each queue to {where} "
                    f"(groups {self.group!r} and {self.planned_group!r})"
                )
            else:
                lines.append(
                    f"{step}. shuffle topic {topic.topic}: each queue to its end, so no "
                    "shuffle message from before the reset is applied again"
                )
            lines += [f"     {m.describe()}" for m in topic.moves if m.group == self.group]
        for state_topic in dict.fromkeys(h.queue.topic for h in self.state):
            step += 1
            lines.append(
                f"{step}. state topic {state_topic}: an empty snapshot appended to every queue "
                "that holds state; every store, on any executor, restores to empty"
            )
            for h in self.state:
                if h.queue.topic != state_topic:
                    continue
                if h.empty:
                    lines.append(f"     queue {h.queue.queue_id}: empty already, nothing to write")
                else:
                    lines.append(
                        f"     queue {h.queue.queue_id}: ends at offset {h.end}, seq {h.seq}, "
                        f"generation {h.generation} -> empty snapshot at offset {h.end}, "
                        f"seq {h.seq + 1}"
                    )
        step += 1
        if self.state_root is None:
            lines.append(f"{step}. local stores: not touched (no state root given)")
        else:
            lines.append(
                f"{step}. local stores under {job_dir(self.state_root, self.job_id)}: "
                f"{len(self.local_stores)} wiped "
                "(they would restore to empty anyway; wiping saves the restores)"
            )
        for topic_name in self.missing_topics:
            lines.append(f"   (topic {topic_name} does not exist yet: nothing to reset there)")
        if isinstance(self.target, int) and self.target > self.planned_at_ms:
            lines.append(
                "   note: the time is in the future: every source queue goes to its end and "
                "nothing is replayed"
            )
        for held in self.held_stores:
            lines.append(
                f"   refused: local store {held.path} is open in another process: an instance "
                "of this job seems to run on this machine"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class ResetResult:
    """What :func:`apply_reset` did."""

    plan: ResetPlan
    offsets_committed: int
    snapshots: tuple[EmptySnapshot, ...]
    wiped: tuple[Path, ...]
    seconds: float

    def describe(self) -> str:
        """One line."""
        return (
            f"reset {self.plan.job_id} to {self.plan.target_text}: {self.offsets_committed} "
            f"offsets committed, {len(self.snapshots)} state queues emptied, "
            f"{len(self.wiped)} local stores wiped, in {self.seconds:.1f}s"
        )


def plan_reset(
    topology: Topology,
    to: ResetTarget,
    admin: RocketMQAdmin,
    reader: QueueReader,
    group: str | None = None,
    state_root: Path | None = None,
    progress: Progress | None = None,
    operators: Collection[str] | None = None,
) -> ResetPlan:
    """Read where ``topology`` stands and work out its reset to ``to``; changes nothing.

    ``operators``: only these stateful operators (by the id they run under) lose their
    state: their shuffle topics go to their ends and their state topics get empty
    snapshots; the sources keep their offsets (dropping state in an upgrade).

    ``to``: :data:`EARLIEST` or epoch milliseconds (compared with the broker's
    store time of each message). ``group``: the consumer group its instances
    use (default: the job id). ``state_root``: where this machine keeps the
    job's RocksDB state (None: leave local stores alone).

    Example::

        >>> plan = plan_reset(wordcount.build(), 1763735400000, admin, reader)  # doctest: +SKIP
        >>> print(plan.describe())  # doctest: +SKIP
        Reset of topology 'wordcount' (consumer group 'wordcount') to 2025-11-21T14:30:00.000Z ...
    """
    say = progress or (lambda _line: None)
    # The topics the job runs under (an earlier release's names included).
    topology = plan_topology_upgrade(admin, topology, find_unclaimed=False).topology
    group = group or topology.job_id
    planned_group = f"{group}-planned"
    topics: list[TopicReset] = []
    missing: list[str] = []
    for stage in topology.stages:
        if operators is not None and (stage.head is None or stage.head.op_id not in operators):
            continue
        source = stage.source is not None
        say(f"reading offsets of {'source' if source else 'shuffle'} topic {stage.input_topic}")
        try:
            queues = admin.queues(stage.input_topic)
        except TopicNotFoundError:
            if source:
                raise ValueError(
                    f"source topic {stage.input_topic!r} of topology {topology.job_id!r} does not "
                    "exist: there is nothing to reset (create it and deploy the topology first)"
                ) from None
            missing.append(stage.input_topic)
            continue
        ranges = admin.topic_offsets(stage.input_topic, queues)
        committed = admin.group_offsets(group, stage.input_topic, queues)
        if source:
            planned = admin.group_offsets(planned_group, stage.input_topic, queues)
            if isinstance(to, int):
                targets = {q: admin.offset_for_timestamp(q, to) for q in queues}
            else:
                targets = {q: ranges[q].min_offset for q in queues}
            moves = [OffsetMove(group, q, committed[q], targets[q]) for q in queues]
            moves += [OffsetMove(planned_group, q, planned[q], targets[q]) for q in queues]
            topics.append(TopicReset(stage.input_topic, "source", tuple(moves)))
        else:
            ends = tuple((q, ranges[q].max_offset) for q in queues)
            moves = [OffsetMove(group, q, committed[q], end) for q, end in ends]
            topics.append(TopicReset(stage.input_topic, "shuffle", tuple(moves), ends))
    heads: list[StateQueueHead] = []
    dropped = [
        s.state_topic
        for s in topology.stages
        if s.head is not None and s.state_topic and s.head.op_id in (operators or ())
    ]
    for state_topic in topology.state_topics if operators is None else dropped:
        say(f"reading the end of every queue of state topic {state_topic}")
        try:
            queues = admin.queues(state_topic)
        except TopicNotFoundError:
            missing.append(state_topic)
            continue
        heads += [inspect_state_queue(admin, reader, q) for q in queues]
    stores = job_stores(state_root, topology.job_id) if state_root is not None else []
    if operators is not None:
        stores = [s for s in stores if s.operator_id in operators]
    return ResetPlan(
        job_id=topology.job_id,
        group=group,
        planned_group=planned_group,
        target=to,
        topics=tuple(topics),
        state=tuple(heads),
        state_root=state_root,
        local_stores=tuple(stores),
        held_stores=tuple(s for s in stores if _held(s)),
        missing_topics=tuple(missing),
    )


def apply_reset(
    plan: ResetPlan,
    admin: RocketMQAdmin,
    sender: MessageSender | None = None,
    progress: Progress | None = None,
    writer: str | None = None,
) -> ResetResult:
    """Carry out ``plan``, after checking that nothing moved since it was made.

    Raises :class:`ResetRefusedError`, changing nothing, if a committed offset,
    a shuffle or state queue's end moved since :func:`plan_reset` (an instance
    still runs) or a local store is open in another process. ``sender``:
    where state records go (default: a batching producer of ``admin``'s
    settings). ``writer`` names the reset in the state's meta (default:
    ``reset:<time>``). Steps are reported to ``progress`` topic by topic.

    Example::

        >>> result = apply_reset(plan, admin, progress=print)  # doctest: +SKIP
        >>> print(result.describe())  # doctest: +SKIP
        reset wordcount to the earliest offsets: 24 offsets committed, 8 state queues ...
    """
    say = progress or (lambda _line: None)
    started = time.monotonic()
    refuse_if_moved(plan, admin)
    committed = 0
    for topic in plan.topics:
        by_group: dict[str, dict[MessageQueue, int]] = {}
        for move in topic.moves:
            by_group.setdefault(move.group, {})[move.queue] = move.new
        for group, offsets in by_group.items():
            admin.commit_consumer_offsets(group, offsets)
            committed += len(offsets)
        say(
            f"{topic.role} topic {topic.topic}: committed {len(topic.moves)} offsets "
            f"(groups {', '.join(repr(g) for g in by_group)})"
        )
    writer = writer or f"reset:{format_time(plan.planned_at_ms)}"
    snapshots = _empty_state(plan, admin, sender, writer, say)
    wiped = wipe_local_stores(plan.local_stores, say)
    return ResetResult(plan, committed, tuple(snapshots), tuple(wiped), time.monotonic() - started)


def refuse_if_moved(plan: ResetPlan, admin: RocketMQAdmin) -> None:
    """Raise :class:`ResetRefusedError` if anything ``plan`` read has moved since.

    A moved committed offset, shuffle end or state end means some instance is
    still running the topology; a local store open elsewhere, that one runs on
    this machine. Example::

        >>> refuse_if_moved(plan, admin)  # doctest: +SKIP
    """
    moved: list[str] = []
    for topic in plan.topics:
        groups = dict.fromkeys(m.group for m in topic.moves)
        for group in groups:
            moves = [m for m in topic.moves if m.group == group]
            now = admin.group_offsets(group, topic.topic, [m.queue for m in moves])
            moved += [
                f"offset of {group!r} on {m.queue.topic}[{m.queue.queue_id}]: "
                f"{m.current} -> {now[m.queue]}"
                for m in moves
                if now[m.queue] != m.current
            ]
        if topic.ends:
            ends = admin.topic_offsets(topic.topic, [q for q, _ in topic.ends])
            moved += [
                f"end of {q.topic}[{q.queue_id}]: {end} -> {ends[q].max_offset}"
                for q, end in topic.ends
                if ends[q].max_offset != end
            ]
    for head in plan.state:
        end = admin.max_offset(head.queue)
        if end != head.end:
            moved.append(f"end of {head.queue.topic}[{head.queue.queue_id}]: {head.end} -> {end}")
    held = [s for s in plan.local_stores if _held(s)]
    if held:
        paths = ", ".join(str(s.path) for s in held[:_NAMED])
        raise ResetRefusedError(
            f"refusing to reset {plan.job_id}: local state store(s) {paths} are open in another "
            "process, so an instance of the job seems to run on this machine. Stop it (every "
            "instance, everywhere) and plan the reset again. Nothing was changed."
        )
    if moved:
        more = f" and {len(moved) - _NAMED} more" if len(moved) > _NAMED else ""
        raise ResetRefusedError(
            f"refusing to reset {plan.job_id}: {'; '.join(moved[:_NAMED])}{more} changed since "
            "the plan was made, so an instance still runs the topology. Stop every instance and "
            "plan the reset again. Nothing was changed."
        )


def _empty_state(
    plan: ResetPlan,
    admin: RocketMQAdmin,
    sender: MessageSender | None,
    writer: str,
    say: Progress,
) -> list[EmptySnapshot]:
    todo = [h for h in plan.state if not h.empty]
    if not todo:
        return []
    producer: BatchProducer | None = None
    if sender is None:
        producer = BatchProducer(admin.settings, admin).start()
        sender = SendBuffer(producer)
    try:
        done: list[EmptySnapshot] = []
        for state_topic in dict.fromkeys(h.queue.topic for h in todo):
            heads = [h for h in todo if h.queue.topic == state_topic]
            layout = current_layout(admin, state_topic)
            if producer is not None:
                producer.pin([layout])
            done += [
                append_empty_snapshot(h.queue, h, sender, writer, layout.index(h.queue))
                for h in heads
            ]
            say(
                f"state topic {state_topic}: empty snapshot appended to queues "
                f"{[h.queue.queue_id for h in heads]}"
            )
        return done
    finally:
        if producer is not None:
            producer.close()


def wipe_local_stores(
    stores: Sequence[StoreLocation], progress: Progress | None = None
) -> list[Path]:
    """Delete ``stores``; returns their paths. Raises :class:`ResetRefusedError` for one that
    another process holds (a running instance), before deleting anything.

    Example::

        >>> stores = job_stores(Path(".local/state"), "wordcount")  # doctest: +SKIP
        >>> wipe_local_stores(stores, print)  # doctest: +SKIP
    """
    held = [s for s in stores if _held(s)]
    if held:
        raise ResetRefusedError(
            f"local state store {held[0].path} is open in another process: an instance of "
            f"{held[0].job_id} seems to run on this machine; stop it first"
        )
    for local in stores:
        QueueStateStore.at(local).wipe()
    if stores and progress is not None:
        where = job_dir(stores[0].root, stores[0].job_id)
        progress(f"wiped {len(stores)} local stores under {where}")
    return [s.path for s in stores]


def _held(local: StoreLocation) -> bool:
    """Whether another process has ``local`` open (asks nothing of it: no release request)."""
    if not local.path.is_dir():
        return False
    store = QueueStateStore.at(local)
    try:
        store.open(wait_s=0)
    except StateLockedError:
        return True
    store.close()
    return False
