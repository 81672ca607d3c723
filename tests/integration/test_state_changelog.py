"""Changelog to a real state topic and restore from it, checked against a plain dict.

Every test drives commits through ``commit_with_changelog`` into queue 2 of a
4-queue state topic of its own, keeps the expected state in an independent
Python dict (and the expected meta by hand), wipes the store and restores it.

The changelog is compare-and-append: a store writes at its ``log_end`` and is
current only while that equals the state queue's end offset. Whenever a test
continues after something else wrote to the queue (a crash mid-commit,
another executor), it takes the engine's path first: :func:`ensure_current`,
which restores unless the store is current (as ``runtime/spark/task.py`` does).
"""

from __future__ import annotations

import copy
import random
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import SendReceipt
from stream_assets.settings import RocketMQSettings
from stream_assets.state import (
    ChangelogConflictError,
    ChangelogWriter,
    QueueStateStore,
    RestoreProgress,
    StateMeta,
    commit_with_changelog,
    is_current,
    local_is_current,
    restore_queue,
    state_queue,
    topic_seq,
)
from stream_assets.state.errors import StateRestoreError
from stream_assets.state.records import (
    ChangelogRecord,
    Delta,
    SnapBegin,
    SnapEnd,
    decode_record,
    encode_delta,
    encode_snap_begin,
    encode_snap_chunk,
    is_void,
)
from tests.immediate import ImmediateSender

pytestmark = pytest.mark.integration

QUEUE = 2


class VisibleSendProducer(ImmediateSender):
    """The producer, each send returning once the broker's offset queries show the record.

    RocketMQ acknowledges a send once it is in the commit log and indexes it
    into the queue (what ``max_offset`` and pulls read) a moment later, so right
    after a send ``max_offset`` is often still behind the receipt. The engine's
    batches are far apart; these tests check currency right after a commit, so
    every send here waits (a bounded poll) until the queue shows it.
    """

    def __init__(self, producer: Producer, admin: RocketMQAdmin) -> None:
        self.producer = producer
        self.admin = admin
        self._queues: dict[tuple[str, int], MessageQueue] = {}

    def send_now(
        self, topic: str, body: bytes, *, key: str | None = None, queue_id: int | None = None
    ) -> SendReceipt:
        receipt = self.producer.send(topic, body, key=key, queue_id=queue_id)
        where = (topic, receipt.queue_id)
        if where not in self._queues:
            self._queues[where] = state_queue(self.admin, topic, receipt.queue_id)
        deadline = time.monotonic() + 30
        while self.admin.max_offset(self._queues[where]) <= receipt.queue_offset:
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic}[{receipt.queue_id}] never showed {receipt}")
        return receipt


@pytest.fixture(scope="module")
def producer(client_settings: RocketMQSettings) -> Iterator[VisibleSendProducer]:
    with (
        Producer(client_settings, group=f"it-state-{uuid.uuid4().hex[:8]}") as p,
        RocketMQAdmin(client_settings) as admin,
    ):
        yield VisibleSendProducer(p, admin)


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
        self.generation = 0
        self.writer = ""

    def apply(self, changes: Mapping[bytes, bytes | None]) -> None:
        for key, value in changes.items():
            if value is None:
                self.values.pop(key, None)
            else:
                self.values[key] = value
        self.seq += 1

    def copy(self) -> Reference:
        return copy.deepcopy(self)


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


def commit_one(
    store: QueueStateStore,
    writer: ChangelogWriter,
    ref: Reference,
    rng: random.Random,
    generation: int | None = None,
    owner: str | None = None,
) -> Reference:
    """One random commit through the changelog; returns ``ref`` with it applied.

    ``ref`` itself is left alone, so a commit that raises changes no expectation.
    """
    after = ref.copy()
    changes = random_changes(rng, after)
    meta = store.next_meta()
    origin = rng.randrange(8)
    offset = after.origins.get(origin, (0, 0))[0] + rng.randint(1, 50)
    after.origins[origin] = (offset, rng.randrange(3))
    after.input_offset = (after.input_offset or 0) + rng.randint(1, 100)
    after.watermark = {"per_origin": {str(q): o * 10 for q, (o, _) in after.origins.items()}}
    if generation is not None:
        after.generation = generation
    if owner is not None:
        after.writer = owner
    meta.origins = dict(after.origins)
    meta.input_offset = after.input_offset
    meta.watermark = {"per_origin": dict(after.watermark["per_origin"])}
    meta.generation, meta.writer = after.generation, after.writer
    commit_with_changelog(store, changes, meta, writer)
    after.apply(changes)
    return after


