"""Compare-and-append on the state topic, without a broker.

The state topic is an in-memory list per queue. Senders append to it and
report the offset each body got, like the producer's receipt; a sender can
run a *foreign append* just before its Nth send (another writer's commit, or
a retried send stored twice), which is how two writers race for one offset.
The same in-memory topic answers the few admin and reader calls a restore
makes, so every conflict is also checked end to end: what a fresh restore
rebuilds is compared with a plain dict kept by the test.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.reader import PullBatch, PullStatus, QueueReader
from stream_assets.rocketmq.records import Record, SendReceipt
from stream_assets.state import (
    ChangelogConflictError,
    ChangelogWriter,
    QueueStateStore,
    StateMeta,
    commit_with_changelog,
    is_current,
    local_is_current,
    restore_queue,
    topic_seq,
)
from stream_assets.state import ensure_current as state_ensure_current
from stream_assets.state.records import (
    ChangelogRecord,
    Delta,
    SnapBegin,
    SnapChunk,
    SnapEnd,
    decode_record,
    encode_delta,
    is_void,
)
from tests.immediate import ImmediateSender

TOPIC = "job-state"
QUEUE = 2
QUEUES = 4
QUEUE_OF = MessageQueue(TOPIC, "memory", QUEUE)


class MemoryTopic:
    """A state topic held in memory; also the admin and reader a restore needs."""

    def __init__(self) -> None:
        self.bodies: dict[int, list[bytes]] = {q: [] for q in range(QUEUES)}

    def append(self, queue_id: int, body: bytes) -> int:
        log = self.bodies[queue_id]
        log.append(body)
        return len(log) - 1

    def end(self, queue_id: int = QUEUE) -> int:
        return len(self.bodies[queue_id])

    def records(self, queue_id: int = QUEUE) -> list[tuple[int, ChangelogRecord]]:
        return [(offset, decode_record(b)) for offset, b in enumerate(self.bodies[queue_id])]

    def valid(self, queue_id: int = QUEUE) -> list[tuple[int, ChangelogRecord]]:
        return [(o, r) for o, r in self.records(queue_id) if not is_void(r, o)]

    def void_offsets(self, queue_id: int = QUEUE) -> list[int]:
        return [o for o, r in self.records(queue_id) if is_void(r, o)]

    # -- what restore_queue asks of RocketMQAdmin ----------------------------

    def get_kv(self, namespace: str, key: str) -> None:
        return None  # no stored layouts: one broker, queue index == queue id

    def queues(self, topic: str) -> list[MessageQueue]:
        assert topic == TOPIC
        return [MessageQueue(topic, "memory", q) for q in sorted(self.bodies)]

    def min_offset(self, queue: MessageQueue) -> int:
        return 0

    def max_offset(self, queue: MessageQueue) -> int:
        return self.end(queue.queue_id)

    # -- and of QueueReader --------------------------------------------------

    def _record(self, queue: MessageQueue, offset: int) -> Record:
        return Record(queue.topic, queue.queue_id, offset, self.bodies[queue.queue_id][offset])

    def pull(self, queue: MessageQueue, offset: int, max_messages: int | None = None) -> PullBatch:
        end = self.end(queue.queue_id)
        stop = min(end, offset + (max_messages or 32))
        records = [self._record(queue, o) for o in range(offset, stop)]
        status = PullStatus.FOUND if records else PullStatus.NO_NEW_MESSAGES
        return PullBatch(queue, status, records, stop if records else offset, 0, end)

    def read(self, queue: MessageQueue, start: int, end: int | None = None) -> Iterator[Record]:
        stop = self.end(queue.queue_id) if end is None else end
        for offset in range(start, stop):
            yield self._record(queue, offset)

    @property
    def admin(self) -> RocketMQAdmin:
        return cast(RocketMQAdmin, self)

    @property
    def reader(self) -> QueueReader:
        return cast(QueueReader, self)


class MemorySender(ImmediateSender):
    """Appends to a :class:`MemoryTopic`; ``before[n]`` runs just before the nth send (1-based)."""

    def __init__(
        self, topic: MemoryTopic, before: Mapping[int, Callable[[], None]] | None = None
    ) -> None:
        self.topic = topic
        self.before = dict(before or {})
        self.sends = 0
        self.kinds: list[type] = []

    def send_now(
        self, topic: str, body: bytes, *, key: str | None = None, queue_id: int | None = None
    ) -> SendReceipt:
        assert topic == TOPIC and queue_id is not None
        self.sends += 1
        foreign = self.before.pop(self.sends, None)
        if foreign is not None:
            foreign()
        self.kinds.append(type(decode_record(body)))
        return SendReceipt(topic, queue_id, self.topic.append(queue_id, body), "")


class Reference:
    """The expected values, applied by the test and nothing else."""

    def __init__(self, values: Mapping[bytes, bytes] | None = None) -> None:
        self.values: dict[bytes, bytes] = dict(values or {})

    def apply(self, changes: Mapping[bytes, bytes | None]) -> None:
        for key, value in changes.items():
            if value is None:
                self.values.pop(key, None)
            else:
                self.values[key] = value

    def copy(self) -> Reference:
        return Reference(self.values)


def random_changes(rng: random.Random, ref: Reference, n: int = 12) -> dict[bytes, bytes | None]:
    changes: dict[bytes, bytes | None] = {}
    for _ in range(n):
        if ref.values and rng.random() < 0.25:
            changes[rng.choice(sorted(ref.values))] = None
        else:
            changes[b"key-%03d" % rng.randrange(200)] = rng.randbytes(rng.randint(0, 120))
    return changes


def ensure_current(store: QueueStateStore, topic: MemoryTopic) -> bool:
    """What the engine does before a batch: restore unless the store holds the whole queue."""
    if local_is_current(store, TOPIC, QUEUE, topic.admin):
        return False
    store.wipe()
    restore_queue(store, TOPIC, QUEUE, topic.admin, topic.reader)
    return True


def build_meta(store: QueueStateStore, **meta_fields: object) -> StateMeta:
    """The meta of the store's next commit, with some bookkeeping moved on."""
    meta = store.next_meta()
    meta.input_offset = (meta.input_offset or 0) + 10
    meta.origins = {**meta.origins, 1: (meta.seq * 3, 0)}
    meta.watermark = {"version": 2, "allowed_lateness_ms": 0, "origins": {"1": {}}}
    for name, value in meta_fields.items():
        setattr(meta, name, value)
    return meta


