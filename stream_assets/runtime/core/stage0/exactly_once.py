"""A source stage's step with exactly-once sinks: its outputs committed with its position.

A stateless step has no state to commit its sink transaction with, and a
consumer offset cannot serve: it is last-write-wins and names no attempt, so a
replay of the same range by a new owner would look "committed" to the
broker's check-back for both attempts' messages. So such a stage logs its
steps as a keyed queue logs its state (:attr:`~stream_assets.plan.topology.Stage.positioned`):
each source queue has a state queue whose only state is the source offset the
last step read to, and each step runs in the keyed attempt's frame
(:func:`~stream_assets.runtime.core.keyed.attempt.run_logged_step`: currency,
fencing, the step's tag, the wait for the previous step's sink messages if its
owner may have died before ending them). A step:

1. skips source records below the logged position: a step whose delta landed
   but whose consumer offset commit did not is never sent twice (its shuffle
   messages were stored before the delta; the keyed stage de-duplicates those
   by origin anyway);
2. runs the stage as always, its exactly-once sinks' messages *prepared*, the
   rest sent; all of it is stored before the next step;
3. compare-and-appends a delta holding only meta (position, owner, the
   prepared messages), then ends the transaction.

The check-back, a takeover's wait, rebalancing and restores are the keyed
path's, unchanged.

Example::

    >>> stats = run_positioned_source_batch(ctx, 3, 120, 180, ports, tags)  # doctest: +SKIP
    >>> stats.records_in, stats.skipped_duplicates  # a replay of a landed step  # doctest: +SKIP
    (0, 60)
"""

from __future__ import annotations

from stream_assets.rocketmq.tags import TagFilter
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.core.keyed.attempt import QueuePorts, run_logged_step
from stream_assets.runtime.core.keyed.emit import changelog_writer
from stream_assets.runtime.core.ports import Sender
from stream_assets.runtime.core.sink_transactions import ExactlyOnceSinks, record_step
from stream_assets.runtime.core.stage0.stateless import run_source_batch
from stream_assets.state.changelog import commit_with_changelog
from stream_assets.state.errors import ChangelogConflictError
from stream_assets.state.store import QueueStateStore


def run_positioned_source_batch(
    ctx: StageContext,
    queue_id: int,
    start: int,
    end: int,
    ports: QueuePorts,
    tags: TagFilter,
) -> TaskStats:
    """Offsets ``start`` .. ``end`` of source queue ``queue_id`` (``ports.input_queue``),
    those ``tags`` selects, with the stage's exactly-once sinks committed with the step's
    position in its state queue; again on a changelog conflict."""

    def step(store: QueueStateStore, sender: Sender, sinks: ExactlyOnceSinks | None) -> TaskStats:
        assert sinks is not None, "a positioned stage has exactly-once sinks"
        position = store.meta.input_offset or 0
        first = min(max(start, position), end)
        # Filtered here, not by the broker: the frame's reader is the state layer's.
        # The same rule as the broker's (TagFilter), so the same records.
        records = ports.reader.read(ports.input_queue, first, end)
        try:
            stats = run_source_batch(
                ctx, queue_id, first, end, (r for r in records if tags.matches(r.tags)), sender
            )
        except BaseException:
            sinks.roll_back()  # no delta was sent: the step never lands
            raise
        stats.skipped_duplicates += first - start
        meta = store.next_meta()
        meta.input_offset = max(end, position)
        claim = (store.meta.generation, store.meta.writer) != (ctx.generation, ctx.writer)
        meta.generation, meta.writer = ctx.generation, ctx.writer
        # A new owner commits even an empty step: its generation there fences the last.
        committed = end > first or claim
        if committed:
            assert ctx.stage.state_topic is not None
            write_id = record_step(meta, sinks, store.meta.log_end or 0)
            writer = changelog_writer(ctx, sender, ctx.stage.state_topic, queue_id)
            try:
                commit_with_changelog(store, {}, meta, writer, write_id)
            except ChangelogConflictError:
                sinks.roll_back()  # the delta is void: it never lands
                raise
            # Any other failure may follow a landed delta: the check-back decides.
        sinks.finish(store, committed)
        return stats

    return run_logged_step(ctx, queue_id, ports, step)