def drive(
    store: QueueStateStore,
    writer: ChangelogWriter,
    ref: Reference,
    rng: random.Random,
    commits: int,
    generation: int | None = None,
    owner: str | None = None,
) -> None:
    """``commits`` random commits through the changelog, mirrored into ``ref``."""
    for _ in range(commits):
        after = commit_one(store, writer, ref, rng, generation, owner)
        vars(ref).update(vars(after))


def assert_matches(store: QueueStateStore, ref: Reference) -> None:
    assert dict(store.items()) == ref.values
    meta = store.meta
    assert meta.seq == ref.seq
    assert meta.origins == ref.origins
    assert meta.watermark == ref.watermark
    assert meta.input_offset == ref.input_offset
    assert (meta.generation, meta.writer) == (ref.generation, ref.writer)


def queue_end(admin: RocketMQAdmin, topic: str) -> int:
    return admin.max_offset(state_queue(admin, topic, QUEUE))


def ensure_current(
    store: QueueStateStore, topic: str, admin: RocketMQAdmin, reader: QueueReader
) -> bool:
    """The engine's currency check: not current -> wipe -> restore. True if it restored."""
    if is_current(store.meta, queue_end(admin, topic)):
        return False
    store.wipe()
    restore_queue(store, topic, QUEUE, admin, reader)
    assert store.meta.log_end == queue_end(admin, topic)
    return True


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
    assert store.meta.log_end == result.end_offset == queue_end(admin, topic)
    return store.meta, result.messages_read


def raw_records(
    admin: RocketMQAdmin, reader: QueueReader, topic: str
) -> list[tuple[int, ChangelogRecord]]:
    """Every record of the state queue with its offset, void ones included."""
    queue = state_queue(admin, topic, QUEUE)
    return [(r.queue_offset, decode_record(r.body)) for r in reader.read(queue, 0)]


def test_random_commits_restore_exactly(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    rng = random.Random(20240611)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=7, chunk_bytes=2048)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 60)
        assert_matches(store, ref)
        before = store.meta
        assert before.snapshot_offset is not None  # snapshots at 7, 14, ..., 56
        assert before.log_end == queue_end(admin, topic)
        # A single writer: every record landed exactly where it said it would.
        records = raw_records(admin, reader, topic)
        assert [r.at for _, r in records] == [offset for offset, _ in records]
        progress: list[RestoreProgress] = []
        store.wipe()
        result = restore_queue(store, topic, QUEUE, admin, reader, progress.append)
        assert_matches(store, ref)
        assert store.meta == before  # snapshot_offset, extra and log_end too
        assert result.seq == 60 and result.keys == len(ref.values)
        assert result.snapshot_offset == before.snapshot_offset
        assert progress and progress[-1].messages_read == result.messages_read
        assert progress[-1].messages_total == result.messages_read
    # The other queues of the state topic were never written.
    for q in admin.queues(topic):
        if q.queue_id != QUEUE:
            assert admin.max_offset(q) == 0


def test_without_any_snapshot_deltas_replay_from_the_start(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    rng = random.Random(5)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=1000)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 25)
        before = store.meta
        meta, read = restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        assert meta == before
        assert meta.snapshot_offset is None
        assert read == 25


