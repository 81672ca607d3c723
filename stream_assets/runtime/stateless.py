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

Partial = tuple[int, tuple[bytes, Any, Any], Any, Any, int]


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
    per_record: dict[int, list[tuple[bytes, int]]] = defaultdict(list)  # (packed, offset)
    combined: dict[int, dict[tuple[bytes, Any, Any], list[Any]]] = defaultdict(dict)
    combined_records: dict[int, int] = defaultdict(int)  # keyed records bound for each queue
    last_offset = start - 1
    progress: dict[int, int] = {}  # per shuffle queue: max event time sent this batch
    per_record_only: set[int] = set()  # shuffle queues whose batch must go per record

    for record in records:
        stats.records_in += 1
        last_offset = record.queue_offset
        outputs.origin = f"{record.topic}/{record.queue_id}/{record.queue_offset}"
        try:
            value = stage.source.deserializer(record.body)
        except Exception as exc:
            dead_letter(ctx, sender, stats, record, stage.source.op_id, exc)
            continue
        try:
            elements = chain.run(value, record.born_timestamp)
            if key_fn is None:
                continue
            keyed = []
            for sub, (v, ts) in enumerate(elements):
                try:
                    key = key_fn(v)
                    key_bytes = encode_key(key)
                    packed = pack_record(key, v, ts, record.queue_offset, sub)
                except Exception as exc:
                    raise UserFunctionError(key_op, exc) from exc
                keyed.append((key, key_bytes, v, ts, packed))
            # Also without combining: an aggregate that cannot take a value fails
            # here, where the dead letter still has the record's original bytes.
            partials = _partials(agg, keyed, ctx.shuffle_queues) if agg is not None else []
        except UserFunctionError as err:
            dead_letter(ctx, sender, stats, record, err.op_id, err.cause)
            continue
        for _key, key_bytes, _v, _ts, packed in keyed:
            target = queue_for_key(key_bytes, ctx.shuffle_queues)
            per_record[target].append((packed, record.queue_offset))
            combined_records[target] += 1
        if combine:
            assert agg is not None
            for target, entry_key, _key, _acc, _ts in partials:
                # A record whose window this batch's own earlier records (bound
                # for the same queue) already closed is late by its origin's
                # progress; only the per-record form lets stage 1 judge that.
                end = entry_key[2]
                if end is not None and end <= progress.get(target, end) - agg.allowed_lateness_ms:
                    per_record_only.add(target)
            for target, _entry_key, _key, _acc, ts in partials:
                progress[target] = max(progress.get(target, ts), ts)
            for target, entry_key, key, acc, ts in partials:
                slot = combined[target].get(entry_key)
                if slot is None:
                    combined[target][entry_key] = [key, entry_key[1], entry_key[2], acc, ts, 1]
                else:
                    assert agg is not None
                    slot[3] = agg.accumulator.merge(slot[3], acc)
                    slot[4] = max(slot[4], ts)
                    slot[5] += 1

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
                for chunk, last in _chunks(per_record[target]):
                    _send(ctx, sender, stats, target, records_body(queue_id, chunk), queue_id, last)
    outputs.flush()
    return stats


def _merging(agg: n.Aggregate) -> bool:
    return bool(agg.window is not None and agg.window.is_merging)


def _partials(
    agg: n.Aggregate | None,
    keyed: list[tuple[Any, bytes, Any, int, bytes]],
    shuffle_queues: int,
) -> list[Partial]:
    """Per keyed element and window: (shuffle queue, (key bytes, window), key, acc, ts)."""
    assert agg is not None
    acc_def = agg.accumulator
    out: list[Partial] = []
    for key, key_bytes, value, ts, _packed in keyed:
        try:
            acc = acc_def.add(acc_def.zero(), value)
        except Exception as exc:
            raise UserFunctionError(agg.op_id, exc) from exc
        target = queue_for_key(key_bytes, shuffle_queues)
        windows = agg.window.assign(ts) if agg.window is not None else [None]
        for w in windows:
            bounds = (w.start, w.end) if w is not None else (None, None)
            out.append((target, (key_bytes, *bounds), key, acc, ts))
    return out


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
