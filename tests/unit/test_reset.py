"""Reset without a broker: time parsing, the plan, the state topic's empty snapshot, the guard.

The broker is a small in-memory fake (queues, store timestamps, committed offsets,
state-topic messages); state history is written by the real changelog writer into
it, and restores read it back through the real restore code. The Dagster checks
run on an ephemeral Dagster instance with run records made for the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import dagster as dg
import pytest

from stream_assets.control.allocation import allocate
from stream_assets.control.desired_state import DesiredState, DesiredStateStore
from stream_assets.control.reset import (
    EARLIEST,
    ResetRefusedError,
    apply_reset,
    format_time,
    parse_reset_time,
    plan_reset,
    wipe_local_stores,
)
from stream_assets.control.reset_guard import (
    WRITING_JOBS,
    SupervisionPause,
    active_runs,
    refusal_message,
)
from stream_assets.examples import wordcount
from stream_assets.jobs.instance_job import instance_job, instance_run_config, instance_run_tags
from stream_assets.jobs.reset import RESET_JOB
from stream_assets.jobs.scale import SCALE_JOB, scale_job
from stream_assets.resources import RocketMQResource, RocksDBStateStoreResource
from stream_assets.rocketmq.admin import MessageQueue, QueueOffsets, RocketMQAdmin
from stream_assets.rocketmq.errors import TopicNotFoundError
from stream_assets.rocketmq.reader import PullBatch, PullStatus, QueueReader
from stream_assets.rocketmq.records import Record, SendReceipt
from stream_assets.state import (
    ChangelogConflictError,
    ChangelogWriter,
    QueueStateStore,
    StateMeta,
    commit_with_changelog,
    ensure_current,
    restore_queue,
)
from stream_assets.state.paths import job_stores
from stream_assets.state.records import SnapBegin, SnapEnd, decode_record
from stream_assets.state.reset import append_empty_snapshot, inspect_state_queue
from tests.immediate import ImmediateSender

T0 = 1_763_735_400_000  # 2025-11-21T14:30:00Z
BROKER = "fake"


# -- time parsing -------------------------------------------------------------------


def test_reset_times_parse_as_epoch_ms_or_iso_with_an_offset() -> None:
    assert parse_reset_time("") == parse_reset_time(" earliest ") == EARLIEST
    assert parse_reset_time(str(T0)) == T0
    assert parse_reset_time("2025-11-21T14:30:00Z") == T0
    assert parse_reset_time("2025-11-21T15:30:00.250+01:00") == T0 + 250
    assert parse_reset_time("2025-11-21 14:30:00+00:00") == T0
    assert format_time(T0 + 5) == "2025-11-21T14:30:00.005Z"
    assert parse_reset_time(format_time(T0 + 5)) == T0 + 5


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("2025-11-21T14:30:00", "no UTC offset"),
        ("2025-11-21", "no UTC offset"),
        ("yesterday", "neither epoch milliseconds nor an ISO 8601 time"),
        ("1763735400", "epoch seconds"),
        ("-5", "neither"),
    ],
)
def test_bad_reset_times_say_what_was_wrong_and_what_to_give(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as info:
        parse_reset_time(text)
    assert "2025-11-21T14:30:00Z" in str(info.value) or "Z for UTC" in str(info.value)


# -- an in-memory broker ------------------------------------------------------------


class FakeBroker(ImmediateSender):
    """Topics with store timestamps, committed offsets per group, and a send path.

    Also the admin, reader and sender a reset needs (each cast at the call site).
    """

    def __init__(self) -> None:
        self.stamps: dict[tuple[str, int], list[int]] = {}  # store time of each message
        self.bodies: dict[tuple[str, int], list[bytes]] = {}
        self.queue_counts: dict[str, int] = {}
        self.committed: dict[tuple[str, str, int], int] = {}
        self.commits: list[tuple[str, str, int, int]] = []

    def topic(self, name: str, queues: int) -> None:
        self.queue_counts[name] = queues
        for q in range(queues):
            self.stamps[(name, q)] = []
            self.bodies[(name, q)] = []

    def put(self, name: str, queue_id: int, body: bytes, stamp: int = T0) -> int:
        self.stamps[(name, queue_id)].append(stamp)
        self.bodies[(name, queue_id)].append(body)
        return len(self.bodies[(name, queue_id)]) - 1

    def mq(self, name: str, queue_id: int) -> MessageQueue:
        return MessageQueue(name, BROKER, queue_id)

    # -- admin ---------------------------------------------------------------

    def get_kv(self, namespace: str, key: str) -> None:
        return None  # no stored layouts or records: one broker, queue index == queue id

    def topic_names(self) -> set[str]:
        return set(self.queue_counts)

    def topic_exists(self, topic: str) -> bool:
        return topic in self.queue_counts

    def queues(self, topic: str) -> list[MessageQueue]:
        if topic not in self.queue_counts:
            raise TopicNotFoundError(topic, "fake")
        return [self.mq(topic, q) for q in range(self.queue_counts[topic])]

    def min_offset(self, queue: MessageQueue) -> int:
        return 0

    def max_offset(self, queue: MessageQueue) -> int:
        return len(self.bodies[(queue.topic, queue.queue_id)])

    def topic_offsets(
        self, topic: str, queues: list[MessageQueue] | None = None
    ) -> dict[MessageQueue, QueueOffsets]:
        return {q: QueueOffsets(q, 0, self.max_offset(q)) for q in queues or self.queues(topic)}

    def group_offsets(
        self, group: str, topic: str, queues: list[MessageQueue] | None = None
    ) -> dict[MessageQueue, int | None]:
        wanted = queues if queues is not None else self.queues(topic)
        return {q: self.committed.get((group, topic, q.queue_id)) for q in wanted}

    def offset_for_timestamp(self, queue: MessageQueue, timestamp_ms: int) -> int:
        stamps = self.stamps[(queue.topic, queue.queue_id)]
        return next((i for i, s in enumerate(stamps) if s >= timestamp_ms), len(stamps))

    def commit_consumer_offsets(self, group: str, offsets: dict[MessageQueue, int]) -> None:
        for q, offset in offsets.items():
            self.committed[(group, q.topic, q.queue_id)] = offset
            self.commits.append((group, q.topic, q.queue_id, offset))

    # -- reader --------------------------------------------------------------

    def _record(self, queue: MessageQueue, offset: int) -> Record:
        body = self.bodies[(queue.topic, queue.queue_id)][offset]
        return Record(queue.topic, queue.queue_id, offset, body)

    def pull(self, queue: MessageQueue, offset: int, max_messages: int | None = None) -> PullBatch:
        end = self.max_offset(queue)
        stop = min(end, offset + (max_messages or 32))
        records = [self._record(queue, o) for o in range(offset, stop)]
        status = PullStatus.FOUND if records else PullStatus.NO_NEW_MESSAGES
        return PullBatch(queue, status, records, stop if records else offset, 0, end)

    def read(self, queue: MessageQueue, start: int, end: int | None = None) -> Iterator[Record]:
        stop = self.max_offset(queue) if end is None else end
        for offset in range(start, stop):
            yield self._record(queue, offset)

    # -- sender --------------------------------------------------------------

    def send_now(
        self, topic: str, body: bytes, *, key: str | None = None, queue_id: int | None = None
    ) -> SendReceipt:
        assert queue_id is not None
        return SendReceipt(topic, queue_id, self.put(topic, queue_id, body), "")

    @property
    def admin(self) -> RocketMQAdmin:
        return cast(RocketMQAdmin, self)

    @property
    def reader(self) -> QueueReader:
        return cast(QueueReader, self)


def write_history(
    broker: FakeBroker,
    root: Path,
    state_topic: str,
    queue_id: int,
    commits: int,
    generation: int = 2,
    snapshot_every: int = 3,
    max_body: int = 3_584 * 1024,
) -> QueueStateStore:
    """``commits`` commits to ``state_topic[queue_id]`` by the real writer; the (open) store."""
    writer = ChangelogWriter(
        broker,
        state_topic,
        queue_id,
        snapshot_every=snapshot_every,
        max_body=max_body,
        chunk_bytes=max_body // 2,
    )
    store = QueueStateStore(root, "job", "op", queue_id).open()
    for i in range(1, commits + 1):
        meta = store.next_meta()
        meta.origins = {0: (i * 10, 0), 1: (i * 7, 2)}
        meta.watermark = {"version": 2, "origins": {"0": {"max": T0 + i}}}
        meta.extra = {"closed": T0}
        meta.generation, meta.writer = generation, f"inst-g{generation}"
        changes: dict[bytes, bytes | None] = {b"word-%d" % (i % 4): b"%d" % i, b"big": bytes(i)}
        commit_with_changelog(store, changes, meta, writer)
    return store


def assert_restores_empty(broker: FakeBroker, root: Path, queue: MessageQueue) -> StateMeta:
    with QueueStateStore(root, "job", "op", queue.queue_id) as store:
        restore_queue(store, queue.topic, queue.queue_id, broker.admin, broker.reader)
        assert dict(store.items()) == {}
        meta = store.meta
    assert meta.origins == {} and meta.watermark == {} and meta.extra == {}
    assert meta.log_end == broker.max_offset(queue)
    return meta


# -- the state topic's empty snapshot ------------------------------------------------


def test_an_empty_snapshot_makes_every_store_restore_to_empty(tmp_path: Path) -> None:
    broker = FakeBroker()
    broker.topic("st", 2)
    queue = broker.mq("st", 1)
    current = write_history(broker, tmp_path / "current", "st", 1, commits=7)
    # Another executor's store, left behind two commits ago: it would normally catch up.
    behind = QueueStateStore(tmp_path / "behind", "job", "op", 1).open()
    ensure_current(behind, queue, broker.admin, broker.reader)
    writer = ChangelogWriter(broker, "st", 1, snapshot_every=3)
    for i in (8, 9):
        meta = current.next_meta()
        meta.origins, meta.generation, meta.writer = {0: (i * 10, 0)}, 2, "inst-g2"
        commit_with_changelog(current, {b"late": b"%d" % i}, meta, writer)
    head = inspect_state_queue(broker.admin, broker.reader, queue)
    assert (head.seq, head.generation, head.writer, head.empty) == (9, 2, "inst-g2", False)
    assert head.end == broker.max_offset(queue) and head.snapshot == current.meta.snapshot_offset

    done = append_empty_snapshot(queue, head, broker, writer="reset:test", index=queue.queue_id)
    assert (done.begin, done.end, done.seq, done.generation) == (head.end, head.end + 2, 10, 2)
    kinds = [type(decode_record(b)) for b in broker.bodies[("st", 1)][done.begin :]]
    assert kinds == [SnapBegin, SnapEnd]
    meta = assert_restores_empty(broker, tmp_path / "fresh", queue)
    assert (meta.seq, meta.generation, meta.writer, meta.snapshot_offset) == (
        10,
        2,
        "reset:test",
        done.begin,
    )
    # Stores that held the old history: the current one and the one that could have
    # caught up both restore in full, to empty (a catch-up would have kept old values).
    for store in (current, behind):
        result = ensure_current(store, queue, broker.admin, broker.reader)
        assert result is not None and not result.caught_up
        assert dict(store.items()) == {} and store.meta.origins == {} and store.meta.seq == 10
        store.close()
    # Life goes on: a commit after the reset, then a store that saw the reset catches up.
    with QueueStateStore(tmp_path / "next", "job", "op", 1) as first:
        ensure_current(first, queue, broker.admin, broker.reader)
        with QueueStateStore(tmp_path / "follower", "job", "op", 1) as follower:
            ensure_current(follower, queue, broker.admin, broker.reader)
            meta = first.next_meta()
            meta.origins, meta.writer = {0: (3, 0)}, "new"
            commit_with_changelog(first, {b"again": b"1"}, meta, ChangelogWriter(broker, "st", 1))
            result = ensure_current(follower, queue, broker.admin, broker.reader)
            assert result is not None and result.caught_up
            assert dict(follower.items()) == {b"again": b"1"}
            assert follower.meta.origins == {0: (3, 0)} and follower.meta.seq == 11


def test_an_empty_snapshot_that_lost_the_race_is_void_and_changes_nothing(tmp_path: Path) -> None:
    broker = FakeBroker()
    broker.topic("st", 1)
    queue = broker.mq("st", 0)
    store = write_history(broker, tmp_path / "a", "st", 0, commits=2)
    head = inspect_state_queue(broker.admin, broker.reader, queue)
    meta = store.next_meta()
    commit_with_changelog(store, {b"k": b"v"}, meta, ChangelogWriter(broker, "st", 0))
    with pytest.raises(ChangelogConflictError):
        append_empty_snapshot(queue, head, broker, writer="reset:test", index=queue.queue_id)
    with QueueStateStore(tmp_path / "fresh", "job", "op", 0) as fresh:
        restore_queue(fresh, "st", 0, broker.admin, broker.reader)
        assert dict(fresh.items()) == dict(store.items()) and fresh.meta.seq == 3
    store.close()


def test_a_reset_cut_short_after_its_first_record_restores_the_old_state(tmp_path: Path) -> None:
    broker = FakeBroker()
    broker.topic("st", 1)
    queue = broker.mq("st", 0)
    store = write_history(broker, tmp_path / "a", "st", 0, commits=5, snapshot_every=2)
    head = inspect_state_queue(broker.admin, broker.reader, queue)
    append_empty_snapshot(queue, head, broker, writer="reset:test", index=queue.queue_id)
    del broker.bodies[("st", 0)][-1]  # the snapshot's end never arrived
    del broker.stamps[("st", 0)][-1]
    with QueueStateStore(tmp_path / "fresh", "job", "op", 0) as fresh:
        restore_queue(fresh, "st", 0, broker.admin, broker.reader)
        assert dict(fresh.items()) == dict(store.items()) and fresh.meta.seq == 5
    store.close()


def test_the_owner_is_read_from_split_deltas_and_snapshot_ends(tmp_path: Path) -> None:
    broker = FakeBroker()
    broker.topic("st", 2)
    # Queue 0 ends with a delta in parts (bodies of at most 2 KiB), queue 1 with a snapshot.
    write_history(broker, tmp_path / "a", "st", 0, 4, generation=5, max_body=2048).close()
    writer = ChangelogWriter(broker, "st", 0, max_body=2048, chunk_bytes=1024)
    with QueueStateStore(tmp_path / "a", "job", "op", 0) as store:
        meta = store.next_meta()
        meta.generation, meta.writer = 6, "split"
        commit_with_changelog(store, {b"huge": bytes(6000)}, meta, writer)
    last = decode_record(broker.bodies[("st", 0)][-1])
    assert last.written_seq == 5 and getattr(last, "parts", 1) > 1
    head = inspect_state_queue(broker.admin, broker.reader, broker.mq("st", 0))
    assert (head.seq, head.generation, head.writer) == (5, 6, "split")
    write_history(broker, tmp_path / "b", "st", 1, 3, generation=4, snapshot_every=3).close()
    assert isinstance(decode_record(broker.bodies[("st", 1)][-1]), SnapEnd)
    head = inspect_state_queue(broker.admin, broker.reader, broker.mq("st", 1))
    assert (head.seq, head.generation, head.empty) == (3, 4, False)
    broker.topic("empty", 1)
    head = inspect_state_queue(broker.admin, broker.reader, broker.mq("empty", 0))
    assert head.empty and head.seq == 0 and head.end == 0


# -- the plan ------------------------------------------------------------------------


@pytest.fixture
def deployed(tmp_path: Path) -> tuple[FakeBroker, Any, Path]:
    """WordCount as if it had run: 2 source queues, 2 shuffle/state queues, local stores."""
    topology = wordcount.build("rs-wc", "rs-src", "rs-out")
    (shuffle,), (state,) = topology.shuffle_topics, topology.state_topics
    broker = FakeBroker()
    broker.topic("rs-src", 2)
    broker.topic(shuffle, 2)
    broker.topic(state, 2)
    for i in range(10):  # queue 0: one message a second from T0; queue 1: from T0 + 4.5 s
        broker.put("rs-src", 0, b"a b", T0 + 1000 * i)
        broker.put("rs-src", 1, b"c", T0 + 4500 + 1000 * i)
    for q in range(2):
        for _ in range(6 + q):
            broker.put(shuffle, q, b"shuffled")
    broker.committed[("rs-wc", "rs-src", 0)] = 10
    broker.committed[("rs-wc-planned", "rs-src", 0)] = 10
    broker.committed[("rs-wc", shuffle, 0)] = 6
    root = tmp_path / "state"
    write_history(broker, tmp_path / "writer", state, 0, commits=4).close()
    op = state.removeprefix("rs-wc__state__")
    for q in range(2):
        with QueueStateStore(root, "rs-wc", op, q) as local:
            local.commit({b"x": b"1"}, local.next_meta())
    return broker, topology, root


def test_the_plan_names_every_offset_before_and_after(
    deployed: tuple[FakeBroker, Any, Path],
) -> None:
    broker, topology, root = deployed
    (shuffle,), (state,) = topology.shuffle_topics, topology.state_topics
    plan = plan_reset(topology, T0 + 3000, broker.admin, broker.reader, state_root=root)
    source, shuffled = plan.topics
    assert (source.topic, source.role, shuffled.topic, shuffled.role) == (
        "rs-src",
        "source",
        shuffle,
        "shuffle",
    )
    moves = {(m.group, m.queue.queue_id): (m.current, m.new) for m in source.moves}
    # Queue 0: the message stored at T0 + 3 s is offset 3; queue 1 starts after it: offset 0.
    assert moves == {
        ("rs-wc", 0): (10, 3),
        ("rs-wc", 1): (None, 0),
        ("rs-wc-planned", 0): (10, 3),
        ("rs-wc-planned", 1): (None, 0),
    }
    assert [(m.group, m.current, m.new) for m in shuffled.moves] == [
        ("rs-wc", 6, 6),
        ("rs-wc", None, 7),
    ]
    assert [(h.queue.queue_id, h.empty, h.seq) for h in plan.state] == [(0, False, 4), (1, True, 0)]
    assert [s.queue_id for s in plan.local_stores] == [0, 1] and not plan.held_stores
    text = plan.describe()
    for expected in (
        "Reset of topology 'rs-wc' (consumer group 'rs-wc') to 2025-11-21T14:30:03.000Z",
        "1. source topic rs-src: each queue to its first message stored at or after that time",
        "queue 0: 10 -> 3 (replays 7)",
        "queue 1: not committed -> 0",
        f"2. shuffle topic {shuffle}: each queue to its end",
        f"3. state topic {state}: an empty snapshot appended",
        "queue 0: ends at offset",
        "queue 1: empty already, nothing to write",
        f"4. local stores under {root / 'rs-wc'}: 2 wiped",
    ):
        assert expected in text, f"{expected!r} not in:\n{text}"
    earliest = plan_reset(topology, EARLIEST, broker.admin, broker.reader)
    assert {m.new for m in earliest.topics[0].moves} == {0}
    assert "to the earliest offsets" in earliest.describe()
    assert "local stores: not touched" in earliest.describe()
    future = plan_reset(topology, T0 + 10**11, broker.admin, broker.reader)
    assert {m.new for m in future.topics[0].moves} == {10}
    assert "the time is in the future" in future.describe()


def test_apply_commits_the_plan_empties_the_state_and_wipes_local_stores(
    deployed: tuple[FakeBroker, Any, Path], tmp_path: Path
) -> None:
    broker, topology, root = deployed
    (shuffle,), (state,) = topology.shuffle_topics, topology.state_topics
    plan = plan_reset(topology, T0 + 3000, broker.admin, broker.reader, state_root=root)
    lines: list[str] = []
    result = apply_reset(plan, broker.admin, sender=broker, progress=lines.append)
    assert broker.committed[("rs-wc", "rs-src", 0)] == 3
    assert broker.committed[("rs-wc-planned", "rs-src", 1)] == 0
    assert broker.committed[("rs-wc", shuffle, 1)] == 7
    assert result.offsets_committed == len(broker.commits) == 6
    assert [s.queue.queue_id for s in result.snapshots] == [0]
    assert broker.max_offset(broker.mq(state, 1)) == 0  # an empty queue gets nothing
    meta = assert_restores_empty(broker, tmp_path / "fresh", broker.mq(state, 0))
    assert meta.seq == 5 and meta.generation == 2
    assert [p.exists() for p in result.wiped] == [False, False] and len(result.wiped) == 2
    assert job_stores(root, "rs-wc") == []
    assert any(line.startswith("source topic rs-src: committed 4 offsets") for line in lines)
    assert any(line.startswith(f"state topic {state}: empty snapshot") for line in lines)
    assert "6 offsets committed, 1 state queues emptied, 2 local stores wiped" in result.describe()


def test_apply_refuses_and_changes_nothing_when_something_moved_since_the_plan(
    deployed: tuple[FakeBroker, Any, Path],
) -> None:
    broker, topology, root = deployed
    (shuffle,), (state,) = topology.shuffle_topics, topology.state_topics
    plan = plan_reset(topology, EARLIEST, broker.admin, broker.reader, state_root=root)
    ends = {q: broker.max_offset(broker.mq(state, q)) for q in range(2)}
    broker.committed[("rs-wc", shuffle, 0)] = 7  # an instance committed a batch
    broker.put(shuffle, 1, b"more")  # and stage 0 sent to the shuffle
    with pytest.raises(ResetRefusedError, match="changed since the plan") as info:
        apply_reset(plan, broker.admin, sender=broker)
    assert f"offset of 'rs-wc' on {shuffle}[0]: 6 -> 7" in str(info.value)
    assert f"end of {shuffle}[1]: 7 -> 8" in str(info.value)
    assert "Nothing was changed" in str(info.value)
    assert broker.commits == []
    assert {q: broker.max_offset(broker.mq(state, q)) for q in range(2)} == ends
    assert len(job_stores(root, "rs-wc")) == 2


def test_a_local_store_open_in_another_process_refuses_the_reset(
    deployed: tuple[FakeBroker, Any, Path],
) -> None:
    broker, topology, root = deployed
    stores = job_stores(root, "rs-wc")
    # RocksDB refuses a second open, as for another process
    with QueueStateStore.at(stores[1]) as held:
        plan = plan_reset(topology, EARLIEST, broker.admin, broker.reader, state_root=root)
        assert plan.held_stores == (stores[1],)
        assert f"refused: local store {stores[1].path} is open" in plan.describe()
        with pytest.raises(ResetRefusedError, match="open in another process"):
            apply_reset(plan, broker.admin, sender=broker)
        with pytest.raises(ResetRefusedError, match="stop it first"):
            wipe_local_stores(stores)
        assert held.is_open and broker.commits == []
    assert all(s.path.is_dir() for s in stores)


def test_a_topology_that_never_ran_has_nothing_but_its_source_to_reset() -> None:
    topology = wordcount.build("rs-new", "rs-new-src", "rs-new-out")
    broker = FakeBroker()
    with pytest.raises(ValueError, match=r"source topic 'rs-new-src' .* does not exist"):
        plan_reset(topology, EARLIEST, broker.admin, broker.reader)
    broker.topic("rs-new-src", 1)
    plan = plan_reset(topology, EARLIEST, broker.admin, broker.reader)
    assert [t.role for t in plan.topics] == ["source"] and plan.state == ()
    assert set(plan.missing_topics) == {*topology.shuffle_topics, *topology.state_topics}
    assert "does not exist yet: nothing to reset there" in plan.describe()


# -- the Dagster guard ----------------------------------------------------------------


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def _started(instance: dg.DagsterInstance, run: dg.DagsterRun) -> dg.DagsterRun:
    instance.handle_new_event(
        dg.EventLogEntry(
            error_info=None,
            level="DEBUG",
            user_message="",
            run_id=run.run_id,
            timestamp=0.0,
            dagster_event=dg.DagsterEvent(
                event_type_value=dg.DagsterEventType.RUN_START.value, job_name=run.job_name
            ),
        )
    )
    started = instance.get_run_by_id(run.run_id)
    assert started is not None
    return started


def test_runs_of_the_topology_are_found_and_named_in_the_refusal(
    instance: dg.DagsterInstance,
) -> None:
    share = {"rs-src": [0, 1]}
    inst = _started(
        instance,
        instance.create_run_for_job(
            instance_job,
            run_config=instance_run_config("rs-wc", 3, 0, share),
            tags=instance_run_tags("rs-wc", 3, 0, share),
        ),
    )
    # A scale run launched by hand carries no tag, only its config.
    scale = instance.create_run_for_job(
        scale_job,
        run_config={"ops": {"scale": {"config": {"topology": "rs-wc", "target_instances": 2}}}},
    )
    other = instance.create_run_for_job(
        instance_job,
        run_config=instance_run_config("other", 0, 0, share),
        tags=instance_run_tags("other", 0, 0, share),
    )
    runs = active_runs(instance, "rs-wc")
    assert [r.run_id for r in runs] == [inst.run_id, scale.run_id]
    assert (
        runs[0].describe() == f"instance_job run {inst.run_id} (STARTED, instance 0, generation 3)"
    )
    assert [r.run_id for r in active_runs(instance, "rs-wc", exclude_run_id=scale.run_id)] == [
        inst.run_id
    ]
    assert [r.run_id for r in active_runs(instance, "other")] == [other.run_id]
    message = refusal_message("rs-wc", runs, "do this")
    assert message.startswith("refusing to reset rs-wc: 2 runs still run it: instance_job run ")
    assert inst.run_id in message and scale.run_id in message
    assert message.endswith("Stop them first (do this). Nothing was changed.")
    # Finished runs no longer count.
    instance.report_run_canceled(instance.get_run_by_id(inst.run_id))  # type: ignore[arg-type]
    instance.report_run_failed(instance.get_run_by_id(scale.run_id))  # type: ignore[arg-type]
    assert active_runs(instance, "rs-wc") == []
    assert SCALE_JOB in WRITING_JOBS and RESET_JOB in WRITING_JOBS


def test_supervision_is_paused_then_restored_or_resumed(instance: dg.DagsterInstance) -> None:
    store = DesiredStateStore(instance)
    deployed = DesiredState(2, allocate({"rs-src": [0, 1]}, 2))
    store.set("rs-wc", deployed)
    said: list[str] = []
    pause = SupervisionPause(instance, "rs-wc", said.append)
    pause.pause()
    paused = store.get("rs-wc")
    assert paused is not None and paused.paused and paused.allocation == deployed.allocation
    pause.restore()
    assert store.get("rs-wc") == deployed
    pause.pause()
    pause.resume()
    assert store.get("rs-wc") == deployed
    assert "paused supervision of rs-wc" in said[0] and "resumed supervision" in said[-1]
    assert "stays paused" in pause.left_paused()
    # A reset left paused by a failure: the next one resumes it when it completes.
    store.set("rs-wc", DesiredState(2, deployed.allocation, paused=True))
    again = SupervisionPause(instance, "rs-wc")
    again.pause()
    again.resume()
    assert store.get("rs-wc") == deployed
    # Never deployed: nothing to pause or resume.
    never = SupervisionPause(instance, "nothing")
    never.pause()
    never.resume()
    assert store.get("nothing") is None and "incomplete: run it again" in never.left_paused()


class _NoBroker:
    """Stands in for RocketMQAdmin and QueueReader: the job's broker work is faked below."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __enter__(self) -> _NoBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass


