"""One batch of one keyed stage's queue: the driver every keyed head shares.

Pure: records come in as an iterable, outputs and changelog leave through a
:class:`~stream_assets.runtime.core.ports.Sender`, state lives in the queue's
:class:`~stream_assets.state.store.QueueStateStore`, which the caller has
proven current against the state topic. What differs per head is a
:class:`~stream_assets.runtime.core.keyed.logic.KeyedLogic`; the steps are the same for all
(DESIGN section 3):

1. Fence: a newer generation recorded in the state means another instance owns
   the queue; fail before sending anything.
2. Apply every shuffle record whose origin (source queue, offset, sub-index)
   is above the highest origin already applied from that source queue; skip
   the rest (exactly once across the shuffle).
3. Judge lateness against the watermark as it stood at the start of the batch
   and against the record's own origin's progress when it was read: every
   record its source queue read before it, whatever their keys' routes. That
   progress travels with the records (each batch's messages end with it, a
   queue with no records gets a mark, a record it makes late carries it:
   :mod:`~stream_assets.runtime.core.shuffle_codec`), so results do not depend on
   key routing or on how records were grouped into messages or batches;
   then advance the per-origin watermark and fire what it made due.
   Origins the caller reports idle (judged by broker offsets, never by the
   time between batches) leave the watermark's minimum; when every origin is
   idle, all open windows fire.
4. Expire keys whose TTL the watermark passed (after their due timers fired:
   :mod:`~stream_assets.runtime.core.keyed.ttl`), then emit the updates of unwindowed keys
   and the deletions of expired ones.
5. Emit results at least once (:mod:`~stream_assets.runtime.core.keyed.emit`); a result the
   broker would refuse or a late record that cannot be sent is a dead letter
   of its own, never the batch's failure. An exactly-once sink's results are
   prepared, not sent (:mod:`~stream_assets.runtime.core.sink_transactions`).
6. Checkpoint: values, origins, input offset, watermark and owner in one
   WriteBatch, the changelog record sent first and compare-and-appended; then
   send the outbox (results for the next shuffle) it committed, and commit the
   exactly-once sinks' messages.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Collection, Iterable
from typing import Any

from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.core.keyed import emit, ttl
from stream_assets.runtime.core.keyed.aggregates import PlainAggregate
from stream_assets.runtime.core.keyed.batch_state import BatchState
from stream_assets.runtime.core.keyed.logic import KeyedBatch
from stream_assets.runtime.core.keyed.logics import logic_for
from stream_assets.runtime.core.keyed.partials import partials_for
from stream_assets.runtime.core.keyed.results import result_key
from stream_assets.runtime.core.ports import Sender
from stream_assets.runtime.core.shuffle_codec import ShuffleProtocolError, decode, encode_key
from stream_assets.runtime.core.sink_transactions import (
    ExactlyOnceSinks,
    record_step,
)
from stream_assets.serde.packing import pack
from stream_assets.state import layout as lay
from stream_assets.state.changelog import commit_with_changelog
from stream_assets.state.errors import ChangelogConflictError, FencedError
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import WatermarkTracker, Window, later, window_closed


def check_owner(ctx: StageContext, store: QueueStateStore) -> None:
    """Raise :class:`FencedError` if a newer generation committed this queue's state."""
    owner = store.committed.generation
    if owner > ctx.generation:
        raise FencedError(
            f"{ctx.stage.input_topic}[{store.queue_id}] belongs to generation {owner} "
            f"({store.committed.writer or 'unknown writer'}); this instance is generation "
            f"{ctx.generation} and must not commit for it: it should stop"
        )


