"""A keyed stage on one shuffle queue: aggregate or join, fire windows, emit, checkpoint.

Pure: records come in as an iterable, outputs and changelog leave through a
:class:`~stream_assets.runtime.ports.Sender`, state lives in the queue's
:class:`~stream_assets.state.store.QueueStateStore`, which the caller has
proven current against the state topic. Per micro-batch and queue
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
   :mod:`~stream_assets.runtime.shuffle_codec`), so results do not depend on
   key routing or on how records were grouped into messages or batches;
   then advance the per-origin watermark and fire every window whose end it
   passed.
   Origins the caller reports idle (judged by broker offsets, never by the
   time between batches) leave the watermark's minimum; when every origin is
   idle, all open windows fire.
4. Emit results (fired windows; for unwindowed aggregates the new value of
   every key changed in the batch; joined pairs) to the stage's sinks, at
   least once. Each result's origin, which the sink message keys carry, is
   the same for a replayed copy and different for a new result: a window's
   bounds and key, a stream record's origin for a table join, and for an
   unwindowed key its version, the seq of the commit that emits the update
   (:func:`_versioned`). A result key goes into message keys as a part of
   its own, so a long one is shortened alone
   (:func:`~stream_assets.runtime.outputs.message_key`). A result the broker
   would refuse (a body over its limit) or a late record that cannot be
   sent is a dead letter of its own, never the batch's failure.
5. Checkpoint: values, origins, input offset, watermark and owner in one
   WriteBatch, the changelog record sent first and compare-and-appended.
6. Results bound for another shuffle (a ``key_by`` after this stage's head)
   go through an *outbox*: committed with the state in step 5, sent only
   after it, with origin (this queue, the commit's seq, position) and this
   queue's progress (its fired watermark and results' event times) to every
   queue of the next shuffle, so a chained stage's watermark moves even
   where no result of this queue went. A batch
   replayed after a crash may fire other windows than the attempt that died,
   so only committed results may travel on; the next batch (or a restore on
   another executor) re-sends an outbox whose send was not confirmed, and
   the next stage de-duplicates by origin.

A stream-table join (:class:`~stream_assets.plan.nodes.TableJoin`) keeps the
table's versions per key and holds each stream record until the watermark
passes its event time; it then meets the table as of that time, so the result
does not depend on which topic was read first.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from stream_assets.operators.chain import UserFunctionError
from stream_assets.operators.joins import join_pairs
from stream_assets.operators.metadata import Metadata
from stream_assets.plan import nodes as n
from stream_assets.plan.topology import origin_id
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.context import StageContext, TaskStats
from stream_assets.runtime.outputs import StageOutputs, dead_letter, message_key
from stream_assets.runtime.ports import Sender
from stream_assets.runtime.shuffle_codec import decode, decode_key, encode_key
from stream_assets.runtime.shuffle_out import ShuffleOut
from stream_assets.runtime.stateless import stage_graph
from stream_assets.serde.packing import pack, unpack
from stream_assets.state.changelog import (
    DEFAULT_CHUNK_BYTES,
    ChangelogWriter,
    commit_with_changelog,
)
from stream_assets.state.errors import FencedError
from stream_assets.state.records import MAX_BODY
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import WatermarkTracker, Window, merge_sessions, window_closed

_PLAIN = b"k"  # unwindowed: key -> acc
_WINDOWED = b"w"  # end, start, key -> acc (ordered by end, so firing scans a prefix)
_SESSION = b"s"  # key -> [[start, end, acc], ...]
_FIRED = b"f"  # key -> end of its latest fired session
_TABLE = b"t"  # key -> [[ts, value], ...]: a table's versions, oldest first
_PENDING = b"p"  # ts, key, origin -> [key, value, ts]: stream records waiting for the watermark
_OUTBOX = b"\x00outbox"  # [seq, [[exit, queue, packed entry], ...]]: results for the next shuffle
#: A result: (origin for message keys, as key parts; value; event time; key).
Result = tuple[tuple[str, ...], Any, int, Any]
_BIAS = 2**63  # signed ms -> unsigned, so byte order is time order


def _wkey(window: Window, key_bytes: bytes) -> bytes:
    return _WINDOWED + struct.pack(">QQ", window.end + _BIAS, window.start + _BIAS) + key_bytes


def _parse_wkey(raw: bytes) -> tuple[Window, bytes]:
    end, start = struct.unpack_from(">QQ", raw, 1)
    return Window(start - _BIAS, end - _BIAS), raw[17:]


@dataclass
class _BatchState:
    """Reads through to RocksDB, buffers this batch's changes."""

    store: QueueStateStore
    changes: dict[bytes, bytes | None] = field(default_factory=dict)
    cache: dict[bytes, Any] = field(default_factory=dict)

    def get(self, key: bytes) -> Any:
        if key in self.cache:
            return self.cache[key]
        raw = self.store.get(key)
        value = None if raw is None else unpack(raw)
        self.cache[key] = value
        return value

    def put(self, key: bytes, value: Any) -> None:
        # Packed first: a value the codec cannot hold fails before anything changes.
        packed = None if value is None else pack(value)
        self.cache[key] = value
        self.changes[key] = packed