def _run_reset_job(
    instance: dg.DagsterInstance,
    tmp_path: Path,
    config: dict[str, Any],
    applied: list[Any],
    error: Exception | None = None,
) -> dg.ExecuteInProcessResult:
    """The real reset job with planning and applying faked (they are tested above)."""
    import stream_assets.jobs.reset as module

    plan = type(
        "Plan", (), {"describe": lambda self: "the plan", "target_text": "the earliest offsets"}
    )()
    outcome = type(
        "Result",
        (),
        {
            "describe": lambda self: "done",
            "offsets_committed": 6,
            "snapshots": (1, 2),
            "wiped": (),
            "seconds": 0.5,
        },
    )()

    def apply(*args: object, **kwargs: object) -> Any:
        # What the supervisor sees while the reset is applied.
        applied.append(DesiredStateStore(instance).get("wordcount"))
        if error is not None:
            raise error
        return outcome

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "RocketMQAdmin", _NoBroker)
        patch.setattr(module, "QueueReader", _NoBroker)
        patch.setattr(module, "plan_reset", lambda *a, **k: plan)
        patch.setattr(module, "apply_reset", apply)
        return module.reset_job.execute_in_process(
            run_config={"ops": {"reset": {"config": {"topology": "wordcount", **config}}}},
            instance=instance,
            resources={
                "rocketmq": RocketMQResource(),
                "state_store": RocksDBStateStoreResource(root_dir=str(tmp_path)),
            },
            raise_on_error=False,
        )