def test_large_values_travel_in_parts(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
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
        records = [(r.queue_offset, decode_record(r.body)) for r in reader.read(queue, 0)]
        parts = [(o, d) for o, d in records if isinstance(d, Delta)]
        assert [(d.seq, d.part, d.parts) for _, d in parts] == [(1, 0, 2), (1, 1, 2)] + [
            (2, i, 2) for i in range(2)
        ]
        # Each part names its own offset.
        assert [d.at for _, d in parts] == [o for o, _ in parts] == [0, 1, 2, 3]
        assert store.meta.log_end == 4
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
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
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
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    rng = random.Random(17)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=4)
    with QueueStateStore(tmp_path / "a", "job", "agg", QUEUE) as mine:
        assert local_is_current(mine, topic, QUEUE, admin)  # empty topic, empty store
        drive(mine, writer, ref, rng, 9)
        assert local_is_current(mine, topic, QUEUE, admin)
        assert mine.meta.log_end == queue_end(admin, topic)
        assert topic_seq(admin, reader, topic, QUEUE) == 9
    # The queue moves to another instance, which restores and commits on.
    with QueueStateStore(tmp_path / "b", "job", "agg", QUEUE) as theirs:
        assert not local_is_current(theirs, topic, QUEUE, admin)
        restore_queue(theirs, topic, QUEUE, admin, reader)
        assert local_is_current(theirs, topic, QUEUE, admin)
        drive(theirs, writer, ref, rng, 3)
        assert local_is_current(theirs, topic, QUEUE, admin)
    # Back on the first instance: its local DB is behind, so wipe and restore.
    with QueueStateStore(tmp_path / "a", "job", "agg", QUEUE) as mine:
        assert mine.meta.seq == 9
        assert not local_is_current(mine, topic, QUEUE, admin)
        restore_fresh(mine, topic, admin, reader)
        assert local_is_current(mine, topic, QUEUE, admin)
        assert_matches(mine, ref)


class FailingSender(ImmediateSender):
    """A producer that dies after ``budget`` more sends (a crash mid-commit)."""

    def __init__(self, producer: VisibleSendProducer, budget: int) -> None:
        self.producer = producer
        self.budget = budget

    def send_now(
        self, topic: str, body: bytes, *, key: str | None = None, queue_id: int | None = None
    ) -> SendReceipt:
        if self.budget <= 0:
            raise ConnectionError("instance killed")
        self.budget -= 1
        return self.producer.send_now(topic, body, key=key, queue_id=queue_id)


class DuplicatingSender(ImmediateSender):
    """A producer whose sends are stored twice (a retry after a lost ack); first receipt wins."""

    def __init__(self, producer: VisibleSendProducer) -> None:
        self.producer = producer

    def send_now(
        self, topic: str, body: bytes, *, key: str | None = None, queue_id: int | None = None
    ) -> SendReceipt:
        receipt = self.producer.send_now(topic, body, key=key, queue_id=queue_id)
        self.producer.send_now(topic, body, key=key, queue_id=queue_id)
        return receipt