def check_owner(ctx: StageContext, store: QueueStateStore) -> None:
    """Raise :class:`FencedError` if a newer generation committed this queue's state."""
    owner = store.meta.generation
    if owner > ctx.generation:
        raise FencedError(
            f"{ctx.stage.input_topic}[{store.queue_id}] belongs to generation {owner} "
            f"({store.meta.writer or 'unknown writer'}); this instance is generation "
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
) -> TaskStats:
    """Apply shuffle ``records`` of queue ``queue_id`` (up to offset ``end``) to ``store``.

    ``idle_origins``: source queues whose end offset has not moved for the
    idle timeout and that were processed to their end, so nothing more can
    come from them for now.
    """
    agg = ctx.stage.head
    assert agg is not None and ctx.stage.state_topic is not None
    stats = TaskStats(stage=ctx.stage.index, queue_id=queue_id, end_offset=end)
    check_owner(ctx, store)
    _resend_outbox(ctx, queue_id, store, sender, stats)
    meta = store.next_meta()
    tracker = (
        WatermarkTracker.from_dict(meta.watermark)
        if meta.watermark
        else WatermarkTracker(agg.allowed_lateness_ms)
    )
    for origin in ctx.origins:
        tracker.expect(origin)
    idle = frozenset(idle_origins)
    closed_floor: int | None = meta.extra.get("closed")
    # Lateness is judged against the watermark the previous batch left (what
    # has fired), not one recomputed with this batch's idle set: an origin that
    # became idle may still have on-time records in this very batch.
    wm_start = _max_opt(tracker.last_watermark, closed_floor)
    lateness = agg.allowed_lateness_ms

    def closed_for(src: int, carried: int | None = None) -> int | None:
        """Up to where windows are closed for the next record from origin ``src``.

        Closed by the watermark (what has fired), or by the origin's own
        progress: the records it read before this one already reached event
        time T, so anything for a window ending at or before T - lateness is
        late, even while a silent origin holds the watermark back, and even in
        a queue's first batch. ``carried``: the progress the record brought
        (set when records routed elsewhere made it late).
        """
        progress = _max_opt(tracker.max_event_time(src), carried)
        return _max_opt(wm_start, None if progress is None else progress - lateness)

    state = _BatchState(store)
    late: list[tuple[Any, Any, int, str]] = []
    changed_plain: dict[bytes, int] = {}  # key -> max event time folded this batch
    got_input = False

    def fold(
        key: Any,
        window: Window | None,
        partial: Any,
        count: int,
        value: Any,
        origin: str,
        closed: int | None,
    ) -> None:
        """Fold a record (``value``) or a pre-combined ``partial`` into the state."""
        key_bytes = encode_key(key)
        if window is not None and window_closed(_judged(state, agg, key_bytes, window), closed):
            stats.late += count
            late.append((key, value, window.end, origin))
            return
        if isinstance(agg, n.TableJoin):
            assert window is not None
            _fold_table(state, key, key_bytes, value, window.start, origin)
            return
        assert isinstance(agg, n.Aggregate)
        acc_def = agg.accumulator
        if window is not None and agg.window is not None and agg.window.is_merging:
            _fold_session(state, acc_def, key_bytes, window, partial, value)
            return
        skey = _wkey(window, key_bytes) if window is not None else _PLAIN + key_bytes
        acc = state.get(skey)
        acc = acc_def.zero() if acc is None else acc
        acc = acc_def.merge(acc, partial) if partial is not None else acc_def.add(acc, value)
        state.put(skey, acc)
        if window is None:
            changed_plain[key_bytes] = max(changed_plain.get(key_bytes, ts_now), ts_now)

    ts_now = 0

    for record in records:
        body = decode(record.body)
        src = int(body["src"])
        applied = tuple(meta.origins.get(src, (-1, -1)))
        if "recs" in body:
            # The elements of one origin offset (one source record, one keyed
            # batch's results) are all judged by the progress before them.
            reading, read_ts = None, None
            for entry in body["recs"]:
                key, value, ts, off, sub = entry[:5]
                if (off, sub) <= applied:
                    stats.skipped_duplicates += 1
                    continue
                if off != reading and read_ts is not None:
                    tracker.observe(src, read_ts)
                reading, read_ts = off, _max_opt(read_ts, ts) if off == reading else ts
                applied = (off, sub)
                got_input = True
                stats.records_in += 1
                try:
                    ts_now = ts
                    closed = closed_for(src, entry[5] if len(entry) > 5 else None)
                    for w in agg.windows_of(ts):
                        fold(key, w, None, 1, value, f"{src}/{off}/{sub}", closed)
                except Exception as exc:
                    _dead_letter(
                        ctx, sender, stats, record, agg.op_id, exc, value, f"{src}/{off}/{sub}"
                    )
            if read_ts is not None:
                tracker.observe(src, read_ts)
        elif "comb" not in body:  # a progress mark
            end_origin = tuple(body["end"])
            if end_origin <= applied:
                continue
            applied = end_origin
            got_input = True  # committed like records: the progress must last
        else:
            end_origin = tuple(body["end"])
            if end_origin <= applied:
                stats.skipped_duplicates += len(body["comb"])
                continue
            applied = end_origin
            got_input = True
            stats.records_in += int(body.get("n", 0))
            # Partials of one batch of the origin: judged by its progress before them.
            closed = closed_for(src)
            for key, ws, we, partial, max_ts, count in body["comb"]:
                ts_now = max_ts
                window = Window(ws, we) if ws is not None else None
                where = f"{src}/{end_origin[0]}"
                try:
                    fold(key, window, partial, count, None, where, closed)
                except Exception as exc:  # e.g. a merged sum the state cannot hold
                    position = f"{where}/{_result_key(key)}/{ws}"
                    value = [key, ws, we, partial]
                    _dead_letter(ctx, sender, stats, record, agg.op_id, exc, value, position)
                tracker.observe(src, max_ts)
        if "p" in body:  # the origin's progress through this message's last origin
            tracker.observe(src, int(body["p"]))
        meta.origins[src] = (int(applied[0]), int(applied[1]))

    watermark = tracker.watermark(idle)
    all_idle = bool(tracker.origins()) and idle.issuperset(tracker.origins())
    results: list[Result] = []
    if isinstance(agg, n.TableJoin):
        fired_end = _fire_pending(state, agg, _max_opt(watermark, closed_floor), all_idle, results)
        stats.fired = len(results)
        if all_idle and fired_end is not None:
            closed_floor = _max_opt(closed_floor, fired_end)
    elif not isinstance(agg, n.Aggregate):
        raise TypeError(f"{agg.op_id}: {type(agg).__name__} is not a stateful operator")
    elif agg.window is None:
        for key_bytes, ts in sorted(changed_plain.items()):
            key = decode_key(key_bytes)
            finish = _Finish(agg, key, state.get(_PLAIN + key_bytes), None)
            results.append((_versioned(key, meta.seq), finish, ts, key))
    else:
        fired_end = _fire(state, agg, _max_opt(watermark, closed_floor), all_idle, results)
        stats.fired = len(results)
        if all_idle and fired_end is not None:
            # Windows fired by idleness stay closed: later records for them are late.
            closed_floor = _max_opt(closed_floor, fired_end)
    outbox = _emit(ctx, queue_id, meta.seq, sender, stats, agg, results, late)
    out_progress = _out_progress(ctx, meta.extra.get("out_p"), watermark, closed_floor, results)
    send_outbox = bool(outbox) or out_progress != meta.extra.get("out_p")
    if send_outbox:
        state.changes[_OUTBOX] = pack([meta.seq, outbox, out_progress])
        meta.extra["out_p"] = out_progress
    # Outputs (and dead letters, late records) durable before the changelog
    # says this batch happened: a restore never skips outputs that were lost.
    sender.flush()

    meta.input_offset = end
    meta.watermark = tracker.to_dict()
    if closed_floor is not None:
        meta.extra["closed"] = closed_floor
    stats.watermark = -1 if watermark is None else watermark
    claim = store.meta.generation != ctx.generation or store.meta.writer != ctx.writer
    meta.generation, meta.writer = ctx.generation, ctx.writer
    if (
        state.changes
        or got_input
        or claim
        or meta.extra.get("closed") != store.meta.extra.get("closed")
    ):
        # A new owner commits even an empty batch: its generation in the state
        # topic is what fences the previous owner.
        writer = _changelog_writer(ctx, sender, ctx.stage.state_topic, queue_id)
        commit_with_changelog(store, state.changes, meta, writer)
        if send_outbox:
            _send_outbox(ctx, queue_id, store, meta.seq, outbox, out_progress, sender, stats)
    return stats