def commit(
    store: QueueStateStore,
    changelog: ChangelogWriter,
    changes: Mapping[bytes, bytes | None],
    ref: Reference | None = None,
    **meta_fields: object,
) -> StateMeta:
    """``commit_with_changelog`` of ``changes``; mirrored into ``ref`` once it returns."""
    meta = build_meta(store, **meta_fields)
    committed = commit_with_changelog(store, changes, meta, changelog)
    if ref is not None:
        ref.apply(changes)
    return committed


def restored(root: Path, topic: MemoryTopic) -> tuple[dict[bytes, bytes], StateMeta]:
    """Values and meta of a fresh store restored from ``topic``."""
    with QueueStateStore(root, "job", "op", QUEUE) as store:
        assert local_is_current(store, TOPIC, QUEUE, topic.admin) == (topic.end() == 0)
        result = restore_queue(store, TOPIC, QUEUE, topic.admin, topic.reader)
        assert result.end_offset == topic.end()
        assert store.meta.log_end == topic.end()
        assert local_is_current(store, TOPIC, QUEUE, topic.admin)
        return dict(store.items()), store.meta


def snapshot_of(store: QueueStateStore) -> tuple[dict[bytes, bytes], StateMeta]:
    return dict(store.items()), store.meta


def same_state(x: QueueStateStore, y: QueueStateStore) -> bool:
    """Same values and meta, apart from the log end each one knows."""
    return dict(x.items()) == dict(y.items()) and replace(x.meta, log_end=None) == replace(
        y.meta, log_end=None
    )


def reopened(store: QueueStateStore) -> tuple[dict[bytes, bytes], StateMeta]:
    """Values and meta as persisted on disk (close and reopen)."""
    store.close()
    store.open()
    return snapshot_of(store)


