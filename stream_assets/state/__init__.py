"""Keyed state: RocksDB per queue, made durable through the state topic.

- :mod:`~stream_assets.state.store`: :class:`QueueStateStore`, values + meta in one WriteBatch.
- :mod:`~stream_assets.state.meta`: :class:`StateMeta`, the committed bookkeeping.
- :mod:`~stream_assets.state.records`: the state topic's message format.
- :mod:`~stream_assets.state.changelog`: :func:`commit_with_changelog`, deltas and snapshots.
- :mod:`~stream_assets.state.restore`: :func:`ensure_current`, :func:`restore_queue`.
- :mod:`~stream_assets.state.ports`: what restores read the broker through (Protocols).
- :mod:`~stream_assets.state.paths`: the directory layout, ``root/job/operator/queue-N``.
- :mod:`~stream_assets.state.layout`: the key layout of every kind of state.

Example::

    >>> with QueueStateStore(root, "wc", "count", 2) as store:  # doctest: +SKIP
    ...     ensure_current(store, "wc-state", 2, admin, reader)  # restores if behind
    ...     meta = store.next_meta()
    ...     commit_with_changelog(store, {b"apple": b"3"}, meta, writer)
"""

from __future__ import annotations

from stream_assets.state.changelog import (
    DEFAULT_SNAPSHOT_EVERY,
    ChangelogWriter,
    MessageSender,
    commit_with_changelog,
)
from stream_assets.state.errors import (
    ChangelogConflictError,
    FencedError,
    StateError,
    StateFormatError,
    StateRestoreError,
    StateSequenceError,
)
from stream_assets.state.meta import StateMeta
from stream_assets.state.restore import (
    RestoreProgress,
    RestoreResult,
    ensure_current,
    is_current,
    local_is_current,
    restore_queue,
    state_queue,
    topic_seq,
)
from stream_assets.state.store import QueueStateStore

__all__ = [
    "DEFAULT_SNAPSHOT_EVERY",
    "ChangelogConflictError",
    "ChangelogWriter",
    "FencedError",
    "MessageSender",
    "QueueStateStore",
    "RestoreProgress",
    "RestoreResult",
    "StateError",
    "StateFormatError",
    "StateMeta",
    "StateRestoreError",
    "StateSequenceError",
    "commit_with_changelog",
    "ensure_current",
    "is_current",
    "local_is_current",
    "restore_queue",
    "state_queue",
    "topic_seq",
]