def run_keyed_batch(
    ctx: StageContext,
    queue_id: int,
    end: int,
    records: Iterable[Record],
    store: QueueStateStore,
    sender: Sender,
    idle_origins: Collection[int] = (),
    now_ms: int | None = None,
    sinks: ExactlyOnceSinks | None = None,
) -> TaskStats:
    """Apply shuffle ``records`` of queue ``queue_id`` (up to offset ``end``) to ``store``.

    ``idle_origins``: source queues whose end offset has not moved for the
    idle timeout and that were processed to their end, so nothing more can
    come from them for now. ``now_ms``: the wall clock processing-time timers
    and periodic results go by (default: now). ``sinks``: the stage's
    exactly-once sinks, this attempt's transaction (the one ``sender`` prepares
    into).

    >>> stats = run_keyed_batch(ctx, 0, end, records, store, sender)  # doctest: +SKIP
    >>> stats.records_in, stats.fired  # doctest: +SKIP
    (120, 4)
    """
    assert ctx.stage.head is not None and ctx.stage.state_topic is not None
    stats = TaskStats(stage=ctx.stage.index, queue_id=queue_id, end_offset=end)
    check_owner(ctx, store)
    emit.resend_outbox(ctx, queue_id, store, sender, stats)
    run = _QueueBatch(ctx, queue_id, store, sender, stats, now_ms, sinks)
    for record in records:
        run.apply(record)
    run.finish(end, frozenset(idle_origins))
    return stats


