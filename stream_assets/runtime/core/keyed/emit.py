"""What a keyed batch sends: results to sinks and the next shuffle (through the
outbox), late records, dead letters; and the changelog writer it commits with.

Results are sent at least once, each with an origin that is the same for a
replayed copy (:mod:`~stream_assets.runtime.core.keyed.results`). Results bound for another
shuffle (a ``key_by`` after this stage's head) go through an *outbox*:
committed with the state, sent only after it, with origin (this queue, the
commit's seq, position) and this queue's progress (its fired watermark and
results' event times) to every queue of the next shuffle, so a chained
stage's watermark moves even where no result of this queue went. A batch
replayed after a crash may fire other windows than the attempt that died, so
only committed results may travel on; the next batch (or a restore on another
executor) re-sends an outbox whose send was not confirmed, and the next stage
de-duplicates by origin.
"""

from __future__ import annotations

import json
from typing import Any

from stream_assets.operators.metadata import Metadata
from stream_assets.plan import nodes as n
from stream_assets.plan.topology import origin_id
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.core.keyed.logic import Late
from stream_assets.runtime.core.keyed.results import (
    Expired,
    Result,
    computed,
    result_key,
    shown_result,
)
from stream_assets.runtime.core.ports import Sender
from stream_assets.runtime.core.stage0.chain import OperatorGraph, UserFunctionError
from stream_assets.runtime.core.stage0.outputs import StageOutputs, dead_letter, message_key
from stream_assets.runtime.core.stage0.shuffle_out import ShuffleOut
from stream_assets.runtime.core.stage0.stateless import stage_graph
from stream_assets.serde.packing import unpack
from stream_assets.state import layout as lay
from stream_assets.state.changelog import DEFAULT_CHUNK_BYTES, ChangelogWriter
from stream_assets.state.records import MAX_BODY
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import later


def out_progress(
    ctx: StageContext,
    before: int | None,
    watermark: int | None,
    closed_floor: int | None,
    results: list[Result],
) -> int | None:
    """This queue's progress for the next shuffle (None: no stage after it goes by event time).

    The highest event time of its results so far, and at least the fired
    watermark minus one: every result still to come is at or after it (a
    window's result happens at its end - 1, a table join's at its record's time).
    """
    if not any(e.head.waits_for_time for e in ctx.stage.exits):
        return None
    head = ctx.stage.head
    assert head is not None
    fired_to = later(watermark if head.judges_lateness else None, closed_floor)
    newest = max((ts for _origin, _value, ts, _key in results), default=None)
    return later(before, later(newest, None if fired_to is None else fired_to - 1))


def changelog_writer(
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


def resend_outbox(
    ctx: StageContext, queue_id: int, store: QueueStateStore, sender: Sender, stats: TaskStats
) -> None:
    """Send the committed outbox again if its send was never confirmed (a crash, a restore)."""
    if not ctx.stage.exits:
        return
    raw = store.get(lay.OUTBOX)
    if raw is None:
        return
    seq, entries, *progress = unpack(raw)  # no progress: written before it travelled
    if store.committed.extra.get("outbox_sent") != seq:
        carried = progress[0] if progress else None
        send_outbox(ctx, queue_id, store, seq, entries, carried, sender, stats)


def send_outbox(
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
    meta = store.meta
    meta.extra["outbox_sent"] = seq
    store.update_meta(meta)


def emit(
    ctx: StageContext,
    queue_id: int,
    seq: int,
    sender: Sender,
    stats: TaskStats,
    head: n.Stateful,
    results: list[Result],
    late: list[Late],
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
        outputs.route_key = result_key(key)
        if isinstance(value, Expired):
            _send_deletion(ctx, sender, stats, graph, outputs, value, ts)
            continue
        try:
            value = computed(head, value)
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
            shown = shown_result(value)
            position = "/".join(origin)
            dead_letter_value(ctx, sender, stats, None, err.op_id, err.cause, shown, position)
    if head.late_topic:
        _send_late_records(ctx, sender, stats, head, head.late_topic, late)
    outputs.flush()
    return outbox


def _send_late_records(
    ctx: StageContext,
    sender: Sender,
    stats: TaskStats,
    head: n.Stateful,
    topic: str,
    late: list[Late],
) -> None:
    """Send the batch's late records to ``topic``; one the broker would refuse is a
    dead letter of its own."""
    for key, value, window_end, where in late:
        try:
            _send_late(ctx, sender, topic, key, value, window_end, where)
        except Exception as exc:  # e.g. a body over the broker's limit
            shown = {"key": key, "value": value, "window_end": window_end}
            position = f"late/{where}/{window_end}/{result_key(key)}"
            dead_letter_value(ctx, sender, stats, None, head.op_id, exc, shown, position)


def _send_deletion(
    ctx: StageContext,
    sender: Sender,
    stats: TaskStats,
    graph: OperatorGraph,
    outputs: StageOutputs,
    expired: Expired,
    ts: int,
) -> None:
    """Send a key's deletion to every sink and print the aggregate's results reach in
    this stage, past the user's functions; one the broker refuses is a dead letter."""
    value = expired.value()
    for node in graph.terminals():
        try:
            outputs.emit(node, value, ts)
        except Exception as exc:  # e.g. a sink serializer or key= that cannot take it
            position = "/".join(outputs.origin)
            dead_letter_value(ctx, sender, stats, None, node.op_id, exc, value, position)


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
    late_key = message_key(ctx.job_id, "late", origin, str(window_end), result_key(key))
    sender.send(topic, body.encode(), key=late_key)


def dead_letter_value(
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
