"""What leaves a stage for the shuffle: keyed, routed, maybe pre-combined, then sent.

Every ``key_by`` a stage reaches is an exit (:class:`~stream_assets.plan.topology.Exit`).
For each element that reaches one, :meth:`ShuffleOut.key` computes the key,
its shuffle queue (stable hash of the packed key) and the entry to send
(``[side, value]`` for a join); :meth:`ShuffleOut.accept` keeps a record's
entries, and :meth:`ShuffleOut.send_all` sends one message per shuffle queue
per micro-batch (see :mod:`~stream_assets.runtime.core.shuffle_codec`), chunked
under the body limit (``MAX_BODY_BYTES``, or the broker's maxMessageSize if
smaller). An entry that alone would not fit a message under the broker's
limit (a huge key or value) fails in :meth:`ShuffleOut.key`, as its record's
dead letter, so a shuffle send never carries a message the broker refuses.

When a stage has one exit whose head is a decomposable aggregate, records are
pre-combined per key and window before sending (``combine``), except where
the caller forbids it (see ``StageContext.may_combine``).

Progress travels with the records (:mod:`~stream_assets.runtime.core.shuffle_codec`).
The origin's progress is the highest event time of every element it sent to
any exit, whatever its route (:meth:`ShuffleOut.observe`). It ends each
shuffle queue's batch, as a mark where the batch had nothing else for that
queue, and a record that its origin's progress before it makes late carries
that progress. The keyed stage thus judges a record by its source queue's own
progress, not by what happened to be routed to it. A shuffle queue's batch
goes per record, not pre-combined, when it holds such a record, so it is
judged exactly as without combining.

Example::

    >>> from stream_assets.examples import wordcount
    >>> from stream_assets.runtime.core.context import StageContext, TaskStats
    >>> ctx = StageContext.of(wordcount.build("wc", "in", "out"), 0, shuffle_queues=2)
    >>> out = ShuffleOut(ctx, sender=None, stats=TaskStats(), src=0, combine=False)
    >>> from stream_assets.runtime.core.shuffle_codec import unpack
    >>> [(target, unpack(entry)) for _k, _kb, target, _v, _ts, entry in out.key(0, [("hi", 5)], 7)]
    [(1, ['hi', 'hi', 5, 7, 0])]
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any, ClassVar

from stream_assets.operators.aggregates import Accumulator, Composite, Count
from stream_assets.plan import nodes as n
from stream_assets.plan.topology import Exit
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.runtime.core.context import MAX_BODY_BYTES, StageContext, TaskStats
from stream_assets.runtime.core.ports import Sender
from stream_assets.runtime.core.shuffle_codec import (
    ENVELOPE_BYTES,
    encode_combined,
    encode_key,
    encode_mark,
    pack_record,
    records_body,
    with_progress,
)
from stream_assets.runtime.core.stage0.chain import Element, UserFunctionError
from stream_assets.serde.packing import PackingError

# A combined message covers every offset of its batch: sub-index above any real one.
WHOLE_OFFSET = 2**31 - 1

#: (key bytes, window start, window end): one pre-combined entry of a shuffle queue.
EntryKey = tuple[bytes, Any, Any]
#: A per-record shuffle entry: packed, or (key, value, ts, offset, sub) still to pack.
Packable = bytes | tuple[Any, Any, int, int, int]
#: One keyed element: (key, key bytes, shuffle queue, value, ts, entry).
Keyed = tuple[Any, bytes, int, Any, int, Packable]
_INT64, _UINT64 = -(2**63), 2**64
_NO_WINDOW: tuple[None] = (None,)
#: Packed bytes of a per-record entry besides its key and value: the array header,
#: ts, offset and sub (9 bytes each at most), a join's side tag and a str/bin header.
ENTRY_OVERHEAD = 48
_TARGET, _TS = itemgetter(2), itemgetter(4)


class ShuffleOut:
    """One stage queue's shuffle sends for one micro-batch (origin ``src``)."""

    def __init__(
        self, ctx: StageContext, sender: Any, stats: TaskStats, src: int, *, combine: bool
    ) -> None:
        self.ctx = ctx
        self.sender: Sender = sender
        self.stats = stats
        self.src = src
        self.exits: tuple[Exit, ...] = ctx.stage.exits
        head = self.exits[0].head if len(self.exits) == 1 else None
        self.agg = head if isinstance(head, n.Aggregate) and not isinstance(head, n.Join) else None
        merging = bool(self.agg and self.agg.window is not None and self.agg.window.is_merging)
        self.combine = combine and ctx.stage.combine and self.agg is not None and not merging
        self.router = _KeyRouter.of(ctx.shuffle_queues)
        #: Target size of a shuffle message; chunks are cut under it.
        self.body_limit = min(MAX_BODY_BYTES, ctx.max_message_size)
        #: Largest packed entry: alone in a message, it must fit the broker's limit.
        self.entry_limit = ctx.max_message_size - ENVELOPE_BYTES
        # (shuffle topic, queue) -> [(entry, origin offset)]: exits to one topic (both
        # sides of a join from one stage) share one message and one origin order.
        self.per_record: dict[tuple[str, int], list[tuple[Packable, int]]] = defaultdict(list)
        self.combined: dict[int, dict[EntryKey, list[Any]]] = defaultdict(dict)
        #: Per shuffle queue, the elements its combined message stands for.
        self.combined_records: Counter[int] = Counter()
        #: Combining: the accepted records, (keyed, offset), unpacked into
        #: ``per_record`` only for the queues whose batch goes per record; a
        #: record the count path took is kept unkeyed, (values, ts); the records
        #: of a batch the batch count path took are made only when needed.
        self._accepted: list[tuple[list[Keyed] | tuple[list[Any], int], int]] = []
        self._taken_later: list[Callable[[], Iterable[tuple[list[Any], int, int]]]] = []
        #: Builds the accumulator from a slot's count when the aggregate only
        #: counts (see _counter_of); None: fold through the accumulator.
        self.count_acc = _counter_of(self.agg.accumulator) if self.agg is not None else None
        #: The origin's progress: the highest event time it read in this batch so far
        #: (a keyed stage's outbox sets it; see observe).
        self.progress: int | None = None
        self._record_progress: int | None = None  # the accepted record's, until observe
        self.per_record_only: set[int] = set()  # shuffle queues whose batch must go per record
        #: Shuffle topics whose stateful stage goes by event time (lateness, timers,
        #: TTL): only they need progress.
        self.timed_topics = frozenset(e.topic for e in self.exits if e.head.waits_for_time)

    @property
    def counts_only(self) -> bool:
        """Whether the exit's aggregate only counts (its slots hold plain counts)."""
        return self.count_acc is not None

    def took(self, values: list[Any], ts: int, offset: int) -> None:
        """A record the count path (:mod:`~stream_assets.runtime.core.stage0.count_path`) counted:
        its progress, and its values in case its queue's batch goes per record."""
        if self.progress is None or ts > self.progress:
            self.progress = ts
        self._accepted.append(((values, ts), offset))

    def took_all(
        self, progress: int, records: Callable[[], Iterable[tuple[list[Any], int, int]]]
    ) -> None:
        """A batch the batch count path (:mod:`~stream_assets.runtime.core.stage0.batch_count_path`)
        counted: its progress, and how to make each record's ``(values, ts, offset)`` in
        order, in case its queue's batch goes per record."""
        if self.progress is None or progress > self.progress:
            self.progress = progress
        self._taken_later.append(records)

    def key(
        self, exit_index: int, elements: list[Element], offset: int, first_sub: int = 0
    ) -> list[Keyed]:
        """Key and route one record's ``elements`` at one exit; raise UserFunctionError naming
        the key_by for a key function that fails, or a key or value the shuffle cannot
        carry (msgpack refuses it, or its entry alone is over the broker's message limit).

        Sub-indexes count from ``first_sub`` (a keyed stage numbers a batch's results).
        """
        exit_ = self.exits[exit_index]
        key_fn = exit_.key_by.fn
        # Per record, not per element: this loop is stage 0's hottest.
        tagged, side = exit_.tagged, exit_.key_by.side
        lazy, limit = self.combine, self.entry_limit
        known, route = self.router.known, self.router.route
        keyed: list[Keyed] = []
        for sub, (v, ts) in enumerate(elements, first_sub):
            try:
                key = key_fn(v)
                routed = known.get(key) if type(key) is str else None
                key_bytes, target = route(key) if routed is None else routed
                shipped = [side, v] if tagged else v
                # Packed now unless it is certain to pack later: combined
                # batches rarely send records, and whether a value is a dead
                # letter must not depend on how its batch went.
                packed: Packable = (
                    (key, shipped, ts, offset, sub)
                    if lazy and _packs_later(v, ts, len(key_bytes), limit)
                    else pack_record(key, shipped, ts, offset, sub)
                )
                if type(packed) is bytes and len(packed) > limit:
                    raise _too_large(exit_.topic, len(packed), limit)
            except PackingError as exc:
                raise UserFunctionError(exit_.key_by.op_id, _shuffle_error(exc)) from exc
            except Exception as exc:
                raise UserFunctionError(exit_.key_by.op_id, exc) from exc
            keyed.append((key, key_bytes, target, v, ts, packed))
        return keyed

    def fold(self, keyed: list[Keyed]) -> None:
        """Fold one record's elements into the batch's partials (all or nothing).

        Also without combining: an aggregate that cannot take a value fails
        here, where the dead letter still has the original bytes.
        """
        if self.agg is None:
            return
        if self.count_acc is not None:
            # Counting takes any value: nothing to check, and with
            # combining nothing can fail half-way (see _fold_counts).
            if self.combine:
                _fold_counts(self.agg.window, keyed, self.combined)
            return
        _fold(self.agg, keyed, self.combined if self.combine else None)

    def accept(self, exit_index: int, keyed: list[Keyed], offset: int) -> None:
        """Keep a record's keyed elements for sending (after it fully succeeded).

        An element that the origin's progress before this record makes late
        carries that progress, and its shuffle queue's batch goes per record.
        """
        if not keyed:
            return
        exit_ = self.exits[exit_index]
        if self.progress is not None and exit_.head.judges_lateness:
            keyed = self._with_progress(exit_.head, keyed, self.progress)
        top = max(map(_TS, keyed))
        if self._record_progress is None or top > self._record_progress:
            self._record_progress = top
        if self.combine:
            # Most combined batches send no record: unpacked at send_all if needed.
            self.combined_records.update(map(_TARGET, keyed))
            self._accepted.append((keyed, offset))
            return
        rows = self.per_record
        for _key, _kb, target, _v, _ts, packed in keyed:
            rows[(exit_.topic, target)].append((packed, offset))

    def _with_progress(self, head: n.Stateful, keyed: list[Keyed], progress: int) -> list[Keyed]:
        """``keyed`` with the entries that ``progress`` may make late carrying it;
        their shuffle queues' batches go per record."""
        out = keyed
        for i, (key, kb, target, v, ts, packed) in enumerate(keyed):
            if head.may_be_late(ts, progress):
                whole = packed if isinstance(packed, bytes) else pack_record(*packed)
                if out is keyed:
                    out = list(keyed)
                out[i] = (key, kb, target, v, ts, with_progress(whole, progress))
                self.per_record_only.add(target)
        return out

    def observe(self) -> None:
        """Count the record whose elements were just accepted (at every exit) in the
        origin's progress: their event times (a select_timestamp's, if any)."""
        top = self._record_progress
        if top is not None and (self.progress is None or top > self.progress):
            self.progress = top
        self._record_progress = None

    def send_all(self, last_offset: int) -> None:
        """Send the batch: one message (or chunk) per exit and shuffle queue, the last
        to each queue with the origin's progress, a mark to a queue with nothing else."""
        progress = self.progress
        timed = self.timed_topics
        combined_targets = set(self.combined) if self.combine else set()
        sent: set[tuple[str, int]] = set()
        for target in sorted(combined_targets - self.per_record_only):
            topic = self.exits[0].topic
            told = progress if topic in timed else None
            body = self._combined_body(target, last_offset, told)
            if body is not None:
                self.send_message(topic, target, body, last_offset)
                self.stats.shuffle_records += len(self.combined[target])
                sent.add((topic, target))
        if self.combine:
            self._unfold(sent)
        for topic, target in sorted(self.per_record):
            if (topic, target) in sent:
                continue
            entries = self.per_record[(topic, target)]
            self.stats.shuffle_records += len(entries)
            chunks = _chunks(_packed(entries), self.body_limit)
            for i, (chunk, last) in enumerate(chunks):
                final = progress if i == len(chunks) - 1 and topic in timed else None
                self.send_message(topic, target, records_body(self.src, chunk, final), last)
            sent.add((topic, target))
        if progress is None:
            return  # nothing read: no progress to tell
        for topic in sorted(timed):
            for target in range(self.ctx.shuffle_queues):
                if (topic, target) not in sent:
                    mark = encode_mark(self.src, (last_offset, WHOLE_OFFSET), progress)
                    self.send_message(topic, target, mark, last_offset)
                    self.stats.progress_marks += 1

    def _unfold(self, sent: set[tuple[str, int]]) -> None:
        """Put the accepted records' entries for queues no combined message covered
        in ``per_record``, in accept order (combining: one exit, one topic)."""
        topic = self.exits[0].topic
        if all((topic, t) in sent for t in self.combined_records):
            return
        rows = self.per_record
        taken = [
            ((values, ts), offset) for later in self._taken_later for values, ts, offset in later()
        ]
        for accepted, offset in [*taken, *self._accepted]:
            if isinstance(accepted, tuple):  # the count path's: keyed again, as then
                values, ts = accepted
                accepted = self.key(0, [(v, ts) for v in values], offset)
            for _key, _kb, target, _v, _ts, packed in accepted:
                if (topic, target) not in sent:
                    rows[(topic, target)].append((packed, offset))

    def _combined_body(self, target: int, last_offset: int, progress: int | None) -> bytes | None:
        slots = list(self.combined[target].values())
        if self.count_acc is not None:
            for slot in slots:  # a counted slot's accumulator, as add would have made it
                slot[3] = self.count_acc(slot[5])
        try:
            body = encode_combined(
                self.src,
                slots,
                (last_offset, WHOLE_OFFSET),
                self.combined_records[target],
                progress,
            )
        except PackingError:
            return None  # an accumulator the codec cannot carry: send records
        return None if len(body) > self.body_limit else body  # too big: records

    def send_message(self, topic: str, target: int, body: bytes, offset: int) -> None:
        """Send one message of this origin's batch to shuffle queue ``target``."""
        key = f"{self.ctx.job_id}/{self.src}/{offset}"
        self.sender.send(topic, body, queue_id=target, key=key)
        self.stats.shuffle_messages += 1


