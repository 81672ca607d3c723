"""Changelog to a real state topic and restore from it, checked against a plain dict.

Every test drives commits through ``commit_with_changelog`` into queue 2 of a
4-queue state topic of its own, keeps the expected state in an independent
Python dict (and the expected meta by hand), wipes the store and restores it.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import SendReceipt
from stream_assets.settings import RocketMQSettings
from stream_assets.state import (
    ChangelogWriter,
    QueueStateStore,
    RestoreProgress,
    StateMeta,
    commit_with_changelog,
    local_is_current,
    restore_queue,
    state_queue,
    topic_seq,
)
from stream_assets.state.errors import StateRestoreError
from stream_assets.state.records import (
    Delta,
    SnapBegin,
    decode_record,
    encode_snap_begin,
    encode_snap_chunk,
)

pytestmark = pytest.mark.integration

QUEUE = 2


@pytest.fixture(scope="module")
def producer(client_settings: RocketMQSettings) -> Iterator[Producer]:
    with Producer(client_settings, group=f"it-state-{uuid.uuid4().hex[:8]}") as p:
        yield p


@pytest.fixture
def topic(admin: RocketMQAdmin) -> str:
    name = f"it-state-{uuid.uuid4().hex}"
    admin.create_topic(name, queues=4)
    return name


@pytest.fixture
def reader(admin: RocketMQAdmin) -> Iterator[QueueReader]:
    r = QueueReader(admin, group=f"it-state-reader-{uuid.uuid4().hex}")
    yield r
    r.close()


class Reference:
    """The expected state and meta, kept without any code under test."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.seq = 0
        self.origins: dict[int, tuple[int, int]] = {}
        self.watermark: dict[str, dict[str, int]] = {}
        self.input_offset: int | None = None

    def apply(self, changes: Mapping[bytes, bytes | None]) -> None:
        for key, value in changes.items():
            if value is None:
                self.values.pop(key, None)
            else:
                self.values[key] = value
        self.seq += 1


def random_changes(rng: random.Random, ref: Reference) -> dict[bytes, bytes | None]:
    changes: dict[bytes, bytes | None] = {}
    for _ in range(rng.randint(0, 40)):
        key = b"key-%03d" % rng.randrange(300)
        if ref.values and rng.random() < 0.25:
            changes[rng.choice(sorted(ref.values))] = None
        elif rng.random() < 0.05:
            changes[key] = None  # delete of a key that may not exist
        else:
            changes[key] = rng.randbytes(rng.randint(0, 300))
    return changes


def drive(
    store: QueueStateStore,
    writer: ChangelogWriter,
    ref: Reference,
    rng: random.Random,
    commits: int,
) -> None:
    """``commits`` random commits through the changelog, mirrored into ``ref``."""
    for _ in range(commits):
        changes = random_changes(rng, ref)
        meta = store.next_meta()
        origin = rng.randrange(8)
        offset = ref.origins.get(origin, (0, 0))[0] + rng.randint(1, 50)
        ref.origins[origin] = (offset, rng.randrange(3))
        ref.input_offset = (ref.input_offset or 0) + rng.randint(1, 100)
        ref.watermark = {"per_origin": {str(q): o * 10 for q, (o, _) in ref.origins.items()}}
        meta.origins = dict(ref.origins)
        meta.input_offset = ref.input_offset
        meta.watermark = {"per_origin": dict(ref.watermark["per_origin"])}
        commit_with_changelog(store, changes, meta, writer)
        ref.apply(changes)


def assert_matches(store: QueueStateStore, ref: Reference) -> None:
    assert dict(store.items()) == ref.values
    meta = store.meta
    assert meta.seq == ref.seq
    assert meta.origins == ref.origins
    assert meta.watermark == ref.watermark
    assert meta.input_offset == ref.input_offset


def restore_fresh(
    store: QueueStateStore,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    seen: list[RestoreProgress] | None = None,
) -> tuple[StateMeta, int]:
    """Wipe + restore; returns the restored meta and messages read."""
    store.wipe()
    result = restore_queue(store, topic, QUEUE, admin, reader, seen.append if seen else None)
    assert result.seq == store.meta.seq
    assert result.keys == store.key_count()
    return store.meta, result.messages_read


def test_random_commits_restore_exactly(
    tmp_path: Path, topic: str, admin: RocketMQAdmin, reader: QueueReader, producer: Producer
) -> None:
    rng = random.Random(20240611)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=7, chunk_bytes=2048)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 60)
        assert_matches(store, ref)
        before = store.meta
        assert before.snapshot_offset is not None  # snapshots at 7, 14, ..., 56
        progress: list[RestoreProgress] = []
        store.wipe()
        result = restore_queue(store, topic, QUEUE, admin, reader, progress.append)
        assert_matches(store, ref)
        assert store.meta == before  # snapshot_offset and extra too
        assert result.seq == 60 and result.keys == len(ref.values)
        assert result.snapshot_offset == before.snapshot_offset
        assert progress and progress[-1].messages_read == result.messages_read
        assert progress[-1].messages_total == result.messages_read
    # The other queues of the state topic were never written.
    for q in admin.queues(topic):
        if q.queue_id != QUEUE:
            assert admin.max_offset(q) == 0


