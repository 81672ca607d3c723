"""Stage 0 on one source queue: deserialize, run the stateless operators, shuffle.

Records leave for the shuffle topic grouped into one message per shuffle queue
per micro-batch (see :mod:`stream_assets.runtime.shuffle_codec`). Each record
carries its origin (source queue, offset, sub-index) so the stateful stage
applies it exactly once even when this batch is re-sent after a crash.

When the next aggregate is decomposable, records are pre-combined per key and
window before sending, except below the offset each queue had reached when the
instance started (``TaskContext.may_combine``): a batch replayed after a crash
may have other boundaries than the one that was cut short, and only per-record
origins can be de-duplicated against any prefix.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from stream_assets.operators.chain import OperatorChain, UserFunctionError
from stream_assets.plan import nodes as n
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.runtime.clients import reader_for
from stream_assets.runtime.outputs import StageOutputs
from stream_assets.runtime.shuffle_codec import encode_combined, encode_key, encode_records
from stream_assets.runtime.task_context import MAX_BODY_BYTES, TaskContext, TaskStats

# A combined message covers every offset of its batch: sub-index above any real one.
_WHOLE_OFFSET = 2**31 - 1


def run_stateless(ctx: TaskContext, queue_id: int, start: int, end: int) -> TaskStats:
    """Process offsets ``start`` .. ``end`` of source queue ``queue_id``."""
    stats = TaskStats(stage=ctx.stage.index, queue_id=queue_id, end_offset=end)
    stage = ctx.stage
    assert stage.source is not None
    reader = reader_for(ctx.client_settings(), ctx.group)
    outputs = StageOutputs(ctx, stats)
    chain = OperatorChain(stage.ops, outputs.emit)
    key_fn: Callable[[Any], Any] | None = stage.key_by.fn if stage.key_by else None
    agg = ctx.next_aggregate
    combine = (
        ctx.may_combine(queue_id, start) and stage.combine and agg is not None and not _merging(agg)
    )
    per_record: dict[int, list[list[Any]]] = defaultdict(list)
    combined: dict[int, dict[tuple[bytes, Any, Any], list[Any]]] = defaultdict(dict)
    combined_records: dict[int, int] = defaultdict(int)  # keyed records bound for each queue
    last_offset = start - 1

    for record in reader.read(ctx.input_queue(queue_id), start, end):
        stats.records_in += 1
        last_offset = record.queue_offset
        outputs.origin = f"{record.topic}/{record.queue_id}/{record.queue_offset}"
        try:
            value = stage.source.deserializer(record.body)
        except Exception as exc:
            ctx.dead_letter(stats, record, stage.source.op_id, exc)
            continue
        try:
            elements = chain.run(value, record.born_timestamp)
            if key_fn is None:
                continue
            keyed = []
            for v, ts in elements:
                try:
                    keyed.append((key_fn(v), v, ts))
                except Exception as exc:
                    raise UserFunctionError(
                        stage.key_by.op_id if stage.key_by else "", exc
                    ) from exc
            # Also without combining: an aggregate that cannot take a value fails
            # here, where the dead letter still has the record's original bytes.
            partials = _partials(agg, keyed, ctx.shuffle_queues) if agg is not None else []
        except UserFunctionError as err:
            ctx.dead_letter(stats, record, err.op_id, err.cause)
            continue
        for sub, (key, v, ts) in enumerate(keyed):
            target = queue_for_key(encode_key(key), ctx.shuffle_queues)
            per_record[target].append([key, v, ts, record.queue_offset, sub])
            combined_records[target] += 1
        if combine:
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
            if combine:
                entries = list(combined[target].values())
                body = encode_combined(
                    queue_id, entries, (last_offset, _WHOLE_OFFSET), combined_records[target]
                )
                if len(body) > MAX_BODY_BYTES:
                    body = None  # too big to go as one message: fall back to records
            if body is not None:
                _send(ctx, stats, target, body, queue_id, last_offset)
                stats.shuffle_records += len(combined[target])
            else:
                stats.shuffle_records += len(per_record[target])
                for chunk in _chunks(per_record[target]):
                    _send(
                        ctx, stats, target, encode_records(queue_id, chunk), queue_id, chunk[-1][3]
                    )
    outputs.flush()
    return stats


def _merging(agg: n.Aggregate) -> bool:
    return bool(agg.window is not None and agg.window.is_merging)


Partial = tuple[int, tuple[bytes, Any, Any], Any, Any, int]


def _partials(
    agg: n.Aggregate | None, keyed: list[tuple[Any, Any, int]], shuffle_queues: int
) -> list[Partial]:
    """Per keyed element and window: (shuffle queue, (key bytes, window), key, acc, ts)."""
    assert agg is not None
    acc_def = agg.accumulator
    out: list[Partial] = []
    for key, value, ts in keyed:
        try:
            acc = acc_def.add(acc_def.zero(), value)
        except Exception as exc:
            raise UserFunctionError(agg.op_id, exc) from exc
        key_bytes = encode_key(key)
        target = queue_for_key(key_bytes, shuffle_queues)
        windows = agg.window.assign(ts) if agg.window is not None else [None]
        for w in windows:
            bounds = (w.start, w.end) if w is not None else (None, None)
            out.append((target, (key_bytes, *bounds), key, acc, ts))
    return out


def _chunks(recs: list[list[Any]]) -> list[list[list[Any]]]:
    """Split records so each message stays under the body limit."""
    if not recs:
        return []
    out: list[list[list[Any]]] = []
    chunk: list[list[Any]] = []
    size = 0
    for rec in recs:
        est = len(encode_records(0, [rec]))
        if chunk and size + est > MAX_BODY_BYTES:
            out.append(chunk)
            chunk, size = [], 0
        chunk.append(rec)
        size += est
    out.append(chunk)
    return out


def _send(
    ctx: TaskContext, stats: TaskStats, target: int, body: bytes, src: int, offset: int
) -> None:
    assert ctx.stage.output_topic is not None
    ctx.producer().send(
        ctx.stage.output_topic, body, queue_id=target, key=f"{ctx.job_id}/{src}/{offset}"
    )
    stats.shuffle_messages += 1