def test_every_record_lands_where_it_says_and_log_end_follows_the_queue(tmp_path: Path) -> None:
    rng = random.Random(1)
    topic = MemoryTopic()
    ref = Reference()
    sender = MemorySender(topic)
    writer = ChangelogWriter(sender, TOPIC, QUEUE, snapshot_every=4, max_body=2048, chunk_bytes=700)
    with QueueStateStore(tmp_path / "a", "job", "op", QUEUE) as store:
        assert is_current(store.meta, topic.end()) and store.meta.log_end is None
        for i in range(1, 11):
            # Every third commit is large enough to travel in parts.
            n = 60 if i % 3 == 0 else 8
            commit(store, writer, random_changes(rng, ref, n), ref)
            assert store.meta.log_end == topic.end() == sender.sends
            assert local_is_current(store, TOPIC, QUEUE, topic.admin)
        assert not topic.void_offsets()
        records = topic.records()
        assert all(r.at == offset for offset, r in records)
        parts = [r for _, r in records if isinstance(r, Delta) and r.parts > 1]
        assert {r.seq for r in parts} == {3, 6, 9}
        assert [r.seq for _, r in records if isinstance(r, SnapEnd)] == [4, 8]
        assert dict(store.items()) == ref.values
        before = store.meta
        # Nothing but queue QUEUE was written.
        assert all(not topic.bodies[q] for q in range(QUEUES) if q != QUEUE)
    values, meta = restored(tmp_path / "fresh", topic)
    assert values == ref.values
    assert meta == before


def test_write_delta_and_write_snapshot_report_their_offsets(tmp_path: Path) -> None:
    topic = MemoryTopic()
    sender = MemorySender(topic)
    writer = ChangelogWriter(sender, TOPIC, QUEUE, max_body=2048, chunk_bytes=256)
    with QueueStateStore(tmp_path, "job", "op", QUEUE) as store:
        store.commit({b"k%02d" % i: bytes(100) for i in range(20)}, store.next_meta())
        end = writer.write_delta({b"a": b"1"}, store.next_meta(), at=0)
        assert end == 1 == topic.end()
        big: dict[bytes, bytes | None] = {b"big": bytes(5_000)}
        end = writer.write_delta(big, store.next_meta(), at=end)
        assert end == topic.end() >= 4  # one record per part, each at its own offset
        begin, end = writer.write_snapshot(store, at=end)
        assert topic.end() == end
        kinds = [type(r) for _, r in topic.records()[begin:]]
        assert kinds[0] is SnapBegin and kinds[-1] is SnapEnd
        assert kinds[1:-1] == [SnapChunk] * (end - begin - 2) and end - begin - 2 > 1
        assert all(r.at == offset for offset, r in topic.records())


def test_a_record_without_at_is_valid_anywhere_and_one_with_at_only_there() -> None:
    (legacy,) = encode_delta(1, b"id", None, {b"k": b"v"}, StateMeta(seq=1), at=None)
    (placed,) = encode_delta(1, b"id", None, {b"k": b"v"}, StateMeta(seq=1), at=7)
    for offset in (0, 6, 7, 8):
        assert not is_void(decode_record(legacy), offset)
        assert is_void(decode_record(placed), offset) == (offset != 7)


def two_current_stores(
    tmp_path: Path, topic: MemoryTopic, commits: int, rng: random.Random, **writer_args: int
) -> tuple[QueueStateStore, QueueStateStore, Reference]:
    """Store A commits ``commits`` times; store B restores: both current at the same offset."""
    ref = Reference()
    a = QueueStateStore(tmp_path / "a", "job", "op", QUEUE).open()
    writer = ChangelogWriter(MemorySender(topic), TOPIC, QUEUE, **writer_args)
    for _ in range(commits):
        commit(a, writer, random_changes(rng, ref), ref, generation=1, writer="a")
    b = QueueStateStore(tmp_path / "b", "job", "op", QUEUE).open()
    assert ensure_current(b, topic)
    assert a.meta.log_end == b.meta.log_end == topic.end()
    assert dict(a.items()) == dict(b.items()) == ref.values
    return a, b, ref