def test_without_any_snapshot_deltas_replay_from_the_start(
    tmp_path: Path, topic: str, admin: RocketMQAdmin, reader: QueueReader, producer: Producer
) -> None:
    rng = random.Random(5)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=1000)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 25)
        meta, read = restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        assert meta.snapshot_offset is None
        assert read == 25


def test_large_values_travel_in_parts(
    tmp_path: Path, topic: str, admin: RocketMQAdmin, reader: QueueReader, producer: Producer
) -> None:
    rng = random.Random(11)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=3)
    queue = state_queue(admin, topic, QUEUE)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        # 4 x 1.5 MiB in one commit, then one value larger than a whole message.
        big: dict[bytes, bytes | None] = {b"big-%d" % i: rng.randbytes(1_572_864) for i in range(4)}
        huge: dict[bytes, bytes | None] = {b"huge": rng.randbytes(5_000_000), b"small": b"s"}
        for changes in (big, huge):
            meta = store.next_meta()
            commit_with_changelog(store, changes, meta, writer)
            ref.apply(changes)
        deltas = [decode_record(r.body) for r in reader.read(queue, 0)]
        parts = [d for d in deltas if isinstance(d, Delta)]
        assert [(d.seq, d.part, d.parts) for d in parts] == [(1, 0, 2), (1, 1, 2)] + [
            (2, i, 2) for i in range(2)
        ]
        # No snapshot yet: the restore joins the parts of both deltas.
        restore_fresh(store, topic, admin, reader)
        assert dict(store.items()) == ref.values
        # Commit 3 takes a snapshot holding every big value; then drop some.
        drops: list[dict[bytes, bytes | None]] = [
            {b"big-0": None, b"x": b"1"},
            {b"huge": None, b"big-1": b"short"},
        ]
        for drop in drops:
            commit_with_changelog(store, drop, store.next_meta(), writer)
            ref.apply(drop)
        assert store.meta.snapshot_offset is not None
        restore_fresh(store, topic, admin, reader)
        assert dict(store.items()) == ref.values
        assert store.meta.seq == 4
        # And a restore from the snapshot alone (its big values in chunks).
        commit_with_changelog(store, {b"y": b"2"}, store.next_meta(), writer)
        ref.apply({b"y": b"2"})
        commit_with_changelog(store, {}, store.next_meta(), writer)  # seq 6: a snapshot
        ref.apply({})
        _, read = restore_fresh(store, topic, admin, reader)
        assert dict(store.items()) == ref.values
        assert topic_seq(admin, reader, topic, QUEUE) == 6  # the last message is a snap-end
        snapshot = store.meta.snapshot_offset
        assert snapshot is not None
        assert read == admin.max_offset(queue) - snapshot


def test_restore_reads_only_from_the_latest_snapshot(
    tmp_path: Path, topic: str, admin: RocketMQAdmin, reader: QueueReader, producer: Producer
) -> None:
    rng = random.Random(3)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=10, chunk_bytes=1024)
    queue = state_queue(admin, topic, QUEUE)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 33)  # snapshots after 10, 20, 30; three deltas after
        snapshot = store.meta.snapshot_offset
        assert snapshot is not None
        first = decode_record(next(reader.read(queue, snapshot, snapshot + 1)).body)
        assert isinstance(first, SnapBegin) and first.seq == 30
        end = admin.max_offset(queue)
        _, read = restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        assert read <= end - snapshot
        assert read < end // 2  # far less than the whole history


def test_local_is_current_until_another_instance_commits(
    tmp_path: Path, topic: str, admin: RocketMQAdmin, reader: QueueReader, producer: Producer
) -> None:
    rng = random.Random(17)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=4)
    with QueueStateStore(tmp_path / "a", "job", "agg", QUEUE) as mine:
        assert local_is_current(mine, topic, QUEUE, admin, reader)  # empty topic, empty store
        drive(mine, writer, ref, rng, 9)
        assert local_is_current(mine, topic, QUEUE, admin, reader)
        assert topic_seq(admin, reader, topic, QUEUE) == 9
    # The queue moves to another instance, which restores and commits on.
    with QueueStateStore(tmp_path / "b", "job", "agg", QUEUE) as theirs:
        assert not local_is_current(theirs, topic, QUEUE, admin, reader)
        restore_queue(theirs, topic, QUEUE, admin, reader)
        assert local_is_current(theirs, topic, QUEUE, admin, reader)
        drive(theirs, writer, ref, rng, 3)
    # Back on the first instance: its local DB is behind, so wipe and restore.
    with QueueStateStore(tmp_path / "a", "job", "agg", QUEUE) as mine:
        assert mine.meta.seq == 9
        assert not local_is_current(mine, topic, QUEUE, admin, reader)
        restore_fresh(mine, topic, admin, reader)
        assert local_is_current(mine, topic, QUEUE, admin, reader)
        assert_matches(mine, ref)


