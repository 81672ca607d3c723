"""One RocksDB per (job, operator, queue): keyed state plus its meta, committed atomically.

User keys live under ``b"u:"`` and the meta under ``b"m:"``, so no user key
can collide with the bookkeeping and iteration over user state never sees it.
A commit is one WriteBatch holding every value change *and* the new meta
(sequence number, applied offsets, watermark): after a crash the store is
either before or after the whole batch, so replaying the batch is idempotent.

RocksDB locks a database to one process. A Spark Python worker keeps the
stores of its queues open between batches (:mod:`stream_assets.runtime.drive.store_handles`);
when another process needs one (another Python worker of the same executor,
a restore, a state query), :meth:`QueueStateStore.open` asks the holder to let
go by leaving a release request beside the database, and waits for the lock.
:meth:`key_count` scans; per-batch statistics use :meth:`estimated_key_count`
and :meth:`size_bytes` (RocksDB's own figures, no scan).

Example::

    >>> with QueueStateStore(tmp, "job", "count", 2) as store:  # doctest: +SKIP
    ...     meta = store.next_meta()
    ...     meta.origins[0] = (41, 0)
    ...     store.commit({b"apple": b"3", b"pear": None}, meta)
    ...     store.get(b"apple"), store.meta.seq
    (b'3', 1)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import cast

from rocksdict import Options, Rdict, ReadOptions, WriteBatch, WriteOptions

from stream_assets.state.errors import StateError, StateLockedError, StateSequenceError
from stream_assets.state.meta import StateMeta
from stream_assets.state.paths import StoreLocation

_USER = b"u:"
_META_KEY = b"m:meta"
#: How long an open waits for another process to release the database.
DEFAULT_LOCK_WAIT_S = 60.0


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _upper_bound(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    # Every caller's prefix starts with _USER, so stripping never empties it.
    return stripped[:-1] + bytes([stripped[-1] + 1])


class QueueStateStore:
    """The RocksDB state of one operator on one queue, at ``root/job_id/operator_id/queue-<id>``
    (:class:`~stream_assets.state.paths.StoreLocation`).

    Use it as a context manager (or :meth:`open` / :meth:`close`). Not
    thread-safe: one task owns a store at a time.

    ``sync=True`` fsyncs the WAL on every commit (survives power loss, not just
    a killed process); the default relies on the state topic for that case.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        job_id: str,
        operator_id: str,
        queue_id: int,
        sync: bool = False,
    ) -> None:
        #: Where the database lives (raises ValueError for ids that are no directory names).
        self.location = StoreLocation(Path(root), job_id, operator_id, queue_id)
        self.job_id = job_id
        self.operator_id = operator_id
        self.queue_id = queue_id
        self.path = self.location.path
        self._sync = sync
        self._db: Rdict | None = None
        self._lock_inode: tuple[int, int] | None = None
        self._meta = StateMeta()

    # -- lifecycle ---------------------------------------------------------

    @classmethod
    def at(cls, location: StoreLocation, sync: bool = False) -> QueueStateStore:
        """The (unopened) store at ``location``.

        >>> QueueStateStore.at(StoreLocation(Path("/state"), "wc", "count", 2)).queue_id
        2
        """
        return cls(location.root, location.job_id, location.operator_id, location.queue_id, sync)

    @property
    def release_request(self) -> Path:
        """The file another process leaves to ask this store's holder to close it.

        Beside the database directory, not in it: a wipe must not remove it.
        """
        return self.location.release_request

    def open(self, wait_s: float = DEFAULT_LOCK_WAIT_S) -> QueueStateStore:
        """Open (creating if missing) the database and load its meta.

        If another process holds the database, leave a release request and
        retry until ``wait_s``; then raise :class:`StateLockedError`.
        ``wait_s=0`` raises at once and asks nothing of the holder (for a
        look that must not disturb a running instance).
        """
        if self._db is not None:
            return self
        self.path.mkdir(parents=True, exist_ok=True)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        # Thousands of small per-queue stores would otherwise keep 1000 info logs each.
        options.set_keep_log_file_num(2)
        deadline = time.monotonic() + wait_s
        pause = 0.005
        while True:
            try:
                self._db = Rdict(str(self.path), options=options)
                break
            except Exception as exc:  # rocksdict raises a bare Exception
                if "lock" not in str(exc).lower():
                    raise
                if wait_s <= 0:
                    raise StateLockedError(
                        f"state store {self.path} is open in another process"
                    ) from exc
                if time.monotonic() >= deadline:
                    self.release_request.unlink(missing_ok=True)  # nobody waits any more
                    raise StateLockedError(
                        f"state store {self.path} is held by another process and was not "
                        f"released within {wait_s:.0f}s; stop whatever still runs this queue "
                        "(another instance or a stuck Spark worker) and retry"
                    ) from exc
                self.release_request.touch()
                time.sleep(pause)  # polling a file lock: there is no event to await
                pause = min(pause * 2, 0.1)
        self.release_request.unlink(missing_ok=True)
        self._lock_inode = _inode(self.path / "LOCK")
        raw = self._db.get(_META_KEY)
        self._meta = StateMeta() if raw is None else StateMeta.decode(raw)
        return self

    def close(self) -> None:
        """Flush and release the database (and its process lock); safe to call twice."""
        db, self._db = self._db, None
        if db is not None:
            db.close()

    @property
    def is_open(self) -> bool:
        """Whether the database is open."""
        return self._db is not None

    def still_on_disk(self) -> bool:
        """Whether the open database's directory is still the one it opened.

        False once the directory was deleted (or deleted and created anew) under
        the open handle, e.g. state wiped while a worker kept the store open. The
        handle holds the LOCK file open, so its inode cannot be reused meanwhile.
        """
        return self._db is not None and _inode(self.path / "LOCK") == self._lock_inode

    def __enter__(self) -> QueueStateStore:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _opened(self) -> Rdict:
        if self._db is None:
            raise StateError(f"state store {self.path} is not open; use it as a context manager")
        return self._db

    # -- reads -------------------------------------------------------------

    @property
    def meta(self) -> StateMeta:
        """A copy of the committed meta (modify it and pass it to :meth:`commit`)."""
        self._opened()
        return self._meta.copy()

    @property
    def committed(self) -> StateMeta:
        """The committed meta itself, to read only: :attr:`meta` without its copy, which
        a keyed step's half-dozen reads paid for (3 % of a WordCount step).

        >>> store.committed.generation  # doctest: +SKIP
        4
        """
        self._opened()
        return self._meta

    def next_meta(self) -> StateMeta:
        """A copy of the committed meta with ``seq`` advanced: what the next commit takes."""
        meta = self.meta
        meta.seq += 1
        return meta

    def get(self, key: bytes) -> bytes | None:
        """The value of ``key``, or None."""
        value = self._opened().get(_USER + key)
        return None if value is None else bytes(value)

    def items(self, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """User ``(key, value)`` pairs whose key starts with ``prefix``, in key order."""
        db = self._opened()
        lower = _USER + prefix
        read_opt = ReadOptions()
        read_opt.set_iterate_upper_bound(_upper_bound(lower))
        cut = len(_USER)
        for key, value in db.items(from_key=lower, read_opt=read_opt):
            # Raw mode: keys and values are always bytes.
            yield cast(bytes, key)[cut:], cast(bytes, value)

    def key_count(self) -> int:
        """Exact number of user keys (a full scan of the keys)."""
        return sum(1 for _ in self.items())

    def estimated_key_count(self) -> int:
        """RocksDB's estimate of the number of keys (O(1); exact only after compaction)."""
        value = self._opened().property_int_value("rocksdb.estimate-num-keys")
        return max(0, int(value or 0) - 1)  # less the meta key

    def is_empty(self) -> bool:
        """True for a fresh store: no commit yet and no user key."""
        return self._meta.seq == 0 and next(self.items(), None) is None

    def size_bytes(self) -> int:
        """Approximate size: RocksDB's live SST files plus memtables when open (no
        directory walk per batch), else every file in the database directory."""
        if self._db is not None:
            return sum(
                int(self._db.property_int_value(name) or 0)
                for name in ("rocksdb.total-sst-files-size", "rocksdb.cur-size-all-mem-tables")
            )
        total = 0
        for dirpath, _dirs, files in os.walk(self.path):
            for name in files:
                # A compaction may remove a file between listing and stat.
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(dirpath, name))
        return total

    # -- writes ------------------------------------------------------------

    def commit(self, changes: Mapping[bytes, bytes | None], meta: StateMeta) -> None:
        """Apply ``changes`` (None deletes) and store ``meta``, all in one WriteBatch.

        ``meta.seq`` must be the committed seq + 1 (see :meth:`next_meta`);
        anything else means stale meta or a second writer, and nothing is written.
        """
        if meta.seq != self._meta.seq + 1:
            raise StateSequenceError(
                f"commit to {self.path} with seq {meta.seq}, but the store is at seq "
                f"{self._meta.seq}; build the meta with next_meta()"
            )
        self._write(changes, meta)

    def update_meta(self, meta: StateMeta) -> None:
        """Replace the meta without a new commit (same ``seq``; e.g. a new snapshot offset)."""
        if meta.seq != self._meta.seq:
            raise StateSequenceError(
                f"meta update of {self.path} with seq {meta.seq}, but the store is at seq "
                f"{self._meta.seq}"
            )
        self._write({}, meta)

    def load(self, changes: Mapping[bytes, bytes | None], meta: StateMeta | None = None) -> None:
        """Write ``changes`` and, if given, exactly ``meta``, in one batch, unchecked.

        For restore, which replays sequence numbers chosen elsewhere and loads
        snapshot chunks before their meta is known. Engine code uses :meth:`commit`.
        """
        self._write(changes, meta)

    def _write(self, changes: Mapping[bytes, bytes | None], meta: StateMeta | None) -> None:
        db = self._opened()
        batch = WriteBatch(raw_mode=True)
        for key, value in changes.items():
            if value is None:
                batch.delete(_USER + key)
            else:
                batch.put(_USER + key, value)
        if meta is not None:
            batch.put(_META_KEY, meta.encode())
        write_opt = WriteOptions()
        write_opt.sync = self._sync
        db.write(batch, write_opt=write_opt)
        if meta is not None:
            self._meta = meta.copy()

    def wipe(self) -> None:
        """Delete the database directory; a store that was open is reopened empty."""
        was_open = self.is_open
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
        self._meta = StateMeta()
        if was_open:
            self.open()
