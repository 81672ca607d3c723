"""QueueStateStore on a real RocksDB (rocksdict) in tmp_path, plus the changelog's local rules.

The broker is not involved: changelog ordering is checked with a recording
sender that stands in for the producer.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from stream_assets.rocketmq.records import SendReceipt
from stream_assets.state import (
    ChangelogWriter,
    QueueStateStore,
    StateMeta,
    StateSequenceError,
    commit_with_changelog,
)
from stream_assets.state.errors import StateError, StateLockedError
from stream_assets.state.records import (
    Delta,
    SnapBegin,
    SnapChunk,
    SnapEnd,
    decode_record,
    encode_delta,
    join_delta_parts,
)
from tests.immediate import ImmediateSender


def _store(root: Path, queue_id: int = 2) -> QueueStateStore:
    return QueueStateStore(root, "job", "op", queue_id)


def test_layout_is_root_job_operator_queue(tmp_path: Path) -> None:
    with _store(tmp_path, 5) as store:
        assert store.path == tmp_path / "job" / "op" / "queue-5"
        assert store.path.is_dir()


def test_fresh_store_is_empty_with_seq_zero(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        assert store.meta == StateMeta()
        assert store.is_empty()
        assert store.get(b"missing") is None
        assert list(store.items()) == []
        assert store.key_count() == 0


def test_commit_writes_values_and_meta_together_and_survives_reopen(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        meta = store.next_meta()
        meta.origins = {0: (41, 2), 3: (7, 0)}
        meta.input_offset = 128
        meta.watermark = {"per_origin": {"0": 1000, "3": 900}, "lateness_ms": 50}
        meta.extra = {"generation": 4}
        store.commit({b"apple": b"3", b"pear": b"\x00\xff", b"empty": b""}, meta)
        assert store.meta == meta
    with _store(tmp_path) as store:
        assert store.meta == meta
        assert store.meta.origins[0] == (41, 2)  # tuples, not lists, after decoding
        assert dict(store.items()) == {b"apple": b"3", b"pear": b"\x00\xff", b"empty": b""}
        assert store.get(b"empty") == b""  # an empty value is a value, not a delete


def test_committed_is_the_commit_and_the_caller_meta_never_reaches_it(tmp_path: Path) -> None:
    """``committed`` reads without a copy; what a caller keeps changing after a commit
    (its meta, a copy from ``meta``) never changes what the store committed."""
    with _store(tmp_path) as store:
        meta = store.next_meta()
        meta.origins = {0: (5, 1)}
        meta.extra = {"closed": 10}
        store.commit({b"k": b"v"}, meta)
        meta.origins[0] = (99, 0)
        meta.extra["closed"] = 99
        copy = store.meta
        copy.extra["closed"] = 77
        assert store.committed.origins == {0: (5, 1)}
        assert store.committed.extra == {"closed": 10}
        assert store.committed.seq == 1 and store.committed == store.meta


def test_seq_increments_by_one_and_stale_meta_writes_nothing(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        for expected in range(1, 6):
            meta = store.next_meta()
            assert meta.seq == expected
            store.commit({b"k": str(expected).encode()}, meta)
        stale = StateMeta(seq=5)
        with pytest.raises(StateSequenceError):
            store.commit({b"k": b"stale", b"new": b"x"}, stale)
        with pytest.raises(StateSequenceError):
            store.commit({b"k": b"skip"}, StateMeta(seq=7))
        assert store.meta.seq == 5
        assert dict(store.items()) == {b"k": b"5"}


def test_deletes_and_missing_deletes(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        store.commit({b"a": b"1", b"b": b"2", b"c": b"3"}, store.next_meta())
        store.commit({b"b": None, b"never-there": None, b"c": b"33"}, store.next_meta())
        assert dict(store.items()) == {b"a": b"1", b"c": b"33"}
        assert store.get(b"b") is None
        assert store.key_count() == 2


def test_items_prefix_never_returns_meta(tmp_path: Path) -> None:
    # User keys that look like the internal prefixes must stay user keys.
    keys = [b"", b"m", b"m:", b"m:meta", b"u:", b"u:x", b"w1", b"w1\x00", b"w1\xff", b"w2", b"\xff"]
    with _store(tmp_path) as store:
        store.commit({k: b"v" + k for k in keys}, store.next_meta())
        assert [k for k, _ in store.items()] == sorted(keys)
        assert [k for k, _ in store.items(b"m")] == [b"m", b"m:", b"m:meta"]
        assert [k for k, _ in store.items(b"w1")] == [b"w1", b"w1\x00", b"w1\xff"]
        assert [k for k, _ in store.items(b"\xff")] == [b"\xff"]
        assert list(store.items(b"zz")) == []
        assert store.get(b"m:meta") == b"vm:meta"
        assert store.key_count() == len(keys)
        assert store.meta.seq == 1


def test_update_meta_keeps_seq(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        store.commit({b"a": b"1"}, store.next_meta())
        meta = store.meta
        meta.snapshot_offset = 17
        store.update_meta(meta)
        with pytest.raises(StateSequenceError):
            store.update_meta(store.next_meta())
    with _store(tmp_path) as store:
        assert store.meta.seq == 1
        assert store.meta.snapshot_offset == 17


def test_meta_property_is_a_copy(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        store.meta.origins[1] = (5, 5)
        assert store.meta.origins == {}


def test_wipe_deletes_the_directory_and_reopens_empty(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        store.commit({b"a" * 10: b"x" * 1000}, store.next_meta())
        assert store.size_bytes() > 0
        store.wipe()
        assert store.is_open
        assert store.meta == StateMeta()
        assert store.is_empty()
    closed = _store(tmp_path)
    closed.wipe()
    assert not closed.path.exists()


def test_closed_store_refuses_use_and_close_is_idempotent(tmp_path: Path) -> None:
    store = _store(tmp_path)
    with pytest.raises(StateError, match="not open"):
        store.get(b"a")
    store.open()
    store.close()
    store.close()


def test_one_process_at_a_time(tmp_path: Path) -> None:
    # RocksDB's lock: a second open of the same store fails until the first closes.
    with _store(tmp_path), pytest.raises(StateLockedError, match="another process"):
        _store(tmp_path).open(wait_s=0)
    with _store(tmp_path) as store:
        assert store.is_open


_WRITER = textwrap.dedent(
    """
    import sys
    from stream_assets.state import QueueStateStore
    store = QueueStateStore(sys.argv[1], "job", "op", 0).open()
    print("ready", flush=True)
    while True:
        meta = store.next_meta()
        n = meta.seq
        meta.input_offset = n
        # Each commit rewrites every key: a torn batch would show mixed values.
        store.commit({b"k%d" % i: b"%d" % n for i in range(50)} | {b"n%d" % n: b""}, meta)
    """
)


def test_kill_9_mid_commits_leaves_values_and_meta_consistent(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with QueueStateStore(tmp_path, "job", "op", 0) as store:
        seq = store.meta.seq
        assert seq > 0
        assert store.meta.input_offset == seq
        assert {store.get(b"k%d" % i) for i in range(50)} == {b"%d" % seq}
        assert [k for k, _ in store.items(b"n")] == sorted(b"n%d" % n for n in range(1, seq + 1))


# -- changelog rules that need no broker -------------------------------------------------


class RecordingSender(ImmediateSender):
    """Stands in for the producer: stores bodies per queue, can fail on the nth send."""

    def __init__(self, store: QueueStateStore | None = None, fail_at: int | None = None) -> None:
        self.bodies: list[bytes] = []
        self.seq_at_send: list[int] = []
        self.store = store
        self.fail_at = fail_at

    def send_now(
        self, topic: str, body: bytes, *, key: str | None = None, queue_id: int | None = None
    ) -> SendReceipt:
        if self.fail_at is not None and len(self.bodies) == self.fail_at:
            raise RuntimeError("broker unreachable")
        if self.store is not None:
            self.seq_at_send.append(self.store.meta.seq)
        self.bodies.append(body)
        assert queue_id is not None
        return SendReceipt(topic, queue_id, len(self.bodies) - 1, "")


def _commit(
    store: QueueStateStore, writer: ChangelogWriter, changes: Mapping[bytes, bytes | None]
) -> StateMeta:
    return commit_with_changelog(store, changes, store.next_meta(), writer)


def test_changelog_is_written_before_the_local_commit(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        sender = RecordingSender(store)
        writer = ChangelogWriter(sender, "state", 2, snapshot_every=100)
        _commit(store, writer, {b"a": b"1"})
        _commit(store, writer, {b"a": None})
        # When each delta was sent the store was still at the previous seq.
        assert sender.seq_at_send == [0, 1]
        records = [decode_record(b) for b in sender.bodies]
        assert [(r.seq, type(r)) for r in records] == [(1, Delta), (2, Delta)]


def test_failed_changelog_send_leaves_local_untouched(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        writer = ChangelogWriter(RecordingSender(fail_at=1), "state", 2)
        _commit(store, writer, {b"a": b"1"})
        with pytest.raises(RuntimeError):
            _commit(store, writer, {b"a": b"2"})
        assert store.meta.seq == 1
        assert store.get(b"a") == b"1"


def test_bad_seq_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        sender = RecordingSender()
        writer = ChangelogWriter(sender, "state", 2)
        with pytest.raises(StateSequenceError):
            commit_with_changelog(store, {b"a": b"1"}, StateMeta(seq=3), writer)
        with pytest.raises(ValueError, match="queue"):
            commit_with_changelog(store, {}, store.next_meta(), ChangelogWriter(sender, "state", 1))
        assert sender.bodies == []


def test_snapshot_every_k_commits_records_its_offset(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        sender = RecordingSender()
        writer = ChangelogWriter(sender, "state", 2, snapshot_every=3, chunk_bytes=64)
        for i in range(1, 8):
            meta = _commit(store, writer, {b"k%02d" % j: b"v" * 20 for j in range(i * 2)})
        records = [decode_record(b) for b in sender.bodies]
        begins = [i for i, r in enumerate(records) if isinstance(r, SnapBegin)]
        assert [records[i].seq for i in begins] == [3, 6]
        assert meta.snapshot_offset == begins[-1] == store.meta.snapshot_offset
        # Snapshot messages point back to the previous complete snapshot until snap-end.
        second = records[begins[1] :]
        assert isinstance(second[0], SnapBegin) and second[0].snap == begins[0]
        chunks = [r for r in second if isinstance(r, SnapChunk)]
        assert len(chunks) > 1 and all(r.snap == begins[0] for r in chunks)
        end = next(r for r in second if isinstance(r, SnapEnd))
        assert (end.snap, end.begin, end.chunks, end.keys) == (
            begins[1],
            begins[1],
            len(chunks),
            12,
        )
        # The delta after the snapshot carries the new snapshot offset.
        assert isinstance(records[-1], Delta) and records[-1].seq == 7
        assert records[-1].snap == begins[1]


def test_large_delta_is_split_and_joins_back() -> None:
    rng = random.Random(7)
    huge = rng.randbytes(2_500_000)
    changes: dict[bytes, bytes | None] = {b"huge": huge, b"small": b"s", b"gone": None}
    meta = StateMeta(seq=9, origins={1: (5, 0)}, watermark={"w": [1, 2]})
    bodies = encode_delta(9, b"id", 4, changes, meta, max_body=1_000_000)
    assert len(bodies) == 3 and all(len(b) <= 1_000_000 for b in bodies)
    parts = [decode_record(b) for b in bodies]
    assert all(isinstance(p, Delta) and p.parts == 3 and p.snap == 4 for p in parts)
    assert [p.written_seq for p in parts] == [8, 8, 9]
    joined_changes, joined_meta = join_delta_parts(
        [p for p in reversed(parts) if isinstance(p, Delta)]
    )
    assert dict(joined_changes) == changes
    assert joined_meta == meta


def test_small_delta_is_one_inline_message() -> None:
    meta = StateMeta(seq=1)
    (body,) = encode_delta(1, b"id", None, {b"k": None}, meta)
    record = decode_record(body)
    assert isinstance(record, Delta)
    assert record.changes == [(b"k", None)] and record.meta == meta and record.written_seq == 1
