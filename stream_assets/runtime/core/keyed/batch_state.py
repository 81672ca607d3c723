"""One batch's view of a queue's state: reads through to RocksDB, buffers the changes.

Nothing reaches the store until the batch commits (values, meta and the
changelog record in one WriteBatch, :func:`~stream_assets.state.changelog.
commit_with_changelog`), so a batch that fails leaves the state as it was.

>>> from stream_assets.state.store import QueueStateStore
>>> with QueueStateStore(tmp_path, "job", "op", 0) as store:  # doctest: +SKIP
...     state = BatchState(store)
...     state.put(b"k1", 3)
...     [k for k, _ in state.items(b"k")]
[b'k1']
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from stream_assets.serde.packing import pack, unpack
from stream_assets.state.store import QueueStateStore


@dataclass
class BatchState:
    """Reads through to RocksDB, buffers this batch's changes (None: deleted)."""

    store: QueueStateStore
    changes: dict[bytes, bytes | None] = field(default_factory=dict)
    cache: dict[bytes, Any] = field(default_factory=dict)
    #: key -> (cached, change) before the open savepoint touched it; None: no savepoint.
    _undo: dict[bytes, tuple[Any, Any]] | None = None
    #: key -> whether RocksDB held it before this batch (for the keys looked up).
    _stored: dict[bytes, bool] = field(default_factory=dict)

    def get(self, key: bytes) -> Any:
        """The value of ``key`` as this batch left it, or None."""
        if key in self.cache:
            return self.cache[key]
        raw = self.store.get(key)
        value = None if raw is None else unpack(raw)
        self.cache[key] = value
        self._stored[key] = raw is not None
        return value

    def put(self, key: bytes, value: Any) -> None:
        """Set ``key`` (None deletes it) for this batch's commit."""
        # Packed first: a value the codec cannot hold fails before anything changes.
        packed = None if value is None else pack(value)
        if self._undo is not None and key not in self._undo:
            self._undo[key] = (self.cache.get(key, _MISSING), self.changes.get(key, _MISSING))
        self.cache[key] = value
        if packed is None and not self._was_stored(key):
            # Deleting what RocksDB never held (a key made and expired in one batch,
            # an index entry moved twice): no tombstone, nothing in the changelog.
            # Tombstones would count against RocksDB's key estimate and slow scans.
            self.changes.pop(key, None)
        else:
            self.changes[key] = packed

    def _was_stored(self, key: bytes) -> bool:
        stored = self._stored.get(key)
        if stored is None:
            stored = self._stored[key] = self.store.get(key) is not None
        return stored

    def items(self, prefix: bytes, below: bytes | None = None) -> Iterator[tuple[bytes, Any]]:
        """Keys starting with ``prefix`` (and under ``below``) in byte order, as this
        batch left them: the store's, overlaid with this batch's puts and deletes."""
        mine = sorted(
            k for k in self.cache if k.startswith(prefix) and (below is None or k < below)
        )
        stored = (k for k, _ in _until(self.store.items(prefix), below) if k not in self.cache)
        for key in heapq.merge(mine, stored):
            value = self.get(key)
            if value is not None:
                yield key, value

    def savepoint(self) -> None:
        """Start recording changes, so that :meth:`rollback` can undo them (user code
        that fails halfway through a record leaves no half of its changes)."""
        self._undo = {}

    def release(self) -> None:
        """Keep the changes since the savepoint."""
        self._undo = None

    def rollback(self) -> None:
        """Undo every change since the savepoint."""
        for key, (cached, change) in (self._undo or {}).items():
            for where, before in ((self.cache, cached), (self.changes, change)):
                if before is _MISSING:
                    where.pop(key, None)
                else:
                    where[key] = before
        self._undo = None

    def delete_prefix(self, prefix: bytes) -> None:
        """Delete every key that starts with ``prefix``."""
        for key, _ in list(self.items(prefix)):
            self.put(key, None)


_MISSING = object()


def _until(
    items: Iterator[tuple[bytes, bytes]], below: bytes | None
) -> Iterator[tuple[bytes, bytes]]:
    """Stop at the first key at or past ``below`` (the store's keys come in order)."""
    for item in items:
        if below is not None and item[0] >= below:
            return
        yield item
