"""One batch of a stateful queue, as every runner attempts it: currency, fencing, the batch, stats.

Before :func:`~stream_assets.runtime.core.keyed.batch.run_keyed_batch` may touch a queue's
store, the store must hold the queue's whole state topic history: the store's
log end (where its last changelog write ended) must equal the state queue's
end offset, one offset query. A store that is behind (the queue moved here,
another executor or instance wrote since, a crashed attempt) catches up from
the changelog tail or restores from the latest snapshot first
(:func:`~stream_assets.state.restore.ensure_current`). Then the owner is
checked (a newer generation recorded there fences this one), and only then
is anything read or sent. A :class:`~stream_assets.state.errors.ChangelogConflictError`
(someone appended between the check and the write, or a retried send was
stored twice) voids the attempt without a local commit; the batch runs again
from the check, which then restores. The stats report what the currency
check cost, what a restore rebuilt, and the store's size after the batch.

:func:`run_stateful_batch` is all of that, for both of its callers. They
differ only in the :class:`QueuePorts` they give it:

- the Spark adapter (:func:`stream_assets.runtime.drive.queues.run_stateful_queue`):
  the store from the Python worker's kept handles on the executor's disk
  (closed after a failed attempt), the broker's admin and reader, a send
  buffer over the batching producer, the wall clock;
- the test driver (:class:`stream_assets.testing.TopologyTestDriver`): its own
  open store in a temporary directory, views of in-memory topics, a send
  buffer over the in-memory broker, the test's clock.

Example::

    >>> ports = QueuePorts(store=lambda: HANDLES.use(root, "wc", "count", 3), admin=admin,
    ...                    reader=reader, state_queue=log, input_queue=shuffle,
    ...                    sender=lambda tx: SendBuffer(producer, transaction=tx))  # doctest: +SKIP
    >>> stats = run_stateful_batch(ctx, 3, 120, 180, ports)  # doctest: +SKIP
    >>> stats.restores, stats.records_in  # doctest: +SKIP
    (0, 60)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.core.keyed.batch import check_owner, run_keyed_batch
from stream_assets.runtime.core.ports import Sender
from stream_assets.runtime.core.sink_transactions import (
    ExactlyOnceSinks,
    StepTransaction,
    TransactionPort,
    note_ended,
)
from stream_assets.state.errors import ChangelogConflictError
from stream_assets.state.ports import OffsetQueries, RangeReader
from stream_assets.state.restore import RestoreResult, ensure_current
from stream_assets.state.step_fate import StepTag
from stream_assets.state.store import QueueStateStore

#: Attempts of one batch while its changelog writes conflict; the last conflict is raised.
CONFLICT_ATTEMPTS = 3


@dataclass(frozen=True)
class QueuePorts:
    """What one stateful queue's batch runs against (all that differs between runners)."""

    #: Opens the queue's store for one attempt (its block is the attempt).
    store: Callable[[], AbstractContextManager[QueueStateStore]]
    #: The state queue's offsets (the currency check, a restore's range).
    admin: OffsetQueries
    #: Reads the state queue (restores) and the input queue (the batch's records).
    reader: RangeReader
    #: The state topic's queue paired with the input queue (same index).
    state_queue: MessageQueue
    #: The shuffle queue the batch reads.
    input_queue: MessageQueue
    #: A fresh sender per attempt: what a voided attempt queued is never sent. It
    #: prepares the attempt's exactly-once sink messages into the transaction given.
    sender: Callable[[StepTransaction | None], Sender]
    #: Half messages for exactly-once sinks (None: the runner has none to offer).
    sink_port: TransactionPort | None = None
    #: How long a new owner waits for the previous owner's last sink messages.
    sink_wait_s: float = 120.0


#: One attempt's work on a store proven current and not fenced: it reads, applies, commits
#: its delta and ends its exactly-once sinks' transaction (store, sender, sinks) -> stats.
StepBody = Callable[[QueueStateStore, Sender, ExactlyOnceSinks | None], TaskStats]


