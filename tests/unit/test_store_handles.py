"""Stores stay open between batches in one process and are handed over on request."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stream_assets.runtime.drive.store_handles import StoreHandles
from stream_assets.state.errors import StateLockedError
from stream_assets.state.store import QueueStateStore

# A "Python worker": commits once through the handles, then idles with the store
# open, as a Spark worker does between tasks, until its stdin closes.
_WORKER = textwrap.dedent(
    """
    import sys
    from stream_assets.runtime.drive.store_handles import HANDLES
    with HANDLES.use(sys.argv[1], "job", "op", 0) as store:
        meta = store.next_meta()
        store.commit({b"k": b"worker"}, meta)
    print("idle", HANDLES.open_count(), flush=True)
    sys.stdin.read()
    with HANDLES.use(sys.argv[1], "job", "op", 0) as store:
        print("again", store.meta.seq, store.get(b"k").decode(), flush=True)
    """
)


def test_a_store_stays_open_between_uses(tmp_path: Path) -> None:
    handles = StoreHandles()
    with handles.use(tmp_path, "job", "op", 1) as first:
        first.commit({b"a": b"1"}, first.next_meta())
    assert handles.open_count() == 1
    with handles.use(tmp_path, "job", "op", 1) as second:
        assert second is first and second.meta.seq == 1
    handles.close_all()
    assert handles.open_count() == 0


def test_a_failed_batch_closes_its_store(tmp_path: Path) -> None:
    handles = StoreHandles()
    with pytest.raises(RuntimeError), handles.use(tmp_path, "job", "op", 1):
        raise RuntimeError("batch failed")
    assert handles.open_count() == 0


def test_an_idle_holder_hands_the_store_over_and_reopens_with_the_new_state(
    tmp_path: Path,
) -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None and worker.stdin is not None
    try:
        assert worker.stdout.readline().split() == ["idle", "1"]
        # Held: a look that must not disturb the holder fails at once ...
        with pytest.raises(StateLockedError):
            QueueStateStore(tmp_path, "job", "op", 0).open(wait_s=0)
        # ... and an open that waits asks for it and gets it.
        with QueueStateStore(tmp_path, "job", "op", 0).open(wait_s=30) as store:
            assert store.meta.seq == 1 and store.get(b"k") == b"worker"
            store.commit({b"k": b"other"}, store.next_meta())
        assert not store.release_request.exists()
        worker.stdin.close()
        # The worker reopens from disk: it sees the other process's commit.
        assert worker.stdout.readline().split() == ["again", "2", "other"]
    finally:
        worker.kill()
        worker.wait()


def test_a_store_wiped_while_kept_open_is_reopened_from_disk(tmp_path: Path) -> None:
    handles = StoreHandles()
    with handles.use(tmp_path, "job", "op", 1) as store:
        store.commit({b"a": b"1"}, store.next_meta())
    shutil.rmtree(store.path)
    with handles.use(tmp_path, "job", "op", 1) as again:
        assert again.meta.seq == 0 and again.get(b"a") is None
        again.commit({b"b": b"2"}, again.next_meta())
    handles.close_all()
    with QueueStateStore(tmp_path, "job", "op", 1) as reopened:
        assert dict(reopened.items()) == {b"b": b"2"}


def test_a_stale_release_request_is_removed_and_the_store_stays_open(tmp_path: Path) -> None:
    handles = StoreHandles(watch_s=3600)  # only the end of a batch looks at requests here
    with handles.use(tmp_path, "job", "op", 1) as store:
        pass
    # Left by an opener that died long ago: nobody waits on it.
    store.release_request.touch()
    old = time.time() - 60
    os.utime(store.release_request, (old, old))
    with handles.use(tmp_path, "job", "op", 1) as again:
        assert again is store
    assert handles.open_count() == 1 and not store.release_request.exists()
    # A fresh request is honoured: the store is handed back after its batch.
    store.release_request.touch()
    with handles.use(tmp_path, "job", "op", 1):
        pass
    assert handles.open_count() == 0