def _out_progress(
    ctx: StageContext,
    before: int | None,
    watermark: int | None,
    closed_floor: int | None,
    results: list[Result],
) -> int | None:
    """This queue's progress for the next shuffle (None: no stage after it judges lateness).

    The highest event time of its results so far, and at least the fired
    watermark minus one: every result still to come is at or after it (a
    window's result happens at its end - 1, a table join's at its record's time).
    """
    if not any(e.head.judges_lateness for e in ctx.stage.exits):
        return None
    head = ctx.stage.head
    assert head is not None
    fired_to = _max_opt(watermark if head.judges_lateness else None, closed_floor)
    newest = max((ts for _origin, _value, ts, _key in results), default=None)
    return _max_opt(before, _max_opt(newest, None if fired_to is None else fired_to - 1))


def _changelog_writer(
    ctx: StageContext, sender: Sender, state_topic: str, queue_id: int
) -> ChangelogWriter:
    """The queue's changelog writer, its messages within the broker's limit.

    A state-topic message (a delta part, a snapshot chunk) is cut to the
    smaller of the state codec's default and the broker's maxMessageSize, so
    a large state value (a huge key, a big accumulator) travels in parts even
    on a broker with a smaller limit.
    """
    max_body = min(MAX_BODY, ctx.max_message_size)
    chunk_bytes = min(DEFAULT_CHUNK_BYTES, max_body - 1024)
    every = ctx.snapshot_every
    return ChangelogWriter(sender, state_topic, queue_id, every, max_body, chunk_bytes)