def test_delta_conflict_voids_the_record_and_leaves_the_store_untouched(tmp_path: Path) -> None:
    rng = random.Random(2)
    topic = MemoryTopic()
    a, b, ref = two_current_stores(tmp_path, topic, 5, rng)
    x = topic.end()
    theirs = ref.copy()
    b_changes = random_changes(rng, theirs)

    def b_commits_first() -> None:
        commit(b, ChangelogWriter(MemorySender(topic), TOPIC, QUEUE), b_changes, theirs)

    before = snapshot_of(a)
    writer = ChangelogWriter(MemorySender(topic, {1: b_commits_first}), TOPIC, QUEUE)
    with pytest.raises(ChangelogConflictError, match=f"meant for offset {x} landed at {x + 1}"):
        commit(a, writer, {b"a-only": b"1", **random_changes(rng, ref.copy())})
    assert snapshot_of(a) == before
    assert reopened(a) == before
    # B's delta holds offset x; A's record is stored after it and void.
    assert topic.end() == x + 2
    assert topic.void_offsets() == [x + 1]
    voided = topic.records()[x + 1][1]
    assert isinstance(voided, Delta) and voided.at == x and voided.seq == 6
    assert [(o, r.seq) for o, r in topic.valid()[-1:]] == [(x, 6)]
    assert topic_seq(topic.admin, topic.reader, TOPIC, QUEUE) == 6
    values, meta = restored(tmp_path / "fresh", topic)
    assert values == theirs.values and b"a-only" not in values
    assert replace(meta, log_end=b.meta.log_end) == b.meta  # a restore reads the void too
    # A is behind; the engine's path (restore, then commit) lands where expected.
    assert not local_is_current(a, TOPIC, QUEUE, topic.admin)
    assert ensure_current(a, topic)
    assert same_state(a, b) and a.meta.log_end == topic.end()
    # The void record moved the queue's end: B, the winner, is behind too now.
    assert not local_is_current(b, TOPIC, QUEUE, topic.admin)
    commit(a, ChangelogWriter(MemorySender(topic), TOPIC, QUEUE), {b"after": b"2"}, theirs)
    assert restored(tmp_path / "fresh2", topic)[0] == theirs.values == dict(a.items())
    a.close()
    b.close()


@pytest.mark.parametrize("foreign_before_part", [1, 2, -1])
def test_split_delta_conflict_on_a_later_part(tmp_path: Path, foreign_before_part: int) -> None:
    """B restores after some of A's parts are stored (A's delta incomplete) and commits first."""
    rng = random.Random(3)
    topic = MemoryTopic()
    a, b, ref = two_current_stores(tmp_path, topic, 3, rng)
    x = topic.end()
    changes: dict[bytes, bytes | None] = {b"big-%d" % i: rng.randbytes(900) for i in range(6)}
    meta = replace(build_meta(a), snapshot_offset=a.meta.snapshot_offset)
    parts = len(encode_delta(4, b"id", None, changes, meta, max_body=2048, at=x))
    assert parts >= 4
    part = foreign_before_part % parts  # index of the part that loses the race
    theirs = ref.copy()
    b_changes = random_changes(rng, theirs)

    def b_restores_and_commits() -> None:
        # A's first parts are in the queue, so B is behind: it restores (without them).
        assert ensure_current(b, topic)
        assert b.meta.seq == 3
        commit(b, ChangelogWriter(MemorySender(topic), TOPIC, QUEUE), b_changes, theirs)

    before = snapshot_of(a)
    sender = MemorySender(topic, {part + 1: b_restores_and_commits})
    writer = ChangelogWriter(sender, TOPIC, QUEUE, max_body=2048, chunk_bytes=512)
    with pytest.raises(ChangelogConflictError):
        commit(a, writer, changes)
    # A's parts go out in one flush, so its parts after the race are sent too (void).
    assert sender.sends == parts
    assert snapshot_of(a) == before
    assert reopened(a) == before
    records = topic.records()
    # A's parts before the race are stored where they meant to be (valid but incomplete) ...
    assert [(o, r.part, r.parts, is_void(r, o)) for o, r in records[x : x + part]] == [
        (x + i, i, parts, False) for i in range(part)
    ]
    # ... then B's delta, then A's losing part and every part after it, all void.
    b_delta = records[x + part][1]
    assert isinstance(b_delta, Delta) and b_delta.seq == 4 and b_delta.at == x + part
    assert topic.void_offsets() == list(range(x + part + 1, x + parts + 1))
    assert topic.end() == x + parts + 1
    values, meta = restored(tmp_path / "fresh", topic)
    assert values == theirs.values
    assert not set(changes) & set(values)
    assert replace(meta, log_end=b.meta.log_end) == b.meta  # a restore reads the void too
    a.close()
    b.close()


