"""Rebuild a queue's state from its state-topic queue: latest complete snapshot + tail.

The last message of the queue names (``"snap"``) the begin offset of the
latest complete snapshot; the restore reads from there to the end: the
snapshot's key/value stream, then every later delta in seq order. Nothing
older than that snapshot is read, so broker retention may drop it. Without any
snapshot the deltas are replayed from the queue's first stored offset.

Rules that make the replay exact:

- a record stored at another offset than the one it names (``at``) is void:
  it lost a race with another writer and is skipped
  (:mod:`stream_assets.state.records`);
- a delta is applied (values + meta, one WriteBatch) only when all its parts
  are present; parts group by write id, so a crashed attempt never mixes with
  its retry;
- of several complete writes of one seq the *last* wins: a seq is written
  again only when the previous attempt was not committed locally (see
  :func:`~stream_assets.state.changelog.commit_with_changelog`), so the last
  one is what the store held. Seq ``n`` is applied once seq ``n+1`` shows up
  (or the queue ends); a jump in seq is an error, never silently skipped.

Example::

    >>> store.wipe()  # doctest: +SKIP
    >>> result = restore_queue(store, "wordcount-state", 2, admin, reader)  # doctest: +SKIP
    >>> result.seq == topic_seq(admin, reader, "wordcount-state", 2)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.layout import current_layout, describe_pairs
from stream_assets.serde.packing import PackingError, StreamUnpacker
from stream_assets.state.errors import StateError, StateFormatError, StateRestoreError
from stream_assets.state.meta import StateMeta
from stream_assets.state.ports import OffsetQueries, RangeReader, StateTopicAdmin
from stream_assets.state.records import (
    ChangelogRecord,
    Changes,
    Delta,
    SnapBegin,
    SnapChunk,
    SnapEnd,
    decode_record,
    is_void,
    join_delta_parts,
)
from stream_assets.state.store import QueueStateStore

# Snapshot pairs and replayed deltas are written in batches this large (keys / bytes).
_LOAD_KEYS = 20_000
_LOAD_BYTES = 8 * 1024 * 1024
_PROGRESS_EVERY = 64


@dataclass(frozen=True)
class RestoreProgress:
    """How far a restore is: messages of the state queue read so far and expected."""

    queue_id: int
    messages_read: int
    messages_total: int
    bytes_read: int
    keys_loaded: int


@dataclass(frozen=True)
class RestoreResult:
    """What a restore rebuilt and what it cost."""

    queue_id: int
    keys: int
    seq: int
    messages_read: int
    bytes_read: int
    seconds: float
    start_offset: int
    end_offset: int
    snapshot_offset: int | None
    #: True: only the tail after the store's own log end was applied (no wipe).
    caught_up: bool = False


ProgressCallback = Callable[[RestoreProgress], None]


def state_queue(admin: StateTopicAdmin, state_topic: str, queue_id: int) -> MessageQueue:
    """The queue of index ``queue_id`` of ``state_topic`` (its fixed layout, any number of
    broker groups)."""
    layout = current_layout(admin, state_topic)
    if not 0 <= queue_id < len(layout):
        raise StateRestoreError(
            f"state topic {state_topic!r} has {len(layout)} queues "
            f"({describe_pairs(layout.pairs)}); no queue index {queue_id}: it has as many "
            "queues as the stateful stage's shuffle topic"
        )
    return layout.queue(queue_id)


def last_record(
    admin: OffsetQueries, reader: RangeReader, queue: MessageQueue
) -> tuple[ChangelogRecord | None, int, int]:
    """The last valid record of the queue, with the queue's min and max offsets."""
    low, high = admin.min_offset(queue), admin.max_offset(queue)
    offset = high - 1
    while offset >= low:
        batch = reader.pull(queue, offset, 1)
        if not batch.records:
            raise StateRestoreError(
                f"cannot read message {offset} of {queue.topic}[{queue.queue_id}]: "
                f"{batch.status.value}"
            )
        record = decode_record(batch.records[0].body)
        if not is_void(record, batch.records[0].queue_offset):
            return record, low, high
        offset -= 1  # a fenced writer's record: the valid history ends before it
    return None, low, high