def _resend_outbox(
    ctx: StageContext, queue_id: int, store: QueueStateStore, sender: Sender, stats: TaskStats
) -> None:
    """Send the committed outbox again if its send was never confirmed (a crash, a restore)."""
    if not ctx.stage.exits:
        return
    raw = store.get(_OUTBOX)
    if raw is None:
        return
    seq, entries, *progress = unpack(raw)  # no progress: written before it travelled
    if store.meta.extra.get("outbox_sent") != seq:
        carried = progress[0] if progress else None
        _send_outbox(ctx, queue_id, store, seq, entries, carried, sender, stats)


def _send_outbox(
    ctx: StageContext,
    queue_id: int,
    store: QueueStateStore,
    seq: int,
    entries: list[list[Any]],
    progress: int | None,
    sender: Sender,
    stats: TaskStats,
) -> None:
    """Send committed results to the next shuffles with this queue's ``progress``,
    then note locally that they went.

    The note is local (same seq, no changelog write); the next commit carries
    it into the changelog. Without it, a restore re-sends, and the next stage
    skips the copies by origin.
    """
    out = ShuffleOut(ctx, sender, stats, origin_id(ctx.stage.index, queue_id), combine=False)
    for exit_index, target, packed in entries:
        topic = ctx.stage.exits[int(exit_index)].topic
        out.per_record[(topic, int(target))].append((bytes(packed), seq))
    out.progress = progress
    out.send_all(seq)
    sender.flush()
    meta = store.meta.copy()
    meta.extra["outbox_sent"] = seq
    store.update_meta(meta)