def test_a_retried_send_stored_twice_voids_the_duplicate(tmp_path: Path) -> None:
    """The first part is stored twice: the copy is void, so is the part meant for its offset."""
    rng = random.Random(4)
    topic = MemoryTopic()
    ref = Reference()
    with QueueStateStore(tmp_path / "a", "job", "op", QUEUE) as a:
        writer = ChangelogWriter(MemorySender(topic), TOPIC, QUEUE)
        for _ in range(3):
            commit(a, writer, random_changes(rng, ref), ref)
        x = topic.end()
        before = snapshot_of(a)

        def stored_twice() -> None:
            topic.append(QUEUE, topic.bodies[QUEUE][-1])

        sender = MemorySender(topic, {2: stored_twice})
        split = ChangelogWriter(sender, TOPIC, QUEUE, max_body=2048, chunk_bytes=512)
        with pytest.raises(ChangelogConflictError):
            commit(a, split, {b"big": rng.randbytes(5_000)})
        assert snapshot_of(a) == before
        # The copy, and every later part of the same flush: each is one off its offset.
        assert topic.void_offsets() == list(range(x + 1, topic.end()))
        values, meta = restored(tmp_path / "fresh", topic)
        assert values == ref.values and b"big" not in values
        assert meta.seq == before[1].seq


def count_sends(tmp_path: Path, seed: int, snapshot_every: int, commits: int) -> list[type]:
    """The kinds of records the last of ``commits`` commits sends (a dry run)."""
    rng = random.Random(seed)
    topic = MemoryTopic()
    ref = Reference()
    with QueueStateStore(tmp_path, "job", "op", QUEUE) as store:
        for _ in range(commits):
            sender = MemorySender(topic)
            writer = ChangelogWriter(sender, TOPIC, QUEUE, snapshot_every, chunk_bytes=256)
            commit(store, writer, random_changes(rng, ref), ref)
        return sender.kinds


@pytest.mark.parametrize("loser", ["snap-begin", "first-chunk", "later-chunk", "snap-end"])
def test_snapshot_conflict_keeps_the_previous_snapshot(tmp_path: Path, loser: str) -> None:
    """A's delta of seq 6 lands, then B commits seq 7 in the middle of A's snapshot."""
    seed, snapshot_every = 5, 3
    kinds = count_sends(tmp_path / "dry", seed, snapshot_every, 6)
    assert kinds[:2] == [Delta, SnapBegin] and kinds[-1] is SnapEnd
    assert kinds.count(SnapChunk) >= 3
    send = {"snap-begin": 2, "first-chunk": 3, "later-chunk": 4, "snap-end": len(kinds)}[loser]

    rng = random.Random(seed)
    topic = MemoryTopic()
    ref = Reference()
    a = QueueStateStore(tmp_path / "a", "job", "op", QUEUE).open()
    for _ in range(5):
        writer = ChangelogWriter(MemorySender(topic), TOPIC, QUEUE, snapshot_every, chunk_bytes=256)
        commit(a, writer, random_changes(rng, ref), ref)
    complete = a.meta.snapshot_offset  # the snapshot of seq 3
    assert complete is not None
    x = topic.end()
    b = QueueStateStore(tmp_path / "b", "job", "op", QUEUE).open()

    def b_restores_and_commits() -> None:
        assert ensure_current(b, topic)
        assert b.meta.seq == 6 and b.meta.snapshot_offset == complete
        commit(b, ChangelogWriter(MemorySender(topic), TOPIC, QUEUE), {b"b": b"7"})

    sender = MemorySender(topic, {send: b_restores_and_commits})
    writer = ChangelogWriter(sender, TOPIC, QUEUE, snapshot_every, chunk_bytes=256)
    changes = random_changes(rng, ref)
    expected = ref.copy()
    expected.apply(changes)
    with pytest.raises(ChangelogConflictError):
        commit(a, writer, changes)
    # The delta was stored in place, so A committed seq 6 locally; the snapshot did
    # not complete, so A's meta still names the previous one and its log end is the
    # delta's: behind the queue, A restores before its next commit.
    assert dict(a.items()) == expected.values
    assert reopened(a)[1].seq == 6
    assert a.meta.snapshot_offset == complete
    assert a.meta.log_end == x + 1
    assert not local_is_current(a, TOPIC, QUEUE, topic.admin)
    # B's delta landed where A's losing record meant to; from there on, every
    # record of A's snapshot (sent in the same flush) is void.
    b_at = next(o for o, r in topic.records() if isinstance(r, Delta) and r.seq == 7)
    assert topic.void_offsets() == list(range(b_at + 1, topic.end()))
    assert topic.records()[b_at + 1][1].at == b_at
    # The only snap-end in the queue is the complete one's.
    ends = [r for _, r in topic.valid() if isinstance(r, SnapEnd)]
    assert [e.begin for e in ends] == [complete]
    expected.apply({b"b": b"7"})  # B's commit of seq 7, on top of A's seq 6
    values, meta = restored(tmp_path / "fresh", topic)
    assert values == expected.values
    assert replace(meta, log_end=b.meta.log_end) == b.meta  # a restore reads the void too
    assert meta.snapshot_offset == complete
    assert ensure_current(a, topic) and same_state(a, b)
    a.close()
    b.close()