def test_crashes_mid_snapshot_and_mid_delta_still_restore_exactly(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    rng = random.Random(23)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=5, chunk_bytes=512)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 9)
        good_snapshot = store.meta.snapshot_offset
        assert good_snapshot is not None
        # Commit 10: the delta and part of the snapshot reach the topic, then the crash.
        changes: dict[bytes, bytes | None] = {b"key-%03d" % i: b"x" * 200 for i in range(60)}
        crashing = ChangelogWriter(
            FailingSender(producer, 4), topic, QUEUE, snapshot_every=5, chunk_bytes=512
        )
        delta_at = queue_end(admin, topic)
        with pytest.raises(ConnectionError):
            commit_with_changelog(store, changes, store.next_meta(), crashing)
        ref.apply(changes)
        # The delta was committed locally, the snapshot never recorded: the store's
        # log end is the delta's, so it is behind the three snapshot records.
        assert store.meta.seq == 10 and store.meta.snapshot_offset == good_snapshot
        assert store.meta.log_end == delta_at + 1 == queue_end(admin, topic) - 3
        assert not local_is_current(store, topic, QUEUE, admin)
        # The restart restores (the incomplete snapshot is never named) and commits on;
        # its deltas still point at the last complete snapshot.
        assert ensure_current(store, topic, admin, reader)
        assert_matches(store, ref)
        assert store.meta.snapshot_offset == good_snapshot
        drive(store, writer, ref, rng, 2)
        # Commit 13: half a split delta, then the crash before the local commit ...
        big = {b"big": rng.randbytes(5_000_000)}
        half = ChangelogWriter(FailingSender(producer, 1), topic, QUEUE)
        with pytest.raises(ConnectionError):
            commit_with_changelog(store, big, store.next_meta(), half)
        assert store.meta.seq == 12
        # ... the orphan part moved the queue's end: restore (seq 13 is not complete) ...
        assert not local_is_current(store, topic, QUEUE, admin)
        assert ensure_current(store, topic, admin, reader)
        assert_matches(store, ref)
        assert topic_seq(admin, reader, topic, QUEUE) == 12
        # ... then a whole delta of 13 whose local commit never happened ...
        lost = store.next_meta()
        lost.extra = {"lost": True}
        end = writer.write_delta({b"lost": b"1"}, lost, at=store.meta.log_end or 0)
        assert end == queue_end(admin, topic)
        assert not local_is_current(store, topic, QUEUE, admin)
        # ... which is durable, so the restart restores it rather than writing 13 again.
        assert ensure_current(store, topic, admin, reader)
        ref.apply({b"lost": b"1"})
        assert_matches(store, ref)
        assert store.meta.extra == {"lost": True}
        assert store.get(b"big") is None
        drive(store, writer, ref, rng, 1)  # seq 14
        before = store.meta
        assert before.snapshot_offset == good_snapshot
        restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        assert store.meta == before
        assert store.get(b"lost") == b"1" and store.get(b"big") is None
        # Past the next complete snapshot (15) none of that history is read again.
        drive(store, writer, ref, rng, 3)
        before = store.meta
        assert before.snapshot_offset is not None
        assert before.snapshot_offset > good_snapshot
        _, read = restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        assert store.meta == before
        assert read == queue_end(admin, topic) - before.snapshot_offset
        # No writer ever raced this one: nothing in the queue is void.
        assert not [o for o, r in raw_records(admin, reader, topic) if is_void(r, o)]


def test_a_send_stored_twice_is_void_and_the_store_restores_past_it(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    rng = random.Random(31)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=100)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 3)
        at = queue_end(admin, topic)
        twice = ChangelogWriter(DuplicatingSender(producer), topic, QUEUE, snapshot_every=100)
        drive(store, twice, ref, rng, 1)  # the first copy is where it meant to be: committed
        assert store.meta.log_end == at + 1 == queue_end(admin, topic) - 1
        copy_of_it = raw_records(admin, reader, topic)[-1]
        assert copy_of_it[0] == at + 1 and copy_of_it[1].at == at
        assert is_void(copy_of_it[1], copy_of_it[0])
        # Committing on without the check would be refused; the engine restores first.
        before = store.meta
        with pytest.raises(ChangelogConflictError):
            commit_with_changelog(store, {b"k": b"v"}, store.next_meta(), writer)
        assert store.meta == before
        assert ensure_current(store, topic, admin, reader)
        assert_matches(store, ref)
        drive(store, writer, ref, rng, 2)
        restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        seqs = [r.seq for o, r in raw_records(admin, reader, topic) if not is_void(r, o)]
        assert seqs == list(range(1, 7))


def test_records_without_at_still_restore_and_the_last_write_of_a_seq_wins(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    """A queue written before compare-and-append (no ``at``) restores, and writing goes on."""
    ref = Reference()
    first = {b"a": b"1", b"b": b"1"}
    retried_1 = {b"a": b"1", b"b": b"2"}
    retried_2 = {b"a": b"3"}
    for seq, changes in ((1, first), (2, retried_1), (2, retried_2)):
        meta = StateMeta(seq=seq, input_offset=seq * 10, extra={"attempt": str(changes)})
        for body in encode_delta(seq, uuid.uuid4().bytes[:8], None, changes, meta):
            producer.send_now(topic, body, queue_id=QUEUE)
    ref.apply(first)
    ref.apply(retried_2)  # of two complete writes of seq 2 the last one is what was committed
    ref.input_offset = 20
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        assert ensure_current(store, topic, admin, reader)
        assert_matches(store, ref)
        assert store.meta.extra == {"attempt": str(retried_2)}
        writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=4)
        drive(store, writer, ref, random.Random(37), 3)
        before = store.meta
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
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    rng = random.Random(29)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=4)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, rng, 5)
        complete = store.meta.snapshot_offset
        assert complete is not None
        # A writer that broke the protocol: half a snapshot (each record where it
        # says), then deltas pointing at it.
        meta = store.meta
        end = meta.log_end
        assert end is not None
        begin = producer.send_now(
            topic, encode_snap_begin(meta.seq, b"broken", complete, meta, at=end), queue_id=QUEUE
        ).queue_offset
        assert begin == end
        body = encode_snap_chunk(meta.seq, b"broken", complete, 0, begin, b"\xc4\x01k", at=end + 1)
        assert producer.send_now(topic, body, queue_id=QUEUE).queue_offset == end + 1
        store.update_meta(replace(meta, snapshot_offset=begin, log_end=end + 2))
        assert local_is_current(store, topic, QUEUE, admin)
        drive(store, writer, ref, rng, 2)
        before = store.meta
        restore_fresh(store, topic, admin, reader)
        assert_matches(store, ref)
        assert store.meta == before