def read_key_state(
    store: QueueStateStore, agg: n.Aggregate, key: Any, window: Window | None = None
) -> Any:
    """The current result of ``key`` in ``store`` (the queue that owns the key).

    Unwindowed: the result (a dict by alias) or None. Windowed: the key's open
    (not yet fired) windows as ``{Window: result}``, or with ``window`` that
    window's result or None.
    """
    acc_def = agg.accumulator
    key_bytes = encode_key(key)
    if agg.window is None:
        raw = store.get(_PLAIN + key_bytes)
        return None if raw is None else acc_def.result(unpack(raw))
    if window is not None and not agg.window.is_merging:
        raw = store.get(_wkey(window, key_bytes))
        return None if raw is None else acc_def.result(unpack(raw))
    found: dict[Window, Any] = {}
    if agg.window.is_merging:
        raw = store.get(_SESSION + key_bytes)
        for start, end, acc in [] if raw is None else unpack(raw):
            found[Window(start, end)] = acc_def.result(acc)
    else:
        for raw_key, raw in store.items(_WINDOWED):
            w, kb = _parse_wkey(raw_key)
            if kb == key_bytes:
                found[w] = acc_def.result(unpack(raw))
    return found if window is None else found.get(window)


def _judged(state: _BatchState, head: n.Stateful, key_bytes: bytes, window: Window) -> Window:
    """The window a record's lateness is judged by: for a session, what it merges into.

    A record's own ``[t, t + gap)`` may end before the watermark while the
    key's session it touches is still open (other keys moved the watermark):
    it is on time then, and joins that session. A record that touches a
    session which has closed is late, even if it would also bridge to an open
    one: whether a closed session had fired yet depends on other source queues
    and on batch boundaries, which must not change a verdict. So the judged
    window is the earliest-ending session the record touches (closed if any
    is), its own window if it touches none, and one ending at the key's
    latest fired session when it reaches back to or before that session's end.
    That end is kept per key (one integer) for as long as the key's state is:
    a record can bridge back, gap by gap, through open sessions, so no
    watermark makes it safe to forget.
    """
    if not (isinstance(head, n.Aggregate) and head.window is not None and head.window.is_merging):
        return window
    fired = state.get(_FIRED + key_bytes)
    if fired is not None and window.start <= fired:
        return Window(window.start, fired)  # ends at or before the watermark: closed
    touched = [
        Window(s, e)
        for s, e, _acc in state.get(_SESSION + key_bytes) or []
        if s <= window.end and window.start <= e  # overlaps or touches (merge_sessions)
    ]
    return min(touched, key=lambda w: w.end) if touched else window


def _fold_session(
    state: _BatchState,
    acc_def: Any,
    key_bytes: bytes,
    window: Window,
    partial: Any,
    value: Any,
) -> None:
    skey = _SESSION + key_bytes
    sessions = state.get(skey) or []
    acc = (
        acc_def.merge(acc_def.zero(), partial)
        if partial is not None
        else acc_def.add(acc_def.zero(), value)
    )
    candidates = [(Window(s, e), a) for s, e, a in sessions] + [(window, acc)]
    merged = []
    for merged_window, members in merge_sessions([w for w, _ in candidates]):
        total = acc_def.zero()
        for i in members:
            total = acc_def.merge(total, candidates[i][1])
        merged.append([merged_window.start, merged_window.end, total])
    state.put(skey, merged)