def test_a_stale_writer_never_extends_the_history_until_it_restores(tmp_path: Path) -> None:
    """Every retry without a restore adds one void record and changes nothing locally."""
    rng = random.Random(6)
    topic = MemoryTopic()
    a, b, ref = two_current_stores(tmp_path, topic, 4, rng, snapshot_every=3)
    b_writer = ChangelogWriter(MemorySender(topic), TOPIC, QUEUE, snapshot_every=3)
    for _ in range(3):  # B takes over (seq 6 includes a snapshot)
        commit(b, b_writer, random_changes(rng, ref), ref, generation=2, writer="b")
    before = snapshot_of(a)
    assert before[1].seq == 4 and before[1].generation == 1
    a_writer = ChangelogWriter(MemorySender(topic), TOPIC, QUEUE, snapshot_every=3)
    for attempt in range(1, 4):
        end = topic.end()
        with pytest.raises(ChangelogConflictError):
            commit(a, a_writer, {b"stale": b"%d" % attempt}, generation=1, writer="a")
        assert topic.end() == end + 1 and topic.void_offsets()[-1] == end
        assert snapshot_of(a) == before
    assert len(topic.void_offsets()) == 3
    # The queue's valid history is B's: seqs 1..7 once each, the void records aside.
    seqs = [r.seq for _, r in topic.valid() if isinstance(r, Delta)]
    assert seqs == list(range(1, 8))
    assert topic_seq(topic.admin, topic.reader, TOPIC, QUEUE) == 7
    values, meta = restored(tmp_path / "fresh", topic)
    assert values == ref.values and b"stale" not in values
    assert (meta.generation, meta.writer) == (2, "b")
    # A restores and sees the newer owner (what check_owner fences on).
    assert ensure_current(a, topic)
    assert (a.meta.generation, a.meta.writer, a.meta.seq) == (2, "b", 7)
    a.close()
    b.close()


def test_a_void_tail_does_not_hide_the_latest_snapshot(tmp_path: Path) -> None:
    """The restore starts at the snapshot the last *valid* record names."""
    rng = random.Random(7)
    topic = MemoryTopic()
    a, stale, ref = two_current_stores(tmp_path, topic, 2, rng, snapshot_every=3)
    writer = ChangelogWriter(MemorySender(topic), TOPIC, QUEUE, snapshot_every=3)
    for _ in range(4):  # seq 3 and 6 take snapshots; the queue ends with a snap-end
        commit(a, writer, random_changes(rng, ref), ref)
    latest = a.meta.snapshot_offset
    assert latest is not None and isinstance(topic.records()[-1][1], SnapEnd)
    assert stale.meta.snapshot_offset is None  # stale's record names no snapshot at all
    with pytest.raises(ChangelogConflictError):
        commit(stale, ChangelogWriter(MemorySender(topic), TOPIC, QUEUE), {b"s": b"1"})
    assert topic.void_offsets() == [topic.end() - 1]
    assert topic_seq(topic.admin, topic.reader, TOPIC, QUEUE) == 6
    with QueueStateStore(tmp_path / "fresh", "job", "op", QUEUE) as fresh:
        result = restore_queue(fresh, TOPIC, QUEUE, topic.admin, topic.reader)
        assert (result.start_offset, result.snapshot_offset) == (latest, latest)
        assert result.messages_read == topic.end() - latest
        assert dict(fresh.items()) == ref.values
        # The same meta as the writer of seq 6, but current to the end, void record included.
        assert fresh.meta.log_end == topic.end() == a.meta.log_end + 1
        assert replace(fresh.meta, log_end=a.meta.log_end) == a.meta
    a.close()
    stale.close()


