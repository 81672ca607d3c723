"""Make a state queue say "empty from here": an empty snapshot appended after its history.

A reset (:mod:`stream_assets.control.reset`) recomputes a topology from an
earlier input position, so every stateful queue must start again from nothing.
Its stores live on whatever executors ran it, possibly on other machines, so
deleting directories cannot reach them all. The state topic can: every batch
proves its store current against the state queue first
(:func:`~stream_assets.state.restore.ensure_current`), so once the queue ends
in an empty snapshot every store is behind and is rebuilt from that snapshot,
i.e. to empty. The snapshot is an ordinary one (``snap-begin`` + ``snap-end``,
no chunks, written by :class:`~stream_assets.state.changelog.ChangelogWriter`),
so a restore needs no new case; its seq is one past every seq ever written,
which is how a store's catch-up recognises it is not part of its own history
(see ``_Replay.deltas`` in :mod:`~stream_assets.state.restore`).

Example::

    >>> queue = state_queue(admin, "wordcount__state__aggregate", 2)  # doctest: +SKIP
    >>> head = inspect_state_queue(admin, reader, queue)  # doctest: +SKIP
    >>> head.end, head.seq, head.empty  # doctest: +SKIP
    (57, 40, False)
    >>> append_empty_snapshot(queue, head, sender, writer="reset:2025-11-21").seq  # doctest: +SKIP
    41
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.state.changelog import ChangelogWriter, MessageSender
from stream_assets.state.errors import StateRestoreError
from stream_assets.state.meta import StateMeta
from stream_assets.state.ports import OffsetQueries, RangeReader
from stream_assets.state.records import (
    ChangelogRecord,
    Delta,
    SnapBegin,
    SnapChunk,
    SnapEnd,
    decode_record,
    is_void,
    join_delta_parts,
)
from stream_assets.state.restore import last_record
from stream_assets.state.store import QueueStateStore


@dataclass(frozen=True)
class StateQueueHead:
    """Where a state queue's valid history ends, and who wrote it last.

    ``end``: the queue's end offset (where the next record must land).
    ``seq``: the highest seq wholly written (0: nothing). ``snapshot``: begin
    offset of the latest complete snapshot. ``generation``/``writer``: the
    owner recorded in the latest meta. ``empty``: no valid record at all, so
    every restore already gives an empty store.
    """

    queue: MessageQueue
    end: int
    seq: int
    snapshot: int | None
    generation: int
    writer: str
    empty: bool


@dataclass(frozen=True)
class EmptySnapshot:
    """The empty snapshot a reset appended: offsets ``begin`` .. ``end``, at ``seq``."""

    queue: MessageQueue
    begin: int
    end: int
    seq: int
    generation: int


def inspect_state_queue(
    admin: OffsetQueries, reader: RangeReader, queue: MessageQueue
) -> StateQueueHead:
    """Read the end of ``queue``'s history: a few messages from its end, never all of it.

    Example::

        >>> inspect_state_queue(admin, reader, queue).seq  # doctest: +SKIP
        40
    """
    last, low, high = last_record(admin, reader, queue)
    if last is None:
        return StateQueueHead(queue, high, 0, None, 0, "", empty=True)
    meta = _latest_meta(reader, queue, low, high)
    seq = max(last.written_seq, meta.seq if meta is not None else 0)
    return StateQueueHead(
        queue,
        end=high,
        seq=seq,
        snapshot=last.snap,
        generation=meta.generation if meta is not None else 0,
        writer=meta.writer if meta is not None else "",
        empty=False,
    )


def append_empty_snapshot(
    queue: MessageQueue,
    head: StateQueueHead,
    sender: MessageSender,
    writer: str,
    index: int,
) -> EmptySnapshot:
    """Append an empty snapshot to ``queue`` (index ``index`` of its topic's layout, which
    ``sender`` sends by) right after ``head.end``.

    Compare-and-append like every state write: if anything was appended since
    ``head`` was read, :class:`~stream_assets.state.errors.ChangelogConflictError`
    is raised and the records are void (a restore ignores them), so a running
    writer can never be silently overruled; inspect again and retry once it
    has stopped.

    Example::

        >>> done = append_empty_snapshot(queue, head, sender, "reset:cli", 2)  # doctest: +SKIP
        >>> (done.begin, done.end) == (head.end, head.end + 2)  # doctest: +SKIP
        True
    """
    # seq: one past everything written, so a store that tries to catch up over
    # this snapshot finds a seq its history never reached and restores in full
    # (from this snapshot: empty) instead of applying only the deltas it lacks.
    # generation: kept, not bumped. A reset does not change who may write (the
    # allocation does): a bumped generation would fence the very instances the
    # current allocation starts next, and 0 would un-fence a leftover writer of
    # an older allocation. writer: names the reset, so the next owner claims
    # the queue with a commit of its own (runtime/core/keyed/batch.py).
    # snapshot_offset: the previous complete snapshot; it becomes the begin
    # record's "snap", where a restore falls back if this snapshot is cut short
    # (the reset then simply did not happen for this queue).
    meta = StateMeta(
        seq=head.seq + 1,
        snapshot_offset=head.snapshot,
        generation=head.generation,
        writer=writer,
    )
    with (
        tempfile.TemporaryDirectory(prefix="stream-assets-reset-") as tmp,
        QueueStateStore(tmp, "reset", "empty", index) as empty,
    ):
        empty.load({}, meta)
        begin, end = ChangelogWriter(sender, queue.topic, index).write_snapshot(empty, head.end)
    return EmptySnapshot(queue, begin, end, meta.seq, meta.generation)


def _latest_meta(reader: RangeReader, queue: MessageQueue, low: int, high: int) -> StateMeta | None:
    """The meta of the latest complete write, walking back from the queue's end.

    A snapshot's meta is in its begin record (its chunks and end point there);
    a delta carries it inline or across its parts, which are stored one after
    another. Usually one to three messages are read.
    """
    parts: dict[bytes, dict[int, Delta]] = {}
    offset = high - 1
    while offset >= low:
        record = _record_at(reader, queue, offset)
        if record is None:
            offset -= 1
            continue
        if isinstance(record, SnapBegin):
            return record.meta
        if isinstance(record, SnapChunk | SnapEnd):
            # Straight to its begin record; anything else there is read as found.
            offset = record.begin if low <= record.begin < offset else offset - 1
            continue
        if record.meta is not None:
            return record.meta
        same = parts.setdefault(record.write_id, {})
        same[record.part] = record
        if len(same) == record.parts:
            return join_delta_parts(list(same.values()))[1]
        offset -= 1
    return None


def _record_at(reader: RangeReader, queue: MessageQueue, offset: int) -> ChangelogRecord | None:
    """The valid record at ``offset``, or None when it is void."""
    batch = reader.pull(queue, offset, 1)
    if not batch.records:
        raise StateRestoreError(
            f"cannot read message {offset} of {queue.topic}[{queue.queue_id}]: {batch.status.value}"
        )
    record = decode_record(batch.records[0].body)
    return None if is_void(record, batch.records[0].queue_offset) else record