def test_the_reset_job_refuses_naming_the_runs_and_changes_nothing(
    instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    share = {"sourceTopic": [0]}
    run = _started(
        instance,
        instance.create_run_for_job(
            instance_job,
            run_config=instance_run_config("wordcount", 1, 0, share),
            tags=instance_run_tags("wordcount", 1, 0, share),
        ),
    )
    deployed = DesiredState(1, allocate(share, 1))
    DesiredStateStore(instance).set("wordcount", deployed)
    applied: list[Any] = []
    result = _run_reset_job(instance, tmp_path, {}, applied)
    assert not result.success and applied == []
    failure = next(e for e in result.all_events if e.is_step_failure)
    text = str(failure.step_failure_data.error)
    assert f"instance_job run {run.run_id} (STARTED, instance 0, generation 1)" in text
    assert "stop_instances: true" in text and "Nothing was changed" in text
    # Supervision is as it was: the refusal changed nothing.
    assert DesiredStateStore(instance).get("wordcount") == deployed
    # A dry run only shows the plan (and that it would be refused).
    result = _run_reset_job(instance, tmp_path, {"dry_run": True}, applied)
    assert result.success and applied == []


def test_the_reset_job_pauses_supervision_while_it_applies_then_resumes_it(
    instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    deployed = DesiredState(1, allocate({"sourceTopic": [0]}, 1))
    DesiredStateStore(instance).set("wordcount", deployed)
    applied: list[Any] = []
    result = _run_reset_job(instance, tmp_path, {"to_time": "2025-11-21T14:30:00Z"}, applied)
    assert result.success
    assert applied == [DesiredState(1, deployed.allocation, paused=True)]
    assert DesiredStateStore(instance).get("wordcount") == deployed
    output = next(e for e in result.all_events if e.event_type_value == "STEP_OUTPUT")
    metadata = output.step_output_data.metadata
    assert metadata["offsets_committed"].value == 6 and metadata["runs_stopped"].value == 0
    assert metadata["state_queues_emptied"].value == 2
    bad = _run_reset_job(instance, tmp_path, {"to_time": "2025-11-21 14:30"}, applied)
    assert not bad.success and len(applied) == 1


def test_a_reset_job_that_fails_part_way_leaves_supervision_paused(
    instance: dg.DagsterInstance, tmp_path: Path
) -> None:
    deployed = DesiredState(1, allocate({"sourceTopic": [0]}, 1))
    DesiredStateStore(instance).set("wordcount", deployed)
    applied: list[Any] = []
    result = _run_reset_job(
        instance, tmp_path, {}, applied, error=ChangelogConflictError("someone appended")
    )
    assert not result.success and len(applied) == 1
    failure = next(e for e in result.all_events if e.is_step_failure)
    text = str(failure.step_failure_data.error)
    assert "the reset failed part-way: someone appended" in text
    assert "stays paused" in text and "run the reset again" in text
    assert DesiredStateStore(instance).get("wordcount") == DesiredState(
        1, deployed.allocation, paused=True
    )
    # Run again: it completes and resumes supervision.
    assert _run_reset_job(instance, tmp_path, {}, applied).success
    assert DesiredStateStore(instance).get("wordcount") == deployed