def test_meta_owner_fields_round_trip_and_version_1_still_reads() -> None:
    meta = StateMeta(seq=4, origins={1: (9, 0)}, generation=3, writer="inst-7", log_end=40)
    assert StateMeta.decode(meta.encode()) == meta
    (body,) = encode_delta(4, b"id", None, {}, meta, at=39)
    record = decode_record(body)
    assert isinstance(record, Delta) and record.meta == meta and record.at == 39
    v1 = {
        "v": 1,
        "seq": 2,
        "origins": {0: [5, 1]},
        "input_offset": 6,
        "watermark": {},
        "snapshot_offset": None,
        "extra": {"x": 1},
    }
    old = StateMeta.from_wire(v1)
    assert old == StateMeta(seq=2, origins={0: (5, 1)}, input_offset=6, extra={"x": 1})
    assert (old.generation, old.writer, old.log_end) == (0, "", None)


def test_a_store_that_comes_back_catches_up_on_the_deltas_written_since(tmp_path: Path) -> None:
    """Two executors take turns: each catches up on the other's deltas, never a full restore,
    and ends equal to the reference and to a store restored from scratch."""
    rng = random.Random(41)
    topic = MemoryTopic()
    ref = Reference()
    writer = ChangelogWriter(
        MemorySender(topic), TOPIC, QUEUE, snapshot_every=3, max_body=2048, chunk_bytes=700
    )
    with (
        QueueStateStore(tmp_path / "a", "job", "op", QUEUE) as a,
        QueueStateStore(tmp_path / "b", "job", "op", QUEUE) as b,
    ):
        outcomes = []
        for turn in range(12):
            store = (a, b)[turn % 2]
            result = state_ensure_current(store, QUEUE_OF, topic.admin, topic.reader)
            outcomes.append(None if result is None else result.caught_up)
            for _ in range(rng.randint(1, 3)):  # 1-3 batches on this executor
                commit(store, writer, random_changes(rng, ref, n=30), ref)
        # Turn 0 and 1 start fresh (nothing / a restore); every later turn catches up.
        assert outcomes[0] is None and outcomes[1] is False
        assert all(o is True for o in outcomes[2:]), outcomes
        last = (a, b)[11 % 2]
        assert dict(last.items()) == ref.values
        values, meta = restored(tmp_path / "fresh", topic)
        assert values == ref.values and meta.seq == last.meta.seq


def test_a_store_whose_tail_was_dropped_by_retention_restores_in_full(tmp_path: Path) -> None:
    rng = random.Random(43)
    topic = MemoryTopic()
    ref = Reference()
    writer = ChangelogWriter(MemorySender(topic), TOPIC, QUEUE, snapshot_every=3)
    with QueueStateStore(tmp_path / "a", "job", "op", QUEUE) as a:
        commit(a, writer, random_changes(rng, ref), ref)
        with QueueStateStore(tmp_path / "b", "job", "op", QUEUE) as b:
            state_ensure_current(b, QUEUE_OF, topic.admin, topic.reader)
            for _ in range(6):  # seq 2..7: snapshots after seq 3 and 6
                commit(b, writer, random_changes(rng, ref), ref)
            latest_snapshot = b.meta.snapshot_offset
        assert latest_snapshot is not None
        # The broker's retention drops everything before the latest snapshot.
        topic.min_offset = lambda queue: latest_snapshot  # type: ignore[method-assign]
        result = state_ensure_current(a, QUEUE_OF, topic.admin, topic.reader)
        assert result is not None and not result.caught_up
        assert result.start_offset == latest_snapshot
        assert dict(a.items()) == ref.values and a.meta.seq == 7
