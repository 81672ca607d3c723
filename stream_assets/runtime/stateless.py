"""A source stage on one source queue: deserialize, run the operators, shuffle.

Pure: records come in as an iterable, everything leaves through a
:class:`~stream_assets.runtime.ports.Sender`. Records leave for each shuffle
topic the stage reaches grouped into one message per shuffle queue per
micro-batch (:mod:`~stream_assets.runtime.shuffle_out`). Each record carries
its origin (this queue's origin id, offset, sub-index) so the keyed stage
applies it exactly once even when this batch is re-sent after a crash.

Any failure of one record -- its deserializer, a user function, the key, the
aggregate's ``add``, a value or key the shuffle codec cannot carry or that is
too large for a shuffle message, or a sink message the broker would refuse --
sends that record's original bytes to the dead-letter topic, and the batch
goes on.
"""

from __future__ import annotations

from collections.abc import Iterable

from stream_assets.operators.metadata import Metadata
from stream_assets.plan.topology import Stage, origin_id
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.batch_count_path import BatchCountPath
from stream_assets.runtime.chain import OperatorGraph, UserFunctionError
from stream_assets.runtime.context import StageContext, TaskStats
from stream_assets.runtime.count_path import CountPath
from stream_assets.runtime.outputs import StageOutputs, dead_letter
from stream_assets.runtime.ports import Sender
from stream_assets.runtime.shuffle_out import Keyed, ShuffleOut


def stage_graph(stage: Stage, outputs: StageOutputs | None) -> OperatorGraph:
    """The operator graph of ``stage``, emitting sink/print outputs through ``outputs``."""
    return OperatorGraph(
        stage.children,
        stage.nodes,
        root=stage.root,
        exits=tuple(e.key_by.op_id for e in stage.exits),
        outputs=None if outputs is None else outputs.emit,
    )


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
    source = stage.source
    assert source is not None
    outputs = StageOutputs(ctx, sender, stats)
    graph = stage_graph(stage, outputs)
    shuffle = ShuffleOut(
        ctx,
        sender,
        stats,
        origin_id(stage.index, queue_id),
        combine=ctx.may_combine(queue_id, start),
    )
    # A straight chain into a count: most records take the specialised path; a chain
    # of batch operators, the whole batch at once.
    counting = CountPath.of(stage, shuffle)
    whole = BatchCountPath.of(stage, shuffle)
    exits = range(len(stage.exits))
    last_offset = start - 1
    outputs.route_key = f"{stage.input_topic}/{queue_id}"
    if whole is not None:
        records = list(records)
        if whole.count(records):
            stats.records_in = stats.batched_in = len(records)
            last_offset = records[-1].queue_offset if records else last_offset
            records = []

    for record in records:
        stats.records_in += 1
        offset = last_offset = record.queue_offset
        # The queue's index, not the broker's id: ids repeat across broker groups.
        origin = f"{record.topic}/{queue_id}/{offset}"
        outputs.origin = (origin,)
        try:
            value = source.deserializer(record.body)
        except Exception as exc:
            dead_letter(ctx, sender, stats, record, source.op_id, exc, origin)
            continue
        ts = record.born_timestamp
        try:
            if counting is None:
                meta = Metadata.of(record, ts) if graph.wants_metadata else None
                reached = graph.run(value, ts, meta)
            else:
                values = counting.take(value, ts, offset)
                if values is None:
                    continue
                reached = [[(v, ts) for v in values]]
            keyed: list[list[Keyed]] = []
            subs: dict[str, int] = {}  # per shuffle topic: sub-indexes used by this record
            for i in exits:
                k: list[Keyed] = []
                if reached[i]:
                    topic = stage.exits[i].topic
                    k = shuffle.key(i, reached[i], offset, first_sub=subs.get(topic, 0))
                    subs[topic] = subs.get(topic, 0) + len(k)
                shuffle.fold(k)
                keyed.append(k)
        except UserFunctionError as err:
            dead_letter(ctx, sender, stats, record, err.op_id, err.cause, origin)
            continue
        for i in exits:
            if keyed[i]:
                shuffle.accept(i, keyed[i], offset)
        shuffle.observe()

    if counting is not None:
        counting.merge()
    shuffle.send_all(last_offset)
    outputs.flush()
    sender.flush()  # everything durable before the driver commits the offsets
    return stats
