"""Stage 0 on one source queue: deserialize, run the stateless operators, shuffle.

Pure: records come in as an iterable, everything leaves through a
:class:`~stream_assets.runtime.ports.Sender`. Records leave for the shuffle
topic grouped into one message per shuffle queue per micro-batch (see
:mod:`~stream_assets.runtime.shuffle_codec`). Each record carries its origin
(source queue, offset, sub-index) so the stateful stage applies it exactly once
even when this batch is re-sent after a crash.

When the next aggregate is decomposable, records are pre-combined per key and
window before sending, except below the offset each queue had reached when the
instance started (``StageContext.may_combine``): a batch replayed after a crash
may have other boundaries than the one that was cut short, and only per-record
origins can be de-duplicated against any prefix. A shuffle queue's batch also
goes per record when one of its records is late by its own origin's progress
within the batch, so that stage 1 judges lateness exactly as without combining.

Any failure of one record -- its deserializer, a user function, the key, the
aggregate's ``add``, or a value or key the shuffle codec cannot carry -- sends
that record's original bytes to the dead-letter topic, and the batch goes on.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from stream_assets.operators.chain import OperatorChain, UserFunctionError
from stream_assets.plan import nodes as n
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.context import MAX_BODY_BYTES, StageContext, TaskStats
from stream_assets.runtime.outputs import StageOutputs, dead_letter
from stream_assets.runtime.ports import Sender
from stream_assets.runtime.shuffle_codec import (
    ENVELOPE_BYTES,
    encode_combined,
    encode_key,
    pack_record,
    records_body,
)
from stream_assets.serde.packing import PackingError

# A combined message covers every offset of its batch: sub-index above any real one.
_WHOLE_OFFSET = 2**31 - 1

#: (key bytes, window start, window end): one pre-combined entry of a shuffle queue.
EntryKey = tuple[bytes, Any, Any]
#: A per-record shuffle entry: packed, or (key, value, ts, offset, sub) still to pack.
Packable = bytes | tuple[Any, Any, int, int, int]
#: One keyed element: (key, key bytes, shuffle queue, value, ts, entry).
Keyed = tuple[Any, bytes, int, Any, int, Packable]
_INT64, _UINT64 = -(2**63), 2**64
_NO_WINDOW: tuple[None] = (None,)


def run_source_batch(
    ctx: StageContext,
    queue_id: int,
    start: int,
    end: int,
    records: Iterable[Record],
    sender: Sender,
) -> TaskStats:
    """Process ``records`` (offsets ``start`` .. ``end`` of source queue ``queue_id``)."""
    stats = TaskStats(stage=ctx.stage.index, queue_id=queue_id, end_offset=end)
    stage = ctx.stage
    assert stage.source is not None
    outputs = StageOutputs(ctx, sender, stats)
    chain = OperatorChain(stage.ops, outputs.emit)
    key_fn: Callable[[Any], Any] | None = stage.key_by.fn if stage.key_by else None
    key_op = stage.key_by.op_id if stage.key_by else ""
    agg = ctx.next_aggregate
    combine = (
        ctx.may_combine(queue_id, start) and stage.combine and agg is not None and not _merging(agg)
    )
    per_record: dict[int, list[tuple[Packable, int]]] = defaultdict(list)  # (entry, offset)
    combined: dict[int, dict[EntryKey, list[Any]]] = defaultdict(dict)
    combined_records: dict[int, int] = defaultdict(int)  # keyed records bound for each queue
    last_offset = start - 1
    progress: dict[int, int] = {}  # per shuffle queue: max event time sent this batch
    per_record_only: set[int] = set()  # shuffle queues whose batch must go per record
    router = _KeyRouter(ctx.shuffle_queues)
    outputs.route_key = f"{stage.input_topic}/{queue_id}"

    for record in records:
        stats.records_in += 1
        offset = last_offset = record.queue_offset
        outputs.origin = f"{record.topic}/{record.queue_id}/{offset}"
        try:
            value = stage.source.deserializer(record.body)
        except Exception as exc:
            dead_letter(ctx, sender, stats, record, stage.source.op_id, exc)
            continue
        try:
            elements = chain.run(value, record.born_timestamp)
            if key_fn is None:
                continue
            keyed: list[Keyed] = []
            for sub, (v, ts) in enumerate(elements):
                try:
                    key = key_fn(v)
                    key_bytes, target = router.route(key)
                    # Packed now unless it is certain to pack later: combined
                    # batches rarely send records, and whether a value is a dead
                    # letter must not depend on how its batch went.
                    packed: Packable = (
                        (key, v, ts, offset, sub)
                        if combine and _always_packs(v) and _INT64 <= ts < _UINT64
                        else pack_record(key, v, ts, offset, sub)
                    )
                except Exception as exc:
                    raise UserFunctionError(key_op, exc) from exc
                keyed.append((key, key_bytes, target, v, ts, packed))
            if agg is not None:
                # Also without combining: an aggregate that cannot take a value
                # fails here, where the dead letter still has the original bytes.
                _fold(agg, keyed, combined if combine else None)
                if combine and agg.window is not None:
                    _check_progress(agg, keyed, progress, per_record_only)
        except UserFunctionError as err:
            dead_letter(ctx, sender, stats, record, err.op_id, err.cause)
            continue
        for _key, _kb, target, _v, _ts, packed in keyed:
            per_record[target].append((packed, offset))
            combined_records[target] += 1

    if stage.output_topic is not None:
        for target in sorted(set(per_record) | set(combined)):
            body = None
            if combine and target not in per_record_only:
                try:
                    body = encode_combined(
                        queue_id,
                        list(combined[target].values()),
                        (last_offset, _WHOLE_OFFSET),
                        combined_records[target],
                    )
                except PackingError:
                    body = None  # an accumulator the codec cannot carry: send records
                if body is not None and len(body) > MAX_BODY_BYTES:
                    body = None  # too big to go as one message: fall back to records
            if body is not None:
                _send(ctx, sender, stats, target, body, queue_id, last_offset)
                stats.shuffle_records += len(combined[target])
            else:
                stats.shuffle_records += len(per_record[target])
                for chunk, last in _chunks(_packed(per_record[target])):
                    _send(ctx, sender, stats, target, records_body(queue_id, chunk), queue_id, last)
    outputs.flush()
    sender.flush()  # everything durable before the driver commits the offsets
    return stats


def _merging(agg: n.Aggregate) -> bool:
    return bool(agg.window is not None and agg.window.is_merging)


class _KeyRouter:
    """Key bytes and shuffle queue of a grouping key, remembered for string keys.

    A micro-batch meets the same keys over and over (a vocabulary of words);
    packing and hashing each occurrence was a third of stage 0's time. Only
    ``str`` keys are remembered: for them equality implies the same packed
    bytes, which is not true of e.g. ``1 == 1.0 == True``.
    """

    _LIMIT = 1 << 17

    def __init__(self, shuffle_queues: int) -> None:
        self.shuffle_queues = shuffle_queues
        self._known: dict[str, tuple[bytes, int]] = {}

    def route(self, key: Any) -> tuple[bytes, int]:
        if type(key) is str:
            hit = self._known.get(key)
            if hit is not None:
                return hit
        key_bytes = encode_key(key)
        routed = (key_bytes, queue_for_key(key_bytes, self.shuffle_queues))
        if type(key) is str:
            if len(self._known) >= self._LIMIT:
                self._known.clear()
            self._known[key] = routed
        return routed


def _check_progress(
    agg: n.Aggregate, keyed: list[Keyed], progress: dict[int, int], per_record_only: set[int]
) -> None:
    """Mark shuffle queues that must go per record, then advance their progress.

    A record whose window this batch's own earlier records (bound for the same
    queue) already closed is late by its origin's progress; only the
    per-record form lets stage 1 judge that exactly as without combining.
    """
    assert agg.window is not None
    for _key, _kb, target, _v, ts, _packed in keyed:
        for w in agg.window.assign(ts):
            if w.end <= progress.get(target, w.end) - agg.allowed_lateness_ms:
                per_record_only.add(target)
    for _key, _kb, target, _v, ts, _packed in keyed:
        progress[target] = max(progress.get(target, ts), ts)


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


def _always_packs(value: Any) -> bool:
    """True for values msgpack encodes whatever they hold (checked in O(1))."""
    kind = type(value)
    if kind is str:
        return bool(value.isascii())  # no lone surrogates
    if kind is int:
        return bool(_INT64 <= value < _UINT64)
    return kind is float or kind is bool or kind is bytes or value is None


def _packed(entries: list[tuple[Packable, int]]) -> list[tuple[bytes, int]]:
    return [(e if isinstance(e, bytes) else pack_record(*e), off) for e, off in entries]


def _chunks(recs: list[tuple[bytes, int]]) -> list[tuple[list[bytes], int]]:
    """Split packed records so each message stays under the body limit; with each
    chunk, the source offset of its last record."""
    out: list[tuple[list[bytes], int]] = []
    chunk: list[bytes] = []
    size = ENVELOPE_BYTES
    last = -1
    for packed, offset in recs:
        if chunk and size + len(packed) > MAX_BODY_BYTES:
            out.append((chunk, last))
            chunk, size = [], ENVELOPE_BYTES
        chunk.append(packed)
        size += len(packed)
        last = offset
    if chunk:
        out.append((chunk, last))
    return out


def _send(
    ctx: StageContext,
    sender: Sender,
    stats: TaskStats,
    target: int,
    body: bytes,
    src: int,
    offset: int,
) -> None:
    assert ctx.stage.output_topic is not None
    sender.send(ctx.stage.output_topic, body, queue_id=target, key=f"{ctx.job_id}/{src}/{offset}")
    stats.shuffle_messages += 1