def _shuffle_error(exc: PackingError) -> PackingError:
    return PackingError(f"the shuffle cannot carry this record: {exc}")


class ShuffleEntryTooLargeError(ValueError):
    """A key and value too large for any shuffle message: that record's dead letter."""


def _too_large(topic: str, size: int, limit: int) -> ShuffleEntryTooLargeError:
    return ShuffleEntryTooLargeError(
        f"the shuffle cannot carry this record: its key and value take {size} bytes packed, "
        f"over the {limit} a message to {topic!r} can hold (the broker's maxMessageSize, "
        "STREAM_ASSETS_ROCKETMQ_MAX_MESSAGE_SIZE, less the message's envelope); make the "
        "key or value smaller before the key_by"
    )


class _KeyRouter:
    """Key bytes and shuffle queue of a grouping key, remembered for string keys.

    A micro-batch meets the same keys over and over (a vocabulary of words);
    packing and hashing each occurrence was a third of stage 0's time. Only
    ``str`` keys are remembered: for them equality implies the same packed
    bytes, which is not true of e.g. ``1 == 1.0 == True``. One router per
    queue count lives as long as the process (:meth:`of`): a real-time step
    is short and meets the same keys as the step before it, and a router of
    its own hashed every key afresh (an eighth of a WordCount task's time
    under cProfile).

    >>> _KeyRouter.of(8) is _KeyRouter.of(8), _KeyRouter.of(8).route("user-42")[1]
    (True, 3)
    """

    _LIMIT = 1 << 17
    _BY_QUEUES: ClassVar[dict[int, _KeyRouter]] = {}

    @classmethod
    def of(cls, shuffle_queues: int) -> _KeyRouter:
        """The process's router for ``shuffle_queues`` queues (what a key maps to is
        fixed by the key and the count alone)."""
        router = cls._BY_QUEUES.get(shuffle_queues)
        if router is None:
            router = cls._BY_QUEUES[shuffle_queues] = cls(shuffle_queues)
        return router

    def __init__(self, shuffle_queues: int) -> None:
        self.shuffle_queues = shuffle_queues
        #: str key -> (key bytes, shuffle queue); callers may look up here first.
        self.known: dict[str, tuple[bytes, int]] = {}

    def route(self, key: Any) -> tuple[bytes, int]:
        if type(key) is str:
            hit = self.known.get(key)
            if hit is not None:
                return hit
        key_bytes = encode_key(key)
        routed = (key_bytes, queue_for_key(key_bytes, self.shuffle_queues))
        if type(key) is str:
            if len(self.known) >= self._LIMIT:
                self.known.clear()
            self.known[key] = routed
        return routed