def topic_seq(admin: StateTopicAdmin, reader: RangeReader, state_topic: str, queue_id: int) -> int:
    """Highest seq wholly written to the state queue (0 when it is empty).

    Reads only the queue's last message.
    """
    last, _, _ = last_record(admin, reader, state_queue(admin, state_topic, queue_id))
    return 0 if last is None else last.written_seq


def is_current(meta: StateMeta, log_end: int) -> bool:
    """Whether a store with ``meta`` holds the whole state queue that ends at ``log_end``.

    The store's own log end (where its last write ended, or where its restore
    stopped) must equal the queue's end offset: anything appended since, by
    another executor, instance or a crashed attempt, means restore first.

    >>> is_current(StateMeta(log_end=12), 12), is_current(StateMeta(log_end=12), 14)
    (True, False)
    >>> is_current(StateMeta(), 0)  # a fresh store on an empty queue
    True
    """
    return (meta.log_end or 0) == log_end


def settled_end(
    admin: OffsetQueries, queue: MessageQueue, at_least: int, timeout_s: float = 10.0
) -> int:
    """The queue's end offset, once it shows every record up to ``at_least``.

    The broker acknowledges a send when the record is in its commit log; the
    per-queue index that the end offset comes from follows a moment later
    (measured: most reads right after a send are one behind, for under 1 ms).
    A store whose own writes ended at ``at_least`` (offsets from the broker's
    receipts) must not take that lag for someone else's history, so this
    waits for the index to catch up before the caller compares.
    """
    deadline = time.monotonic() + timeout_s
    end = admin.max_offset(queue)
    while end < at_least and time.monotonic() < deadline:
        time.sleep(0.002)
        end = admin.max_offset(queue)
    return end


def local_is_current(
    store: QueueStateStore, state_topic: str, queue_id: int, admin: StateTopicAdmin
) -> bool:
    """Whether the local store holds every record of its state queue (one offset query).

    False means the local store is behind (another executor or instance
    wrote after it, or it crashed between changelog and local commit): wipe
    and restore.

    Example::

        >>> if not local_is_current(store, "wc-state", 2, admin):  # doctest: +SKIP
        ...     store.wipe()
        ...     restore_queue(store, "wc-state", 2, admin, reader)
    """
    queue = state_queue(admin, state_topic, queue_id)
    return is_current(store.meta, settled_end(admin, queue, store.meta.log_end or 0))


def ensure_current(
    store: QueueStateStore,
    queue: MessageQueue,
    admin: OffsetQueries,
    reader: RangeReader,
    progress: ProgressCallback | None = None,
) -> RestoreResult | None:
    """Prove ``store`` holds its whole state ``queue``; catch up or restore it if not.

    What every stateful batch does first: one offset query when the store is
    current (None is returned). When another executor, instance or a crashed
    attempt wrote since this store's last write, the store catches up by
    applying just those deltas if it can (``caught_up`` in the result), else
    it is wiped and restored from the latest snapshot.

    Example::

        >>> queue = state_queue(admin, "wc-state", 2)  # doctest: +SKIP
        >>> result = ensure_current(store, queue, admin, reader)  # doctest: +SKIP
        >>> "restored" if result else "was current"  # doctest: +SKIP
        'was current'
    """
    mine = store.meta
    end = settled_end(admin, queue, mine.log_end or 0)
    if is_current(mine, end):
        return None
    if mine.seq > 0 and mine.log_end is not None and mine.log_end < end:
        try:
            return _catch_up(store, queue, admin, reader, end, progress)
        except StateError:
            pass  # the tail does not continue this store's history: restore in full
    store.wipe()
    return restore_from(store, queue, admin, reader, progress)