def run_stateful_batch(
    ctx: StageContext,
    queue_id: int,
    start: int,
    end: int,
    ports: QueuePorts,
    idle: Collection[int] = (),
    now_ms: int | None = None,
) -> TaskStats:
    """Offsets ``start`` .. ``end`` of stateful queue ``queue_id``: prove the store current
    (restore if not), fence, apply; again on a changelog conflict.

    ``idle`` and ``now_ms`` as for :func:`~stream_assets.runtime.core.keyed.batch.run_keyed_batch`.
    Raises :class:`~stream_assets.state.errors.FencedError` when a newer owner is
    found, and the conflict of the last of :data:`CONFLICT_ATTEMPTS` attempts.

    >>> stats = run_stateful_batch(ctx, 3, 120, 180, ports, idle=(1,))  # doctest: +SKIP
    """

    def keyed(store: QueueStateStore, sender: Sender, sinks: ExactlyOnceSinks | None) -> TaskStats:
        records = ports.reader.read(ports.input_queue, start, end)
        return run_keyed_batch(ctx, queue_id, end, records, store, sender, idle, now_ms, sinks)

    return run_logged_step(ctx, queue_id, ports, keyed)


def run_logged_step(
    ctx: StageContext, queue_id: int, ports: QueuePorts, body: StepBody
) -> TaskStats:
    """``body`` on queue ``queue_id``'s store once it is current, this owner is not
    fenced and the previous step's exactly-once messages are visible, with the attempt's
    transaction; again on a changelog conflict.

    The frame of every step whose queue has a state topic: a keyed stage's
    (:func:`run_stateful_batch`) and a source stage's with exactly-once sinks
    (:func:`~stream_assets.runtime.core.stage0.exactly_once.run_positioned_source_batch`).
    """
    for attempt in range(CONFLICT_ATTEMPTS):
        try:
            return _attempt(ctx, queue_id, ports, body)
        except ChangelogConflictError:
            if attempt == CONFLICT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _attempt(ctx: StageContext, queue_id: int, ports: QueuePorts, body: StepBody) -> TaskStats:
    with ports.store() as store:
        began = time.monotonic()
        restored = ensure_current(store, ports.state_queue, ports.admin, ports.reader)
        check_owner(ctx, store)  # before reading or sending anything
        currency_s = time.monotonic() - began
        sinks = _exactly_once_sinks(ctx, queue_id, store, ports)
        # The previous step's owner may have died before it ended the step: a key's
        # results stay in step order if that step's are seen before this one's.
        if sinks is not None and sinks.await_previous(store.meta):
            note_ended(store)
        stats = body(store, ports.sender(None if sinks is None else sinks.transaction), sinks)
        _report_currency(stats, currency_s, restored)
        stats.state_keys = store.estimated_key_count()
        stats.state_bytes = store.size_bytes()
    return stats


def _exactly_once_sinks(
    ctx: StageContext, queue_id: int, store: QueueStateStore, ports: QueuePorts
) -> ExactlyOnceSinks | None:
    """The attempt's transaction, naming the offset its delta must land at (the current
    store's log end) and a fresh write id; None for a stage without exactly-once sinks."""
    topics = ctx.stage.exactly_once_topics
    if not topics:
        return None
    if ports.sink_port is None:
        raise RuntimeError(
            f"sinks {sorted(topics)} are exactly_once, and this runner cannot send "
            "transactional messages"
        )
    assert ctx.stage.state_topic is not None
    tag = StepTag(ctx.stage.state_topic, queue_id, store.meta.log_end or 0, os.urandom(8))
    transaction = StepTransaction(ports.sink_port, topics, tag)
    return ExactlyOnceSinks(transaction, ports.admin, ports.reader, ports.sink_wait_s)


def _report_currency(stats: TaskStats, currency_s: float, restored: RestoreResult | None) -> None:
    """The currency check's seconds, and what a restore or catch-up did and cost."""
    stats.currency_s = currency_s
    if restored is None:
        return
    stats.currency_s = max(0.0, currency_s - restored.seconds)
    stats.restore_s, stats.restored_keys = restored.seconds, restored.keys
    if restored.caught_up:
        stats.catch_ups = 1
    else:
        stats.restores = 1