def _fold(
    agg: n.Aggregate,
    keyed: list[Keyed],
    combined: dict[int, dict[EntryKey, list[Any]]] | None,
) -> None:
    """Fold one record's keyed elements into the batch's partials, all or nothing.

    A slot is ``[key, wstart, wend, acc, max_ts, n]``. Slots are updated in
    place with an undo log: if ``add`` fails on a later element, the record
    goes to the dead letters whole and the partials are as before it.
    ``combined`` None (no pre-combine): ``add`` still runs, on fresh
    accumulators, so a value the aggregate cannot take fails here too.
    ``add(acc, v)`` equals ``merge(acc, add(zero, v))`` for the decomposable
    built-ins, the only ones combined.
    """
    acc_def = agg.accumulator
    window = agg.window
    undo: list[tuple[dict[EntryKey, list[Any]], EntryKey, list[Any] | None]] = []
    try:
        for key, key_bytes, target, value, ts, _packed in keyed:
            if combined is None:
                acc_def.add(acc_def.zero(), value)
                continue
            slots = combined[target]
            for w in window.assign(ts) if window is not None else _NO_WINDOW:
                entry_key = (key_bytes, None, None) if w is None else (key_bytes, w.start, w.end)
                slot = slots.get(entry_key)
                if slot is None:
                    slot = slots[entry_key] = [
                        key,
                        entry_key[1],
                        entry_key[2],
                        acc_def.zero(),
                        ts,
                        0,
                    ]
                    undo.append((slots, entry_key, None))
                else:
                    undo.append((slots, entry_key, slot.copy()))
                slot[3] = acc_def.add(slot[3], value)
                if ts > slot[4]:
                    slot[4] = ts
                slot[5] += 1
    except Exception as exc:
        for slots, entry_key, before in reversed(undo):
            if before is None:
                del slots[entry_key]
            else:
                slots[entry_key] = before
        raise UserFunctionError(agg.op_id, exc) from exc