def test_a_gap_in_the_seqs_is_an_error(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE)
    with QueueStateStore(tmp_path, "job", "agg", QUEUE) as store:
        drive(store, writer, ref, random.Random(1), 3)
        skipped = store.next_meta()
        skipped.seq += 1
        writer.write_delta({b"k": b"v"}, skipped, at=store.meta.log_end or 0)
        store.wipe()
        with pytest.raises(StateRestoreError, match="jumps from 3 to 5"):
            restore_queue(store, topic, QUEUE, admin, reader)


def test_two_executors_take_turns_on_one_state_queue(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    """Spark runs the queue on either executor; sometimes both run the same batch.

    Each checks currency before every commit. Of two that both found
    themselves current, the first to append wins; the other's record is void
    and its local store unchanged.
    """
    rng = random.Random(41)
    ref = Reference()
    writers = [
        ChangelogWriter(producer, topic, QUEUE, snapshot_every=5, chunk_bytes=1024) for _ in "ab"
    ]
    stores = [
        QueueStateStore(tmp_path / name, "job", "agg", QUEUE).open()
        for name in ("exec-0", "exec-1")
    ]
    restores = [0, 0]
    races = 0
    try:
        for _ in range(40):
            if rng.random() < 0.25:
                # Both run the batch: both pass the check, then both append.
                for i in (0, 1):
                    restores[i] += ensure_current(stores[i], topic, admin, reader)
                assert stores[0].meta.log_end == stores[1].meta.log_end
                first = rng.randrange(2)
                winner, loser = stores[first], stores[1 - first]
                after = commit_one(winner, writers[first], ref, rng)
                before = (dict(loser.items()), loser.meta)
                with pytest.raises(ChangelogConflictError):
                    commit_one(loser, writers[1 - first], ref, rng)
                assert (dict(loser.items()), loser.meta) == before
                ref = after
                races += 1
            else:
                i = rng.randrange(2)
                restores[i] += ensure_current(stores[i], topic, admin, reader)
                ref = commit_one(stores[i], writers[i], ref, rng)
                assert local_is_current(stores[i], topic, QUEUE, admin)
        assert races > 3 and min(restores) > 3
        for store in stores:
            ensure_current(store, topic, admin, reader)
            assert_matches(store, ref)
    finally:
        for store in stores:
            store.close()
    with QueueStateStore(tmp_path / "fresh", "job", "agg", QUEUE) as fresh:
        restore_fresh(fresh, topic, admin, reader)
        assert_matches(fresh, ref)
    records = raw_records(admin, reader, topic)
    void = [(o, r) for o, r in records if is_void(r, o)]
    assert len(void) == races  # one void record per lost race
    assert all(r.at is not None and r.at < o for o, r in void)
    seqs = [r.seq for o, r in records if isinstance(r, Delta) and not is_void(r, o)]
    assert seqs == list(range(1, ref.seq + 1))  # strictly increasing, no gaps, no repeats
    ends = [r for o, r in records if isinstance(r, SnapEnd) and not is_void(r, o)]
    assert [e.seq for e in ends] == list(range(5, ref.seq + 1, 5))


def test_a_stale_writer_cannot_commit_over_a_newer_one(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
) -> None:
    rng = random.Random(43)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=4)
    with (
        QueueStateStore(tmp_path / "a", "job", "agg", QUEUE) as a,
        QueueStateStore(tmp_path / "b", "job", "agg", QUEUE) as b,
    ):
        drive(a, writer, ref, rng, 6)
        assert ensure_current(b, topic, admin, reader)
        x = queue_end(admin, topic)
        assert a.meta.log_end == b.meta.log_end == x
        assert local_is_current(a, topic, QUEUE, admin) and local_is_current(b, topic, QUEUE, admin)
        drive(b, writer, ref, rng, 1)  # B commits seq 7 at x
        # A does not check again and commits its own seq 7.
        a_before = (dict(a.items()), a.meta)
        a_changes = {b"only-a": b"1", **random_changes(rng, ref)}
        with pytest.raises(ChangelogConflictError, match=f"meant for offset {x} landed at {x + 1}"):
            commit_with_changelog(a, a_changes, a.next_meta(), writer)
        assert (dict(a.items()), a.meta) == a_before
        assert a.meta.seq == 6
        a.close()
        a.open()
        assert (dict(a.items()), a.meta) == a_before  # and nothing reached the disk
        # The topic gained exactly one record, and it is void.
        assert queue_end(admin, topic) == x + 2
        records = raw_records(admin, reader, topic)
        assert [o for o, r in records if is_void(r, o)] == [x + 1]
        voided = records[x + 1][1]
        assert isinstance(voided, Delta) and (voided.seq, voided.at) == (7, x)
        assert topic_seq(admin, reader, topic, QUEUE) == 7
        b_meta = b.meta
    with QueueStateStore(tmp_path / "fresh", "job", "agg", QUEUE) as fresh:
        restore_fresh(fresh, topic, admin, reader)
        assert_matches(fresh, ref)
        assert fresh.get(b"only-a") is None
        assert replace(fresh.meta, log_end=b_meta.log_end) == b_meta