def _fire(
    state: _BatchState,
    agg: n.Aggregate,
    fire_to: int | None,
    fire_all: bool,
    results: list[Result],
) -> int | None:
    """Remove and collect windows ending at or before ``fire_to``, or all with ``fire_all``.

    ``fire_to`` None (no watermark yet) fires nothing.
    """
    acc_def = agg.accumulator
    fired_end: int | None = None

    def due(window: Window) -> bool:
        return fire_all or window_closed(window, fire_to)

    def collect(key_bytes: bytes, window: Window, acc: Any) -> None:
        nonlocal fired_end
        key = decode_key(key_bytes)
        result_key = (f"{window.start}-{window.end}", _result_key(key))
        # A window's results happen at its last instant (their event time downstream).
        ts = window.end - 1
        if isinstance(agg, n.Join):
            for left, right in join_pairs(acc_def.result(acc), agg.kind):
                results.append((result_key, _Joined(agg, left, right), ts, key))
        else:
            results.append((result_key, _Finish(agg, key, acc, window), ts, key))
        fired_end = window.end if fired_end is None else max(fired_end, window.end)

    if agg.window is not None and agg.window.is_merging:
        keys = {k for k, _ in state.store.items(_SESSION)} | {
            k for k in state.cache if k.startswith(_SESSION)
        }
        for skey in sorted(keys):
            sessions = state.get(skey) or []
            keep = []
            for s, e, acc in sessions:
                if due(Window(s, e)):
                    collect(skey[1:], Window(s, e), acc)
                    fired_key = _FIRED + skey[1:]
                    state.put(fired_key, max(e, state.get(fired_key) or e))
                else:
                    keep.append([s, e, acc])
            if len(keep) != len(sessions):
                state.put(skey, keep or None)
        return fired_end

    due_keys: set[bytes] = set()
    for raw, _ in state.store.items(_WINDOWED):
        window, _kb = _parse_wkey(raw)
        if not due(window):
            break  # keys are ordered by window end
        due_keys.add(raw)
    due_keys |= {
        k
        for k, v in state.cache.items()
        if k.startswith(_WINDOWED) and v is not None and due(_parse_wkey(k)[0])
    }
    for raw in sorted(due_keys):
        acc = state.get(raw)
        if acc is None:
            continue
        window, key_bytes = _parse_wkey(raw)
        collect(key_bytes, window, acc)
        state.put(raw, None)
    return fired_end


@dataclass(frozen=True)
class _Finish:
    """An aggregate's result still to compute, in _emit: its accumulator's ``result``
    may be the user's code, and a failure there is that result's dead letter."""

    head: n.Aggregate
    key: Any
    acc: Any
    window: Window | None

    def value(self) -> dict[str, Any]:
        """``{"key": ..., <alias>: ..., ["window_start", "window_end"]}``."""
        out = {"key": self.key, **self.head.accumulator.result(self.acc)}
        if self.window is not None:
            out["window_start"], out["window_end"] = self.window.start, self.window.end
        return out


@dataclass(frozen=True)
class _Joined:
    """A pair to join: the joiner runs where user functions run (and may fail) in _emit."""

    head: n.Join | n.TableJoin
    left: Any
    right: Any


