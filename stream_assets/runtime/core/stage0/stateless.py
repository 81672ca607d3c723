"""A source stage on one source queue: deserialize, run the operators, shuffle.

Pure: records come in as an iterable, everything leaves through a
:class:`~stream_assets.runtime.core.ports.Sender`. Records leave for each shuffle
topic the stage reaches grouped into one message per shuffle queue per
micro-batch (:mod:`~stream_assets.runtime.core.stage0.shuffle_out`). Each record carries
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
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.core.ports import Sender
from stream_assets.runtime.core.stage0.across_queues import send_across
from stream_assets.runtime.core.stage0.batch_count_path import BatchCountPath
from stream_assets.runtime.core.stage0.chain import OperatorGraph, UserFunctionError
from stream_assets.runtime.core.stage0.count_path import CountPath
from stream_assets.runtime.core.stage0.outputs import StageOutputs, dead_letter
from stream_assets.runtime.core.stage0.shuffle_out import Keyed, ShuffleOut

#: One source queue's batch: (queue id, start, end, its records).
Part = tuple[int, int, int, Iterable[Record]]


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
    batch = _SourceBatch(ctx, queue_id, start, end, sender)
    last_offset = batch.run(records)
    batch.shuffle.send_all(last_offset)
    return batch.flush()


def run_source_batches(ctx: StageContext, parts: Iterable[Part], sender: Sender) -> list[TaskStats]:
    """Several source queues' batches as one step (a real-time task's), each ``part``
    ``(queue_id, start, end, records)`` as :func:`run_source_batch` takes them; their
    pre-combined partials merged across them where they can be
    (:mod:`~stream_assets.runtime.core.stage0.across_queues`). The stats per queue."""
    batches: list[tuple[_SourceBatch, int]] = []
    for queue_id, start, end, records in parts:  # read lazily: one queue's records at a time
        batch = _SourceBatch(ctx, queue_id, start, end, sender)
        batches.append((batch, batch.run(records, merge_counts=False)))
    across = send_across([(b.shuffle, b.counting, last) for b, last in batches])
    for i, (batch, last_offset) in enumerate(batches):
        if i not in across:
            if batch.counting is not None:
                batch.counting.merge()
            batch.shuffle.send_all(last_offset)
    for batch, _ in batches:
        batch.outputs.flush()
    sender.flush()
    return [batch.stats for batch, _ in batches]


class _SourceBatch:
    """One run of :func:`run_source_batch`: the stage's graph, fast paths and shuffle.

    The twin of :class:`~stream_assets.runtime.core.keyed.batch._QueueBatch`: built
    once, fed the batch's records (all at once where a batch path takes them, else
    one by one), finished once everything is sent.
    """

    def __init__(
        self, ctx: StageContext, queue_id: int, start: int, end: int, sender: Sender
    ) -> None:
        self.ctx, self.queue_id, self.start, self.sender = ctx, queue_id, start, sender
        self.stats = TaskStats(stage=ctx.stage.index, queue_id=queue_id, end_offset=end)
        self.stage = stage = ctx.stage
        assert stage.source is not None
        self.source = stage.source
        self.outputs = StageOutputs(ctx, sender, self.stats)
        self.outputs.route_key = f"{stage.input_topic}/{queue_id}"
        self.graph = stage_graph(stage, self.outputs)
        self.shuffle = ShuffleOut(
            ctx,
            sender,
            self.stats,
            origin_id(stage.index, queue_id),
            combine=ctx.may_combine(queue_id, start),
        )
        # A straight chain into a count: most records take the specialised path; a chain
        # of batch operators, the whole batch at once.
        self.counting = CountPath.of(stage, self.shuffle)
        self.whole = BatchCountPath.of(stage, self.shuffle)
        self.exits = range(len(stage.exits))

    def apply_whole(self, records: list[Record]) -> bool:
        """Count the whole batch at once; False where it has a shape the path does not take."""
        assert self.whole is not None
        if not self.whole.count(records):
            return False
        self.stats.records_in = self.stats.batched_in = len(records)
        return True

    def apply(self, record: Record) -> None:
        """One record through the chain to the sinks and shuffles (or a dead letter)."""
        self.stats.records_in += 1
        offset = record.queue_offset
        # The queue's index, not the broker's id: ids repeat across broker groups.
        origin = f"{record.topic}/{self.queue_id}/{offset}"
        self.outputs.origin = (origin,)
        try:
            value = self.source.deserializer(record.body)
        except Exception as exc:
            dead_letter(self.ctx, self.sender, self.stats, record, self.source.op_id, exc, origin)
            return
        try:
            keyed = self._key(record, value, offset)
        except UserFunctionError as err:
            dead_letter(self.ctx, self.sender, self.stats, record, err.op_id, err.cause, origin)
            return
        if keyed is None:
            return
        for i in self.exits:
            if keyed[i]:
                self.shuffle.accept(i, keyed[i], offset)
        self.shuffle.observe()

    def _key(self, record: Record, value: object, offset: int) -> list[list[Keyed]] | None:
        """Per exit, what ``value`` leaves for the next stage as; None where counting took it."""
        ts = record.born_timestamp
        if self.counting is None:
            meta = Metadata.of(record, ts) if self.graph.wants_metadata else None
            reached = self.graph.run(value, ts, meta)
        else:
            values = self.counting.take(value, ts, offset)
            if values is None:
                return None
            reached = [[(v, ts) for v in values]]
        keyed: list[list[Keyed]] = []
        subs: dict[str, int] = {}  # per shuffle topic: sub-indexes used by this record
        for i in self.exits:
            k: list[Keyed] = []
            if reached[i]:
                topic = self.stage.exits[i].topic
                k = self.shuffle.key(i, reached[i], offset, first_sub=subs.get(topic, 0))
                subs[topic] = subs.get(topic, 0) + len(k)
            self.shuffle.fold(k)
            keyed.append(k)
        return keyed

    def run(self, records: Iterable[Record], merge_counts: bool = True) -> int:
        """Apply ``records``; the last offset read (``start - 1``: none). The counts are
        in the shuffle's combined slots after it, ready to send, unless ``merge_counts``
        is False (merged across queues, they never go into this queue's slots)."""
        last_offset = self.start - 1
        if self.whole is not None:
            records = list(records)
            if self.apply_whole(records):
                last_offset = records[-1].queue_offset if records else last_offset
                records = []
        for record in records:
            last_offset = record.queue_offset
            self.apply(record)
        if merge_counts and self.counting is not None:
            self.counting.merge()
        return last_offset

    def flush(self) -> TaskStats:
        """Once the shuffle is sent: the rest, all of it durable before the driver commits
        offsets."""
        self.outputs.flush()
        self.sender.flush()
        return self.stats