def _counter_of(acc: Accumulator) -> Callable[[int], Any] | None:
    """For an aggregate that only counts (``Count``, or a ``Composite`` of them), the
    accumulator that ``n`` adds from ``zero`` give; None for any other aggregate.

    Exact types only: a subclass may override ``add``.
    """
    if type(acc) is Count:
        return _same
    if type(acc) is Composite and acc.parts and all(type(p) is Count for _, p in acc.parts):
        width = len(acc.parts)
        return lambda count: [count] * width
    return None


def _same(count: int) -> int:
    return count


def _fold_counts(
    window: Any, keyed: list[Keyed], combined: dict[int, dict[EntryKey, list[Any]]]
) -> None:
    """:func:`_fold` for an aggregate that only counts: slots keep the count (``n``)
    and their accumulator is made from it at send time (``_combined_body``).

    No undo log: nothing here can fail half-way through a record. ``ts`` is
    an int (the chain makes it one), and only tumbling and sliding windows
    are combined (a merging window is not): their ``assign`` is int
    arithmetic.
    """
    for key, key_bytes, target, _v, ts, _packed in keyed:
        slots = combined[target]
        for w in window.assign(ts) if window is not None else _NO_WINDOW:
            entry_key = (key_bytes, None, None) if w is None else (key_bytes, w.start, w.end)
            slot = slots.get(entry_key)
            if slot is None:
                slots[entry_key] = [key, entry_key[1], entry_key[2], None, ts, 1]
            else:
                if ts > slot[4]:
                    slot[4] = ts
                slot[5] += 1