def _emit(
    ctx: StageContext,
    queue_id: int,
    seq: int,
    sender: Sender,
    stats: TaskStats,
    head: n.Stateful,
    results: list[Result],
    late: list[tuple[Any, Any, int, str]],
) -> list[list[Any]]:
    """Run the stage's operators on each result: sinks send now, exits fill the outbox.

    Returns the outbox: ``[exit, shuffle queue, packed entry]`` with origin
    (``seq``, position); a result a user function or the shuffle codec
    rejects is a dead letter, and the others go on.
    """
    outputs = StageOutputs(ctx, sender, stats)
    graph = stage_graph(ctx.stage, outputs)
    exits = range(len(ctx.stage.exits))
    shuffle = (
        ShuffleOut(ctx, sender, stats, origin_id(ctx.stage.index, queue_id), combine=False)
        if ctx.stage.exits
        else None
    )
    outbox: list[list[Any]] = []
    for origin, value, ts, key in results:
        outputs.origin = origin
        outputs.route_key = _result_key(key)
        try:
            if isinstance(value, _Joined | _Finish):
                value = _computed(head, value)
            meta = (
                Metadata(topic=ctx.stage.input_topic, event_time=ts, result_key=key)
                if graph.wants_metadata
                else None
            )
            reached = graph.run(value, ts, meta)
            entries: list[list[Any]] = []
            if shuffle is not None:
                for i in exits:
                    if reached[i]:
                        first = len(outbox) + len(entries)
                        keyed = shuffle.key(i, reached[i], seq, first_sub=first)
                        entries.extend([i, target, packed] for *_, target, _v, _t, packed in keyed)
            outbox.extend(entries)
        except UserFunctionError as err:
            shown = _shown_result(value)
            position = "/".join(origin)
            _dead_letter(ctx, sender, stats, None, err.op_id, err.cause, shown, position)
    if head.late_topic:
        for key, value, window_end, where in late:
            try:
                _send_late(ctx, sender, head.late_topic, key, value, window_end, where)
            except Exception as exc:  # e.g. a body over the broker's limit
                shown = {"key": key, "value": value, "window_end": window_end}
                position = f"late/{where}/{window_end}/{_result_key(key)}"
                _dead_letter(ctx, sender, stats, None, head.op_id, exc, shown, position)
    outputs.flush()
    return outbox


def _computed(head: n.Stateful, result: _Joined | _Finish) -> Any:
    """The value of a result a user function finishes (joiner, accumulator result)."""
    try:
        if isinstance(result, _Finish):
            return result.value()
        return result.head.joiner(result.left, result.right)
    except Exception as exc:
        raise UserFunctionError(head.op_id, exc) from exc


def _shown_result(value: Any) -> Any:
    """What a result's dead letter shows: the value, or what it was to be made of."""
    if isinstance(value, _Joined):
        return [value.left, value.right]
    if isinstance(value, _Finish):
        return {"key": value.key, "accumulator": value.acc}
    return value


def _send_late(
    ctx: StageContext,
    sender: Sender,
    topic: str,
    key: Any,
    value: Any,
    window_end: int,
    origin: str,
) -> None:
    """Send one late record to ``topic``; raises if the broker would refuse it."""
    body = json.dumps({"key": key, "value": value, "window_end": window_end}, default=str)
    # Keyed by the record's origin, so a replayed batch's copies de-duplicate;
    # the window end (a record is late in every sliding window it missed) and
    # the result key (a pre-combined batch's partials share one origin) keep
    # two different late entries apart.
    late_key = message_key(ctx.job_id, "late", origin, str(window_end), _result_key(key))
    sender.send(topic, body.encode(), key=late_key)


def _dead_letter(
    ctx: StageContext,
    sender: Sender,
    stats: TaskStats,
    record: Record | None,
    op_id: str,
    exc: BaseException,
    value: Any,
    position: str,
) -> None:
    """Dead-letter one value of this stage (a shuffle entry or a result), as JSON."""
    body = _shown(value)
    queue_id, offset = (record.queue_id, record.queue_offset) if record else (-1, -1)
    failed = Record(ctx.stage.input_topic, queue_id, offset, body)
    where = f"{ctx.stage.input_topic}/{op_id}/{position}"
    dead_letter(ctx, sender, stats, failed, op_id, exc, where)


def _shown(value: Any) -> bytes:
    """``value`` as JSON for a dead letter, or its ``repr`` if JSON cannot hold it.

    Never raises: a dead letter that fails would fail its batch on every retry.
    """
    try:
        return json.dumps(value, default=str).encode()
    except Exception:  # a dict with tuple keys, nesting deeper than the recursion limit
        try:
            return repr(value).encode("utf-8", "backslashreplace")
        except Exception:
            return f"<a {type(value).__name__} that neither JSON nor repr shows>".encode()