def _catch_up(
    store: QueueStateStore,
    queue: MessageQueue,
    admin: OffsetQueries,
    reader: RangeReader,
    end: int,
    progress: ProgressCallback | None,
) -> RestoreResult:
    """Apply only what was written after the store's own log end (a queue that came back).

    Valid records form one chain, each built on everything before it, so the
    deltas after this store's log end continue exactly its history (seq + 1,
    + 2, ...). Anything else (retention dropped them, a gap, a reset's empty
    snapshot) raises, and the caller restores in full. Snapshots in the tail
    repeat what the deltas hold.
    """
    started = time.perf_counter()
    mine = store.meta
    assert mine.log_end is not None
    if mine.log_end < admin.min_offset(queue):
        raise StateRestoreError(f"{queue.topic}[{queue.queue_id}]: the tail was dropped")
    replay = _Replay(store, reader, queue, end, progress)
    replay.expect(mine.log_end)
    replay.deltas(replay.records(mine.log_end), applied=mine.seq, catching_up=True)
    replay.report()
    store.update_meta(replace(store.meta, log_end=end))
    return RestoreResult(
        queue_id=store.queue_id,
        keys=replay.keys,
        seq=store.meta.seq,
        messages_read=replay.messages,
        bytes_read=replay.bytes,
        seconds=time.perf_counter() - started,
        start_offset=mine.log_end,
        end_offset=end,
        snapshot_offset=store.meta.snapshot_offset,
        caught_up=True,
    )


def restore_queue(
    store: QueueStateStore,
    state_topic: str,
    queue_id: int,
    admin: StateTopicAdmin,
    reader: RangeReader,
    progress: ProgressCallback | None = None,
) -> RestoreResult:
    """Rebuild the empty (wiped) ``store`` from queue ``queue_id`` of ``state_topic``.

    ``progress`` is called every few dozen messages and once at the end.
    Raises :class:`StateRestoreError` when the topic cannot reproduce the
    state (needed history dropped by retention, a gap in the seqs).

    Example::

        >>> with QueueStateStore(root, "wc", "count", 2) as store:  # doctest: +SKIP
        ...     store.wipe()
        ...     result = restore_queue(store, "wc-state", 2, admin, reader, print)
        >>> result.keys, result.seq  # doctest: +SKIP
        (10000, 812)
    """
    return restore_from(store, state_queue(admin, state_topic, queue_id), admin, reader, progress)


def restore_from(
    store: QueueStateStore,
    queue: MessageQueue,
    admin: OffsetQueries,
    reader: RangeReader,
    progress: ProgressCallback | None = None,
) -> RestoreResult:
    """:func:`restore_queue` from the state queue itself (the store's index resolved)."""
    started = time.perf_counter()
    if not store.is_empty():
        raise StateRestoreError(f"restore needs an empty store; wipe() {store.path} first")
    queue_id = store.queue_id
    last, low, high = last_record(admin, reader, queue)
    replay = _Replay(store, reader, queue, high, progress)
    snapshot = None if last is None else last.snap
    while True:
        start = low if snapshot is None else snapshot
        replay.expect(start)
        if start < low:
            raise StateRestoreError(
                f"{queue.topic}[{queue_id}]: restore must start at offset {start} but the broker "
                f"keeps only {low}..{high}; the history a restore needs was dropped"
            )
        if snapshot is None:
            replay.deltas(replay.records(start), applied=0)
            break
        fallback = replay.from_snapshot(snapshot)
        if isinstance(fallback, _Done):
            break
        # The snapshot was incomplete: start over from the complete one before it.
        if fallback is not None and fallback >= snapshot:
            raise StateRestoreError(
                f"{queue.topic}[{queue_id}]: snapshot at {snapshot} is incomplete and points "
                f"back to {fallback}, not to an earlier one"
            )
        store.wipe()
        replay.reset()
        snapshot = fallback
    replay.report()
    # Current as of the end it read to: the next commit must land exactly there.
    store.update_meta(replace(store.meta, log_end=high))
    return RestoreResult(
        queue_id=queue_id,
        keys=store.key_count(),
        seq=store.meta.seq,
        messages_read=replay.messages,
        bytes_read=replay.bytes,
        seconds=time.perf_counter() - started,
        start_offset=start,
        end_offset=high,
        snapshot_offset=replay.snapshot,
    )


