"""Write every commit to the state topic, with periodic full snapshots.

The state of queue ``q`` logs to queue ``q`` of the state topic. Each commit is
a ``delta`` record; every ``snapshot_every`` commits a full snapshot follows
(``snap-begin``, ``snap-chunk``..., ``snap-end``), and its begin offset becomes
the store's ``snapshot_offset``. A restore reads only from the latest complete
snapshot onward, so the broker's retention may drop anything older. Message
format: :mod:`stream_assets.state.records`.

Appends are compare-and-append: every record names the offset it must land at
(the store's ``log_end``), and a record that lands elsewhere raises
:class:`~stream_assets.state.errors.ChangelogConflictError` before anything is
committed locally. RocketMQ has no conditional append, so this is how two
writers that both think they own a queue (a stale executor, an old generation)
can never both extend its history: the second one's record is void.

Example::

    >>> writer = ChangelogWriter(producer, "wordcount-state", queue_id=2)  # doctest: +SKIP
    >>> with QueueStateStore(root, "wordcount", "count", 2) as store:  # doctest: +SKIP
    ...     meta = store.next_meta()
    ...     meta.input_offset = 128
    ...     commit_with_changelog(store, {b"apple": b"3"}, meta, writer)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from stream_assets.rocketmq.records import SendReceipt
from stream_assets.serde.packing import StreamPacker
from stream_assets.state.errors import ChangelogConflictError, StateError, StateSequenceError
from stream_assets.state.meta import StateMeta
from stream_assets.state.records import (
    MAX_BODY,
    encode_delta,
    encode_snap_begin,
    encode_snap_chunk,
    encode_snap_end,
)
from stream_assets.state.store import QueueStateStore

DEFAULT_SNAPSHOT_EVERY = 100
DEFAULT_CHUNK_BYTES = 1024 * 1024


class MessageSender(Protocol):
    """What the writer needs of a sender (:class:`~stream_assets.runtime.core.ports.Sender`).

    ``send`` queues; ``flush`` stores everything queued and returns the
    receipts in send order.
    """

    def send(
        self, topic: str, body: bytes, *, key: str | None = ..., queue_id: int | None = ...
    ) -> None: ...

    def flush(self) -> list[SendReceipt]: ...


#: A snapshot is flushed every this many bytes, so it never sits whole in memory.
_SNAPSHOT_FLUSH_BYTES = 16 * 1024 * 1024


class ChangelogWriter:
    """Sends one queue's deltas and snapshots to its queue of the state topic.

    ``snapshot_every``: a full snapshot after every that many commits.
    ``max_body``: largest message body (bigger deltas are split into parts).
    ``chunk_bytes``: size of a snapshot chunk's data slice (at most ``max_body``
    minus a small envelope).
    """

    def __init__(
        self,
        sender: MessageSender,
        state_topic: str,
        queue_id: int,
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        max_body: int = MAX_BODY,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if snapshot_every <= 0:
            raise ValueError(f"snapshot_every must be positive, got {snapshot_every}")
        if not 0 < chunk_bytes <= max_body - 1024:
            raise ValueError(f"chunk_bytes must be in 1..{max_body - 1024}, got {chunk_bytes}")
        self.sender = sender
        self.state_topic = state_topic
        self.queue_id = queue_id
        self.snapshot_every = snapshot_every
        self.max_body = max_body
        self.chunk_bytes = chunk_bytes

    def _append(self, bodies: list[bytes], key: str, at: int) -> int:
        """Store ``bodies``, which must land at offsets ``at``, ``at + 1``, ...; the end.

        One flush: the records go out batched and pipelined, and the receipts
        prove where each one landed. Whatever the caller queued before (outputs)
        is flushed first, on its own: it must be durable before any state record
        says the batch happened, and the receipts below are then these alone.
        """
        self.sender.flush()
        for body in bodies:
            self.sender.send(self.state_topic, body, key=key, queue_id=self.queue_id)
        receipts = self.sender.flush()
        for expected, receipt in enumerate(receipts, start=at):
            if receipt.queue_id != self.queue_id:
                raise StateError(
                    f"state record for queue {self.queue_id} landed in {self.state_topic}"
                    f"[{receipt.queue_id}]; the state topic must have as many queues as the "
                    "stateful stage"
                )
            if receipt.queue_offset != expected:
                raise ChangelogConflictError(
                    f"{self.state_topic}[{self.queue_id}]: a state record meant for offset "
                    f"{expected} landed at {receipt.queue_offset}: another writer appended "
                    "first (or a send was retried). The record is void and nothing was "
                    "committed; the batch fails and its retry restores from the state topic"
                )
        return at + len(bodies)

    def write_delta(
        self,
        changes: Mapping[bytes, bytes | None],
        meta: StateMeta,
        at: int,
        write_id: bytes | None = None,
    ) -> int:
        """Send the delta of commit ``meta.seq`` starting at offset ``at``; returns the end.

        ``write_id``: the caller's, when it named the write before (an exactly-once
        sink's messages name their step by it); default a fresh one.
        """
        # A fresh id per attempt keeps parts of a crashed attempt apart from a retry's.
        write_id = write_id or os.urandom(8)
        bodies = encode_delta(
            meta.seq, write_id, meta.snapshot_offset, changes, meta, self.max_body, at=at
        )
        return self._append(list(bodies), f"q{self.queue_id}-s{meta.seq}", at)

    def snapshot_due(self, seq: int) -> bool:
        """Whether commit ``seq`` is followed by a full snapshot."""
        return seq % self.snapshot_every == 0

    def write_snapshot(self, store: QueueStateStore, at: int) -> tuple[int, int]:
        """Send a full snapshot of ``store`` from offset ``at``; returns (begin, end) offsets.

        The caller records the offset in the store's meta (see
        :func:`commit_with_changelog`); until then later deltas keep pointing
        at the previous snapshot, which stays a correct place to restore from.
        """
        meta = store.meta
        write_id = os.urandom(8)
        prev = meta.snapshot_offset
        key = f"q{self.queue_id}-s{meta.seq}-snap"
        begin = at
        pending = [encode_snap_begin(meta.seq, write_id, prev, meta, at=at)]
        pending_bytes = 0
        packer = StreamPacker()
        buffer = bytearray()
        chunks = keys = 0

        def cut(limit: int) -> None:
            nonlocal chunks, pending, pending_bytes, at
            while len(buffer) >= limit and buffer:
                data = bytes(buffer[: self.chunk_bytes])
                del buffer[: self.chunk_bytes]
                position = at + len(pending)
                pending.append(
                    encode_snap_chunk(meta.seq, write_id, prev, chunks, begin, data, at=position)
                )
                pending_bytes += len(data)
                chunks += 1
            if pending_bytes >= _SNAPSHOT_FLUSH_BYTES:
                at = self._append(pending, key, at)
                pending, pending_bytes = [], 0

        for k, v in store.items():
            buffer += packer.pack(k)
            buffer += packer.pack(v)
            keys += 1
            cut(self.chunk_bytes)
        cut(1)
        pending.append(
            encode_snap_end(meta.seq, write_id, begin, chunks, keys, at=at + len(pending))
        )
        at = self._append(pending, key, at)
        return begin, at


def commit_with_changelog(
    store: QueueStateStore,
    changes: Mapping[bytes, bytes | None],
    meta: StateMeta,
    writer: ChangelogWriter,
    write_id: bytes | None = None,
) -> StateMeta:
    """Commit ``changes`` + ``meta`` durably: changelog first, then the local WriteBatch.

    ``meta.seq`` must be the store's seq + 1 (build it with
    :meth:`QueueStateStore.next_meta`). ``meta.snapshot_offset`` belongs to the
    changelog: the store's value is used whatever the caller passed. Returns
    the meta now committed (its ``snapshot_offset`` moves when a snapshot was
    written).

    Example::

        >>> meta = store.next_meta()  # doctest: +SKIP
        >>> meta.origins[0] = (1041, 0)  # doctest: +SKIP
        >>> changes = {b"k": b"v", b"gone": None}  # doctest: +SKIP
        >>> meta = commit_with_changelog(store, changes, meta, writer)  # doctest: +SKIP
    """
    current = store.committed
    if meta.seq != current.seq + 1:
        # Checked before anything is sent: a bad seq must never reach the topic.
        raise StateSequenceError(
            f"commit with seq {meta.seq} to a store at seq {current.seq}; "
            "build the meta with store.next_meta()"
        )
    if writer.queue_id != store.queue_id:
        raise ValueError(
            f"changelog writer of queue {writer.queue_id} used for the store of queue "
            f"{store.queue_id}"
        )
    # The store's log end is where this commit must land (0: a fresh store,
    # which is current only against an empty state queue).
    at = current.log_end or 0
    meta = replace(meta, snapshot_offset=current.snapshot_offset)
    # Changelog first, local second. A crash (or a failed send) in between
    # leaves the local store *behind* the changelog, never ahead of what is
    # durable: the engine either restores (local_is_current() says False) or
    # replays the same deterministic batch as this seq again; a restore keeps
    # the last complete write of a seq, which is the one the store committed.
    # The other order could leave local state that no restore can reproduce.
    # A ChangelogConflictError from the writer leaves the store untouched.
    end = writer.write_delta(changes, meta, at, write_id)
    store.commit(changes, replace(meta, log_end=end))
    if writer.snapshot_due(meta.seq):
        begin, end = writer.write_snapshot(store, end)
        # A meta-only update, not a new seq: a crash before it only means the
        # next deltas still point at the previous (complete) snapshot, and the
        # store's log end is behind, so the next batch restores first.
        store.update_meta(replace(store.meta, snapshot_offset=begin, log_end=end))
    return store.meta