def _result_key(key: Any) -> str:
    """A grouping key as text (message keys, sink routing): itself, or its JSON.

    >>> _result_key("new york"), _result_key(("eu", 7)), _result_key({("a",): 1})
    ('new york', '["eu", 7]', "{('a',): 1}")
    """
    if isinstance(key, str):
        return key
    try:
        return json.dumps(key, default=str)
    except (TypeError, ValueError):  # JSON has no such map key (a tuple, bytes)
        return repr(key)


def _versioned(key: Any, seq: int) -> tuple[str, str]:
    """An unwindowed result's origin: its result key and version, ``<result key>/v<seq>``.

    Every update of an unwindowed key is a new result, so the result key alone
    would give every update the same message key and a consumer that drops
    repeats would drop real updates. The version is the seq of the commit that
    emits the update: a key changes at most once per batch, so a new update
    always gets a new, higher version; a batch replayed from the same state
    (a crash before its commit) has the same seq and its copies the same keys;
    the seq lives in the committed meta, so a restore on another executor keeps
    counting, and a reset's empty snapshot carries a seq above everything ever
    written, so recomputed results are newer than the old ones. No state key
    is added, so state written before versions existed needs no conversion.

    Two key parts, so that shortening a long result key
    (:func:`~stream_assets.runtime.outputs.message_key`) keeps the version
    readable: the message key is ``.../<result key>/v<seq>/<n>`` either way.

    >>> _versioned("new york", 7), _versioned(["eu", 7], 12)
    (('new york', 'v7'), ('["eu", 7]', 'v12'))
    """
    return (_result_key(key), f"v{seq}")


def _max_opt(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _fold_table(
    state: _BatchState, key: Any, key_bytes: bytes, value: Any, ts: int, origin: str
) -> None:
    """A table update (side 1) joins the key's versions; a stream record (side 0) waits."""
    side, item = value
    if int(side) == 1:
        skey = _TABLE + key_bytes
        versions = [v for v in state.get(skey) or [] if v[0] != ts]
        versions.append([ts, item])
        versions.sort(key=lambda v: v[0])
        state.put(skey, versions)
        return
    src, off, sub = (int(p) for p in origin.split("/"))
    pkey = _PENDING + struct.pack(">QQQQ", ts + _BIAS, src, off, sub) + key_bytes
    state.put(pkey, [key, item, ts])


def _fire_pending(
    state: _BatchState,
    head: n.TableJoin,
    fire_to: int | None,
    fire_all: bool,
    results: list[Result],
) -> int | None:
    """Join and remove stream records the watermark passed (all with ``fire_all``).

    Returns one past the latest event time joined (what is closed now).
    """

    def due(ts: int) -> bool:
        return fire_all or (fire_to is not None and ts < fire_to)

    due_keys: set[bytes] = set()
    for raw, _ in state.store.items(_PENDING):
        if not due(struct.unpack_from(">Q", raw, 1)[0] - _BIAS):
            break  # ordered by event time
        due_keys.add(raw)
    due_keys |= {
        k
        for k, v in state.cache.items()
        if k.startswith(_PENDING)
        and v is not None
        and due(struct.unpack_from(">Q", k, 1)[0] - _BIAS)
    }
    fired_end: int | None = None
    for raw in sorted(due_keys):
        pending = state.get(raw)
        if pending is None:
            continue
        key, item, ts = pending
        key_bytes = raw[33:]
        versions = state.get(_TABLE + key_bytes) or []
        current = [v for v in versions if v[0] <= ts]
        table_value = current[-1][1] if current else None
        src, off, sub = struct.unpack_from(">QQQ", raw, 9)
        result_key = (f"{ts}/{src}/{off}/{sub}", _result_key(key))
        if current or head.kind == "left":
            results.append((result_key, _Joined(head, item, table_value), ts, key))
        state.put(raw, None)
        fired_end = ts + 1 if fired_end is None else max(fired_end, ts + 1)
        if len(current) > 1:
            # Older versions can meet no record to come: those are at or after this one.
            state.put(_TABLE + key_bytes, versions[len(current) - 1 :])
    return fired_end