class _QueueBatch:
    """The state of one run of :func:`run_keyed_batch`: lateness, logic, the batch."""

    def __init__(
        self,
        ctx: StageContext,
        queue_id: int,
        store: QueueStateStore,
        sender: Sender,
        stats: TaskStats,
        now_ms: int | None,
        sinks: ExactlyOnceSinks | None = None,
    ) -> None:
        head = ctx.stage.head
        assert head is not None
        self.ctx, self.head, self.queue_id = ctx, head, queue_id
        self.store, self.sender, self.stats = store, sender, stats
        self.sinks = sinks
        self.meta = meta = store.next_meta()
        self.tracker = (
            WatermarkTracker.from_dict(meta.watermark)
            if meta.watermark
            else WatermarkTracker(head.allowed_lateness_ms)
        )
        if ctx.origins:  # origins of an earlier version of the topology hold nothing back
            self.tracker.retain(ctx.origins)
        for origin in ctx.origins:
            self.tracker.expect(origin)
        self.closed_floor: int | None = meta.extra.get("closed")
        # Lateness is judged against the watermark the previous batch left (what
        # has fired), not one recomputed with this batch's idle set: an origin that
        # became idle may still have on-time records in this very batch.
        self.wm_start = later(self.tracker.last_watermark, self.closed_floor)
        self.logic = logic_for(head)
        self.batch = KeyedBatch(
            state=BatchState(store),
            seq=meta.seq,
            now_ms=int(time.time() * 1000) if now_ms is None else now_ms,
            stats=stats,
            # Not a method of this object: a cycle through the batch would keep each
            # step's results (thousands of objects) alive until the garbage collector
            # ran, and its collections were a sixth of a real-time task's time.
            fail=functools.partial(emit.dead_letter_value, ctx, sender, stats, None, head.op_id),
            meta_extra=meta.extra,
            watermark=self.wm_start,
        )
        self.got_input = False
        #: A key's partials of this step, merged before they touch the state (partials.py).
        self.partials = partials_for(head)

    def closed_for(self, src: int, carried: int | None = None) -> int | None:
        """Up to where windows are closed for the next record from origin ``src``.

        Closed by the watermark (what has fired), or by the origin's own
        progress: the records it read before this one already reached event
        time T, so anything for a window ending at or before T - lateness is
        late, even while a silent origin holds the watermark back, and even in
        a queue's first batch. ``carried``: the progress the record brought
        (set when records routed elsewhere made it late).
        """
        progress = later(self.tracker.max_event_time(src), carried)
        lateness = self.head.allowed_lateness_ms
        return later(self.wm_start, None if progress is None else progress - lateness)

    def apply(self, record: Record) -> None:
        """Apply one shuffle message: records, pre-combined partials or a progress mark."""
        body = decode(record.body)
        if "srcs" in body:
            self._apply_across(record, body)
            return
        src = int(body["src"])
        applied = tuple(self.meta.origins.get(src, (-1, -1)))
        if "recs" in body:
            applied = self._apply_records(record, src, body["recs"], applied)
        elif tuple(body["end"]) <= applied:  # applied before: nothing of it counts again
            self.stats.skipped_duplicates += len(body.get("comb", ()))
            return
        elif "comb" in body:
            applied = self._apply_combined(record, src, body)
        else:  # a progress mark: committed like records, the progress must last
            applied = tuple(body["end"])
            self.got_input = True
        if "p" in body:  # the origin's progress through this message's last origin
            self.tracker.observe(src, int(body["p"]))
        self.meta.origins[src] = (int(applied[0]), int(applied[1]))

    def _apply_records(
        self, record: Record, src: int, entries: list[Any], applied: tuple[int, ...]
    ) -> tuple[int, ...]:
        self._fold_partials()  # the folds stay in the order the messages came
        # The elements of one origin offset (one source record, one keyed batch's
        # results) are all judged by the progress before them.
        reading, read_ts = None, None
        for entry in entries:
            key, value, ts, off, sub = entry[:5]
            if (off, sub) <= applied:
                self.stats.skipped_duplicates += 1
                continue
            if off != reading and read_ts is not None:
                self.tracker.observe(src, read_ts)
            reading, read_ts = off, later(read_ts, ts) if off == reading else ts
            applied = (off, sub)
            self.got_input = True
            self.stats.records_in += 1
            origin = f"{src}/{off}/{sub}"
            try:
                closed = self.closed_for(src, entry[5] if len(entry) > 5 else None)
                for window in self.head.windows_of(ts):
                    self._fold(key, window, None, 1, value, ts, origin, closed)
            except Exception as exc:
                emit.dead_letter_value(
                    self.ctx, self.sender, self.stats, record, self.head.op_id, exc, value, origin
                )
        if read_ts is not None:
            self.tracker.observe(src, read_ts)
        return applied

    def _apply_combined(self, record: Record, src: int, body: dict[str, Any]) -> tuple[int, ...]:
        end_origin = tuple(body["end"])
        self.got_input = True
        self.stats.records_in += int(body.get("n", 0))
        # Partials of one batch of the origin: judged by its progress before them.
        closed = self.closed_for(src)
        entries = body["comb"]
        self._add_partials(record, entries, f"{src}/{end_origin[0]}", closed)
        if entries:  # folding reads no progress: the latest is observed once, after them
            self.tracker.observe(src, max(entry[4] for entry in entries))
        return end_origin

    def _add_partials(
        self, record: Record, entries: list[Any], where: str, closed: int | None
    ) -> None:
        """Fold pre-combined entries, or keep them where a key's partials merge first."""
        if self.partials is not None:
            self.partials.add(entries, where, record)
            return
        for key, ws, we, partial, max_ts, count in entries:
            window = Window(ws, we) if ws is not None else None
            self._fold_partial(key, window, partial, count, max_ts, where, closed, record)

    def _apply_across(self, record: Record, body: dict[str, Any]) -> None:
        """Apply a message pre-combined across several origins (stage0/across_queues.py):
        all its origins at once, or none where it is a replay."""
        marks = self.meta.origins
        origins = [(int(s), (int(off), int(sub)), p) for s, off, sub, p in body["srcs"]]
        new = [end > tuple(marks.get(src, (-1, -1))) for src, end, _ in origins]
        if not any(new):
            self.stats.skipped_duplicates += len(body["comb"])
            return
        if not all(new) or self.head.window is not None:
            raise ShuffleProtocolError(
                f"shuffle message {record.topic}/{record.queue_id}@{record.queue_offset} "
                f"pre-combines origins {[o[0] for o in origins]} of which some were applied "
                "before (or carries windows): stage 0 combined a range it had sent before. "
                "The step failed before changing state; please report it with this message."
            )
        self.got_input = True
        self.stats.records_in += int(body["n"])
        first, end, _ = origins[0]
        self._add_partials(record, body["comb"], f"{first}/{end[0]}", None)
        for src, end, progress in origins:
            if progress is not None:
                self.tracker.observe(src, int(progress))
            marks[src] = end

    def _fold_partial(
        self,
        key: Any,
        window: Window | None,
        partial: Any,
        count: int,
        ts: int,
        where: str,
        closed: int | None,
        record: Record | None,
    ) -> None:
        """Fold one pre-combined partial; one the state refuses is a dead letter."""
        try:
            self._fold(key, window, partial, count, None, ts, where, closed)
        except Exception as exc:  # e.g. a merged sum the state cannot hold
            ws, we = (None, None) if window is None else (window.start, window.end)
            position = f"{where}/{result_key(key)}/{ws}"
            emit.dead_letter_value(
                self.ctx,
                self.sender,
                self.stats,
                record,
                self.head.op_id,
                exc,
                [key, ws, we, partial],
                position,
            )

    def _fold_partials(self) -> None:
        """Fold the step's merged partials, one per key (no window, no TTL: nothing is
        late and nothing expires between them). A merged fold that fails changed
        nothing (a plain aggregate reads, merges, then writes a value packed first),
        so its parts go one by one, each its own dead letter if it fails alone."""
        if not self.partials:
            return
        step = self.partials.drain()
        assert isinstance(self.logic, PlainAggregate)  # partials_for: unwindowed only
        for key, merged, ts, count, slot_key in self.logic.fold_merged(self.batch, step):
            parts = step.parts(slot_key)
            # A None merge is the one fold_merged leaves untried (it adds, not merges);
            # any other it tried and saw fail, and trying it again would fail alike.
            if merged is None:
                try:
                    self._fold(key, None, merged, count, None, ts, parts[-1][3], None)
                    continue
                except Exception:  # each part is tried, and reported, below
                    pass
            for partial, part_ts, part_count, where, record in parts:
                self._fold_partial(key, None, partial, part_count, part_ts, where, None, record)

    def _fold(
        self,
        key: Any,
        window: Window | None,
        partial: Any,
        count: int,
        value: Any,
        ts: int,
        origin: str,
        closed: int | None,
    ) -> None:
        """Fold one record or partial in one window, unless it is late there."""
        key_bytes = encode_key(key)
        state = self.batch.state
        if window is not None and window_closed(
            self.logic.judged(state, key_bytes, window), closed
        ):
            self.stats.late += count
            self.batch.late.append((key, value, window.end, origin))
            return
        # Event-time order: the key's due timers, then its expiry, then the record.
        self.logic.before_record(self.batch, key_bytes, ts)
        if self.head.ttl_ms is not None and self.logic.touches(value):
            self._touch(key_bytes, ts, self.head.ttl_ms)
        self.logic.fold(self.batch, key, key_bytes, window, partial, value, ts, origin)

    def _touch(self, key_bytes: bytes, ts: int, ttl_ms: int) -> None:
        """A record at ``ts``: forget the key first if its TTL ran out before it."""
        latest = self.batch.touched.get(key_bytes)
        stored = ttl.expires_at(self.batch.state, key_bytes)
        expires = later(stored, None if latest is None else latest + ttl_ms)
        if expires is not None and ts >= expires and self.logic.forgets_before_record:
            ttl.forget_key(self.batch, self.logic, key_bytes, expires)
            self.batch.touched.pop(key_bytes, None)
        self.batch.keep_alive(key_bytes, ts)

    def finish(self, end: int, idle: frozenset[int]) -> None:
        """Fire, expire, emit and commit."""
        self._fold_partials()
        ctx, meta, batch, tracker = self.ctx, self.meta, self.batch, self.tracker
        watermark = tracker.watermark(idle)
        all_idle = bool(tracker.origins()) and idle.issuperset(tracker.origins())
        fire_to = later(watermark, self.closed_floor)
        batch.watermark = fire_to
        fired_end = self.logic.fire(batch, fire_to, all_idle)
        if self.logic.fires_by_time:
            self.stats.fired = len(batch.results)
        if all_idle and fired_end is not None and self.logic.closes_when_idle:
            # What fired by idleness stays closed: later records for it are late.
            self.closed_floor = later(self.closed_floor, fired_end)
        self._expire(fire_to)
        self.logic.after_expiry(batch)
        outbox = emit.emit(
            ctx,
            self.queue_id,
            meta.seq,
            self.sender,
            self.stats,
            self.head,
            batch.results,
            batch.late,
        )
        progress = emit.out_progress(
            ctx, meta.extra.get("out_p"), watermark, self.closed_floor, batch.results
        )
        send_outbox = bool(outbox) or progress != meta.extra.get("out_p")
        if send_outbox:
            batch.state.changes[lay.OUTBOX] = pack([meta.seq, outbox, progress])
            meta.extra["out_p"] = progress
        # Outputs (and dead letters, late records) durable before the changelog
        # says this batch happened: a restore never skips outputs that were lost.
        # An exactly-once sink's are prepared: durable, not yet visible.
        try:
            self.sender.flush()
        except BaseException:
            self._roll_back()  # no delta was sent: the step never lands
            raise
        try:
            self._commit(end, watermark)
        except ChangelogConflictError:
            self._roll_back()  # the delta is void: it never lands
            raise
        # Any other failure of the commit may follow a landed delta: the check-back
        # decides from the state queue, never a rollback here.
        if send_outbox and self.committed:
            emit.send_outbox(
                ctx, self.queue_id, self.store, meta.seq, outbox, progress, self.sender, self.stats
            )
        self._end_sinks()

    def _roll_back(self) -> None:
        if self.sinks is not None:
            self.sinks.roll_back()

    def _end_sinks(self) -> None:
        """Commit the step's exactly-once messages (its delta landed), then note it locally."""
        if self.sinks is not None:
            self.sinks.finish(self.store, self.committed)

    def _expire(self, watermark: int | None) -> None:
        """Move touched keys' expiry, then forget the keys the watermark passed."""
        ttl_ms = self.head.ttl_ms
        if ttl_ms is None:
            return
        for key_bytes, ts in sorted(self.batch.touched.items()):
            ttl.touch(self.batch.state, key_bytes, ts + ttl_ms)
        self.stats.expired = ttl.expire(self.batch, self.logic, watermark)

    def _commit(self, end: int, watermark: int | None) -> None:
        """Commit values, origins, offset, watermark and owner, if anything changed."""
        ctx, meta, store = self.ctx, self.meta, self.store
        meta.input_offset = end
        meta.watermark = self.tracker.to_dict()
        if self.closed_floor is not None:
            meta.extra["closed"] = self.closed_floor
        self.stats.watermark = -1 if watermark is None else watermark
        committed = store.committed
        claim = committed.generation != ctx.generation or committed.writer != ctx.writer
        meta.generation, meta.writer = ctx.generation, ctx.writer
        changes = self.batch.state.changes
        write_id = record_step(meta, self.sinks, committed.log_end or 0)
        self.committed = bool(
            changes
            or self.got_input
            or claim
            or meta.extra.get("closed") != committed.extra.get("closed")
            or meta.extra.get("early_period") != committed.extra.get("early_period")
        )
        if self.committed:
            # A new owner commits even an empty batch: its generation in the state
            # topic is what fences the previous owner.
            assert ctx.stage.state_topic is not None
            writer = emit.changelog_writer(ctx, self.sender, ctx.stage.state_topic, self.queue_id)
            commit_with_changelog(store, changes, meta, writer, write_id)