class FailingSender:
    """A producer that dies after ``budget`` more sends (a crash mid-commit)."""

    def __init__(self, producer: Producer, budget: int) -> None:
        self.producer = producer
        self.budget = budget

    def send(
        self, topic: str, body: bytes, *, key: str | None = None, queue_id: int | None = None
    ) -> SendReceipt:
        if self.budget <= 0:
            raise ConnectionError("instance killed")
        self.budget -= 1
        return self.producer.send(topic, body, key=key, queue_id=queue_id)


def test_crashes_mid_snapshot_and_mid_delta_still_restore_exactly(
    tmp_path: Path, topic: str, admin: RocketMQAdmin, reader: QueueReader, producer: Producer
) -> None:
    rng = random.Random(23)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=5, chunk_bytes=512)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 9)
        good_snapshot = store.meta.snapshot_offset
        # Commit 10: the delta and part of the snapshot reach the topic, then the crash.
        changes = {b"key-%03d" % i: b"x" * 200 for i in range(60)}
        crashing = ChangelogWriter(
            FailingSender(producer, 4), topic, QUEUE, snapshot_every=5, chunk_bytes=512
        )
        with pytest.raises(ConnectionError):
            commit_with_changelog(store, changes, store.next_meta(), crashing)
        ref.apply(changes)
        assert store.meta.seq == 10 and store.meta.snapshot_offset == good_snapshot
        # The restart's deltas still point at the last complete snapshot.
        drive(store, writer, ref, rng, 2)
        # Commit 13: half a split delta, then the crash before the local commit ...
        big = {b"big": rng.randbytes(5_000_000)}
        half = ChangelogWriter(FailingSender(producer, 1), topic, QUEUE)
        with pytest.raises(ConnectionError):
            commit_with_changelog(store, big, store.next_meta(), half)
        assert store.meta.seq == 12
        assert local_is_current(store, topic, QUEUE, admin, reader)  # seq 13 is not complete
        # ... and a whole delta of 13 whose local commit never happened ...
        lost = store.next_meta()
        lost.extra = {"lost": True}
        writer.write_delta({b"lost": b"1"}, lost)
        assert not local_is_current(store, topic, QUEUE, admin, reader)
        # ... then 13 is committed again with other content: the last write wins.
        drive(store, writer, ref, rng, 1)
        before = store.meta
        assert before.snapshot_offset == good_snapshot
        restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        assert store.meta == before
        assert store.get(b"lost") is None and store.get(b"big") is None
        # Past the next complete snapshot (15) none of that history is read again.
        drive(store, writer, ref, rng, 3)
        before = store.meta
        assert before.snapshot_offset is not None and good_snapshot is not None
        assert before.snapshot_offset > good_snapshot
        restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        assert store.meta == before


def test_restore_refuses_a_store_that_is_not_empty(
    tmp_path: Path, topic: str, admin: RocketMQAdmin, reader: QueueReader
) -> None:
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        store.commit({b"a": b"1"}, store.next_meta())
        with pytest.raises(StateRestoreError, match="empty"):
            restore_queue(store, topic, QUEUE, admin, reader)


def test_a_snapshot_named_but_incomplete_falls_back_to_the_one_before(
    tmp_path: Path, topic: str, admin: RocketMQAdmin, reader: QueueReader, producer: Producer
) -> None:
    rng = random.Random(29)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=4)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 5)
        complete = store.meta.snapshot_offset
        assert complete is not None
        # A writer that broke the protocol: half a snapshot, then deltas pointing at it.
        meta = store.meta
        begin = producer.send(
            topic, encode_snap_begin(meta.seq, b"broken", complete, meta), queue_id=QUEUE
        ).queue_offset
        body = encode_snap_chunk(meta.seq, b"broken", complete, 0, begin, b"\xc4\x01k")
        producer.send(topic, body, queue_id=QUEUE)
        meta.snapshot_offset = begin
        store.update_meta(meta)
        drive(store, writer, ref, rng, 2)
        before = store.meta
        restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        assert store.meta == before


def test_a_gap_in_the_seqs_is_an_error(
    tmp_path: Path, topic: str, admin: RocketMQAdmin, reader: QueueReader, producer: Producer
) -> None:
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, random.Random(1), 3)
        skipped = store.next_meta()
        skipped.seq += 1
        writer.write_delta({b"k": b"v"}, skipped)
        store.wipe()
        with pytest.raises(StateRestoreError, match="jumps from 3 to 5"):
            restore_queue(store, topic, QUEUE, admin, reader)