class _Done:
    """Marker: the snapshot was complete and the tail applied."""


_DONE = _Done()


class _Replay:
    """One restore's reading position, counters and apply logic."""

    def __init__(
        self,
        store: QueueStateStore,
        reader: RangeReader,
        queue: MessageQueue,
        end: int,
        progress: ProgressCallback | None,
    ) -> None:
        self.store = store
        self.reader = reader
        self.queue = queue
        self.end = end
        self.progress = progress
        self.messages = 0
        self.bytes = 0
        self.total = 0
        self.keys = 0
        self.snapshot: int | None = None
        self._changes: dict[bytes, bytes | None] = {}
        self._change_bytes = 0
        self._meta: StateMeta | None = None

    def expect(self, start: int) -> None:
        """Account for reading ``start`` .. end next."""
        self.total = self.messages + max(0, self.end - start)

    def reset(self) -> None:
        """Forget what was loaded (the store was wiped); counters of work done stay."""
        self.keys = 0
        self.snapshot = None
        self._changes, self._change_bytes, self._meta = {}, 0, None

    def report(self) -> None:
        """Tell the progress callback where we are."""
        if self.progress is not None:
            self.progress(
                RestoreProgress(
                    self.store.queue_id, self.messages, self.total, self.bytes, self.keys
                )
            )

    def records(self, start: int) -> Iterator[tuple[int, ChangelogRecord]]:
        """Decoded records from ``start`` to the end fixed when the restore began."""
        for record in self.reader.read(self.queue, start, self.end):
            self.messages += 1
            self.bytes += len(record.body)
            if self.messages % _PROGRESS_EVERY == 0:
                self.report()
            decoded = decode_record(record.body)
            if not is_void(decoded, record.queue_offset):
                yield record.queue_offset, decoded

    # -- snapshot ----------------------------------------------------------

    def from_snapshot(self, begin: int) -> _Done | int | None:
        """Load the snapshot at ``begin`` and the deltas after it.

        Returns _DONE, or (snapshot incomplete) the offset of the snapshot
        before it, None if there was none.
        """
        records = self.records(begin)
        first = next(records, None)
        if first is None or first[0] != begin or not isinstance(first[1], SnapBegin):
            raise StateRestoreError(
                f"{self.queue.topic}[{self.queue.queue_id}]: offset {begin} is named as a "
                "snapshot begin but holds something else"
            )
        head = first[1]
        unpacker = StreamUnpacker()
        batch: dict[bytes, bytes | None] = {}
        batch_bytes = 0
        key: bytes | None = None
        expected = 0
        for _offset, record in records:
            if isinstance(record, SnapChunk) and record.write_id == head.write_id:
                if record.index < expected:  # a retried send stored twice
                    continue
                if record.index > expected:
                    return head.snap
                expected += 1
                try:
                    objs = list(unpacker.feed(record.data))
                except PackingError as exc:
                    raise StateFormatError(f"snapshot at {begin}: {exc}") from exc
                for obj in objs:
                    if not isinstance(obj, bytes):
                        raise StateFormatError(f"snapshot at {begin} holds a non-bytes {obj!r:.80}")
                    if key is None:
                        key = obj
                        continue
                    batch[key] = obj
                    batch_bytes += len(key) + len(obj)
                    key = None
                    if len(batch) >= _LOAD_KEYS or batch_bytes >= _LOAD_BYTES:
                        self._load(batch)
                        batch, batch_bytes = {}, 0
            elif isinstance(record, SnapBegin) and record.write_id == head.write_id:
                continue  # a retried send stored twice
            elif isinstance(record, SnapEnd) and record.write_id == head.write_id:
                if record.chunks != expected or key is not None:
                    return head.snap
                self._load(batch)
                self.snapshot = begin
                self.store.load({}, replace(head.meta, snapshot_offset=begin))
                self.deltas(records, applied=head.seq)
                return _DONE
            else:
                # Anything else before snap-end: the writer died mid-snapshot.
                return head.snap
        return head.snap

    def _load(self, batch: dict[bytes, bytes | None]) -> None:
        if batch:
            self.store.load(batch)
            self.keys += len(batch)

    # -- deltas ------------------------------------------------------------

    def deltas(
        self,
        records: Iterator[tuple[int, ChangelogRecord]],
        applied: int,
        catching_up: bool = False,
    ) -> None:
        """Apply every delta after seq ``applied``, the last complete write of each seq.

        ``catching_up``: the store kept its own history up to ``applied`` and
        takes only what follows. A snapshot in that tail is normally of a seq
        already reached (it is written after its seq's delta); one of a later
        seq is not of this history: a reset wrote it (state/reset.py). Raises
        then, so the caller restores in full, from that snapshot.
        """
        pending: tuple[int, Changes, StateMeta] | None = None
        partial: dict[bytes, dict[int, Delta]] = {}
        for offset, record in records:
            if catching_up and isinstance(record, SnapBegin):
                reached = pending[0] if pending is not None else applied
                if record.seq > reached:
                    raise StateRestoreError(
                        f"{self.queue.topic}[{self.queue.queue_id}]: snapshot of seq "
                        f"{record.seq} at offset {offset} after seq {reached}: a new history "
                        "starts there (a reset); restore in full"
                    )
            if not isinstance(record, Delta) or record.seq <= applied:
                continue  # snapshots of other attempts, or seqs already applied
            whole = self._whole(record, partial)
            if whole is None:
                continue
            current = pending[0] if pending is not None else applied
            if record.seq == current and pending is not None:
                pending = (record.seq, *whole)  # a later write of the same seq wins
            elif record.seq == current + 1:
                if pending is not None:
                    self._apply(*pending)
                    applied = pending[0]
                    for write_id in [w for w, p in partial.items() if _seq(p) <= applied]:
                        del partial[write_id]
                pending = (record.seq, *whole)
            elif record.seq > current + 1:
                raise StateRestoreError(
                    f"{self.queue.topic}[{self.queue.queue_id}]: seq jumps from {current} to "
                    f"{record.seq}; the changelog is missing commits"
                )
        if pending is not None:
            self._apply(*pending)
        self._flush()

    @staticmethod
    def _whole(
        record: Delta, partial: dict[bytes, dict[int, Delta]]
    ) -> tuple[Changes, StateMeta] | None:
        if record.changes is not None and record.meta is not None:
            return record.changes, record.meta
        parts = partial.setdefault(record.write_id, {})
        parts[record.part] = record
        if len(parts) < record.parts:
            return None
        del partial[record.write_id]
        return join_delta_parts(list(parts.values()))

    def _apply(self, seq: int, changes: Changes, meta: StateMeta) -> None:
        if meta.seq != seq:
            raise StateFormatError(f"delta of seq {seq} carries meta of seq {meta.seq}")
        if self.snapshot is not None and (
            meta.snapshot_offset is None or meta.snapshot_offset < self.snapshot
        ):
            # Written before the store recorded the snapshot we loaded: point at it now.
            meta = replace(meta, snapshot_offset=self.snapshot)
        # Consecutive deltas share one WriteBatch (a restore needs only the end
        # state); each batch still carries the meta of its last delta, so the
        # store is consistent at some seq after every write.
        for key, value in changes:
            self._changes[key] = value
            self._change_bytes += len(key) + (0 if value is None else len(value))
        self._meta = meta
        self.keys += len(changes)
        if len(self._changes) >= _LOAD_KEYS or self._change_bytes >= _LOAD_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._meta is not None:
            self.store.load(self._changes, self._meta)
        self._changes, self._change_bytes, self._meta = {}, 0, None


def _seq(parts: dict[int, Delta]) -> int:
    return next(iter(parts.values())).seq