@pytest.mark.parametrize("tail", [0, 2], ids=["from-snapshot", "snapshot-and-deltas"])
def test_generation_and_writer_of_the_last_commit_survive_a_restore(
    tmp_path: Path,
    topic: str,
    admin: RocketMQAdmin,
    reader: QueueReader,
    producer: VisibleSendProducer,
    tail: int,
) -> None:
    rng = random.Random(47 + tail)
    ref = Reference()
    writer = ChangelogWriter(producer, topic, QUEUE, snapshot_every=4)
    with QueueStateStore(tmp_path / "a", "job", "agg", QUEUE) as a:
        drive(a, writer, ref, rng, 3, generation=1, owner="instance-a")
        assert (a.meta.generation, a.meta.writer) == (1, "instance-a")
    # The queue is reallocated: generation 2 restores and commits up to a snapshot
    # (seq 4), then maybe a tail of deltas after it.
    with QueueStateStore(tmp_path / "b", "job", "agg", QUEUE) as b:
        assert ensure_current(b, topic, admin, reader)
        assert (b.meta.generation, b.meta.writer) == (1, "instance-a")
        drive(b, writer, ref, rng, 1 + tail, generation=2, owner="instance-b")
        b_meta = b.meta
    last = raw_records(admin, reader, topic)[-1][1]
    assert isinstance(last, SnapEnd if tail == 0 else Delta)
    with QueueStateStore(tmp_path / "fresh", "job", "agg", QUEUE) as fresh:
        meta, _ = restore_fresh(fresh, topic, admin, reader)
        assert_matches(fresh, ref)
        assert (meta.generation, meta.writer) == (2, "instance-b")
        assert meta == b_meta
    # The old owner's store, once current again, learns that generation 2 owns the queue.
    with QueueStateStore(tmp_path / "a", "job", "agg", QUEUE) as a:
        assert (a.meta.generation, a.meta.seq) == (1, 3)
        assert ensure_current(a, topic, admin, reader)
        assert (a.meta.generation, a.meta.writer) == (2, "instance-b")
        assert a.meta == b_meta