def _packs_later(value: Any, ts: int, key_len: int, limit: int) -> bool:
    """Whether an entry of ``value`` at ``ts`` with a key of ``key_len`` packed bytes is
    sure to pack within ``limit``: msgpack encodes such values whatever they hold, and
    their size is bounded in O(1). One function, not two: it runs for every element."""
    if not _INT64 <= ts < _UINT64:
        return False
    kind = type(value)
    if kind is str or kind is bytes:
        if kind is str and not value.isascii():
            return False  # it may hold a lone surrogate
        return key_len + len(value) + ENTRY_OVERHEAD <= limit
    if kind is int:
        if not _INT64 <= value < _UINT64:
            return False
    elif not (kind is float or kind is bool or value is None):
        return False
    return key_len + 9 + ENTRY_OVERHEAD <= limit


def _packed(entries: list[tuple[Packable, int]]) -> list[tuple[bytes, int]]:
    return [(e if isinstance(e, bytes) else pack_record(*e), off) for e, off in entries]


def _chunks(recs: list[tuple[bytes, int]], limit: int) -> list[tuple[list[bytes], int]]:
    """Split packed records so each message stays under ``limit`` bytes; with each
    chunk, the origin offset of its last record. A record over ``limit`` alone is a
    chunk of its own (:meth:`ShuffleOut.key` let it through: within the broker's limit)."""
    out: list[tuple[list[bytes], int]] = []
    chunk: list[bytes] = []
    size = ENVELOPE_BYTES
    last = -1
    for packed, offset in recs:
        if chunk and size + len(packed) > limit:
            out.append((chunk, last))
            chunk, size = [], ENVELOPE_BYTES
        chunk.append(packed)
        size += len(packed)
        last = offset
    if chunk:
        out.append((chunk, last))
    return out
