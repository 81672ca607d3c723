"""Stores kept open between batches by the Python worker that runs their queue.

Spark reuses its Python workers, so a worker that ran queue 3 last batch will
most likely run it again: reopening its RocksDB every micro-batch was pure
cost. A worker keeps each store open after its batch, for as long as nobody
else needs it. Spark may still hand the queue to another Python worker of the
same executor (or a restore, a state query may open it): that process's
:meth:`QueueStateStore.open` leaves a release request beside the database, and
the watcher thread here closes the store if it is idle (and once the running
batch ends if it is busy). The other process's open then succeeds.

A store that held a failed batch is closed rather than kept: the next batch
starts from what is on disk. So is one whose directory was deleted under it
(state wiped while the worker idled).

Example::

    >>> with HANDLES.use(root, "wordcount", "count", 3) as store:  # doctest: +SKIP
    ...     store.meta.seq
    12
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stream_assets.state.paths import job_stores
from stream_assets.state.store import QueueStateStore

#: How often the watcher looks for release requests.
_WATCH_S = 0.02
#: A release request older than this has nobody waiting on it any more.
_STALE_REQUEST_S = 5.0


@dataclass
class _Handle:
    store: QueueStateStore
    busy: bool = False


class StoreHandles:
    """This process's open stores, by path; thread-safe."""

    def __init__(self, watch_s: float = _WATCH_S) -> None:
        self.watch_s = watch_s
        self._handles: dict[Path, _Handle] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._watcher: threading.Thread | None = None

    @contextlib.contextmanager
    def use(
        self, root: str | os.PathLike[str], job_id: str, operator_id: str, queue_id: int
    ) -> Iterator[QueueStateStore]:
        """The open store of one queue, exclusively for the ``with`` block."""
        self._after_fork()
        store = QueueStateStore(root, job_id, operator_id, queue_id)
        with self._lock:
            handle = self._handles.get(store.path)
            if handle is None:
                handle = self._handles[store.path] = _Handle(store)
            if handle.busy:
                raise RuntimeError(f"state store {store.path} is already in use in this process")
            handle.busy = True
        ok = False
        try:
            if handle.store.is_open and not handle.store.still_on_disk():
                # Its directory was deleted under it by hand (the engine wipes
                # through the store, and a stopping instance releases its stores
                # first: see release_job_stores). Closing flushes into files that
                # are gone, which fails; nothing there is wanted.
                with contextlib.suppress(Exception):
                    handle.store.close()
            handle.store.open()
            self._ensure_watcher()
            yield handle.store
            ok = True
        finally:
            with self._lock:
                handle.busy = False
                if not ok or _requested(handle.store):
                    handle.store.close()
                    del self._handles[handle.store.path]

    def close_all(self) -> None:
        """Close every idle store (busy ones close when their batch ends)."""
        with self._lock:
            for path, handle in list(self._handles.items()):
                if not handle.busy:
                    handle.store.close()
                    del self._handles[path]

    def open_count(self) -> int:
        """Stores open in this process."""
        with self._lock:
            return sum(h.store.is_open for h in self._handles.values())

    def _ensure_watcher(self) -> None:
        with self._lock:
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(
                    target=self._watch, name="store-handover", daemon=True
                )
                self._watcher.start()

    def _watch(self) -> None:
        # Polls: a release request is a file another process writes; the
        # pure-Python options to be woken by it (inotify) are not portable.
        while True:
            time.sleep(self.watch_s)
            with self._lock:
                for path, handle in list(self._handles.items()):
                    if not handle.busy and _requested(handle.store):
                        handle.store.close()
                        del self._handles[path]

    def _after_fork(self) -> None:
        # Spark forks Python workers from a daemon: a child must not share the
        # parent's handles (RocksDB locks are per process) or its dead thread.
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._handles = {}
            self._watcher = None


def _requested(store: QueueStateStore) -> bool:
    """Whether another process is waiting for ``store`` now.

    A waiting opener touches the request at least every 0.1 s; one untouched
    for longer than ``_STALE_REQUEST_S`` was left by an opener that gave up or
    died, and is removed, or every batch would close and reopen the store.
    """
    try:
        age = time.time() - store.release_request.stat().st_mtime
    except FileNotFoundError:
        return False
    if age > _STALE_REQUEST_S:
        store.release_request.unlink(missing_ok=True)
        return False
    return True


#: The process-wide handles.
HANDLES = StoreHandles()


def release_job_stores(root: str | os.PathLike[str], job_id: str, wait_s: float = 60.0) -> int:
    """Make every Python worker on this machine let go of ``job_id``'s stores under ``root``.

    An instance calls it on stop: afterwards its state directories may be
    moved or deleted (a wipe under an open handle would let the stale handle
    write into a new database at the same path). Returns the stores released.

    Example::

        >>> release_job_stores(engine.state_dir, "wordcount")  # doctest: +SKIP
        8
    """
    stores = job_stores(Path(root), job_id)
    for location in stores:
        # Opening asks the holder to close; closing again leaves it free.
        QueueStateStore.at(location).open(wait_s).close()
    return len(stores)
