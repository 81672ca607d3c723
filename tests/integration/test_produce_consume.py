"""Produce from two processes, read every queue back, and check it all against the input.

100k messages with 1k distinct keys go to an 8-queue topic from two separate
producer processes (each with several threads, one Producer per thread; see
``_producer_worker``). Everything expected is recomputed here from the message
index: the body bytes, the key, the key's queue (an MD5 reference written in
this file, not :mod:`stream_assets.rocketmq.hashing`).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.settings import PROJECT_ROOT, RocketMQSettings
from tests.integration._producer_worker import (
    DISTINCT_KEYS,
    body_for,
    extras_for,
    index_of,
    key_for,
    key_index,
)
from tests.integration._util import wait_for

pytestmark = pytest.mark.integration

TOTAL = 100_000
QUEUES = 8
PROCESSES = 2
THREADS_PER_PROCESS = 4
PRODUCE_TIMEOUT_S = 180.0
# Same host, same clock: the broker stores a message after the client stamps it.
CLOCK_SKEW_MS = 50


def reference_queue(key: str, queue_count: int) -> int:
    """Independent reference: MD5 of the UTF-8 key, first 4 bytes big-endian, 31 bits, mod n."""
    digest = hashlib.md5(key.encode("utf-8")).digest()
    return (int.from_bytes(digest[:4], "big") & 0x7FFFFFFF) % queue_count


@dataclass
class Produced:
    topic: str
    queues: list[MessageQueue]
    # queue id -> records in the order read
    read: dict[int, list[Record]]
    # index -> (queue id, queue offset, msg id) as the producer's receipt said
    receipts: dict[int, tuple[int, int, str]]
    started_ms: int
    finished_ms: int


@pytest.fixture(scope="module")
def produced(
    client_settings: RocketMQSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Produced]:
    topic = f"it-pc-{uuid.uuid4().hex}"
    out_dir = tmp_path_factory.mktemp("producers")
    with RocketMQAdmin(client_settings) as admin:
        admin.create_topic(topic, queues=QUEUES)
        started_ms = int(time.time() * 1000)
        procs: list[tuple[subprocess.Popen[str], Path]] = []
        for p in range(PROCESSES):
            out = out_dir / f"receipts-{p}.txt"
            spec = {
                "namesrv": client_settings.namesrv_addr,
                "topic": topic,
                "total": TOTAL,
                "processes": PROCESSES,
                "process": p,
                "threads": THREADS_PER_PROCESS,
                "out": str(out),
            }
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration._producer_worker", json.dumps(spec)],
                cwd=PROJECT_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            procs.append((proc, out))
        receipts: dict[int, tuple[int, int, str]] = {}
        pids: set[int] = set()
        try:
            for proc, out in procs:
                _, stderr = proc.communicate(timeout=PRODUCE_TIMEOUT_S)
                assert proc.returncode == 0, f"producer process failed:\n{stderr}"
                pids.add(proc.pid)
                for line in out.read_text().splitlines():
                    i, q, off, msg_id = json.loads(line)
                    assert int(i) not in receipts, f"index {i} was sent twice"
                    receipts[int(i)] = (int(q), int(off), msg_id)
        finally:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        finished_ms = int(time.time() * 1000)
        assert len(pids) == PROCESSES
        assert sorted(receipts) == list(range(TOTAL)), "the producers did not send every index"

        queues = admin.queues(topic)
        # The broker indexes stored messages asynchronously; wait until every
        # sent message is visible in the queues' max offsets.
        wait_for(
            lambda: sum(admin.max_offset(q) for q in queues) >= TOTAL,
            30.0,
            f"{TOTAL} messages to be visible in {topic}",
        )
        reader = QueueReader(admin, group=f"it-pc-reader-{uuid.uuid4().hex[:8]}")
        try:
            read = {q.queue_id: list(reader.read(q, 0)) for q in queues}
        finally:
            reader.close()
    yield Produced(topic, queues, read, receipts, started_ms, finished_ms)


def test_topic_has_the_requested_queues(produced: Produced) -> None:
    assert [q.queue_id for q in produced.queues] == list(range(QUEUES))
    assert all(q.topic == produced.topic for q in produced.queues)


def test_every_message_read_exactly_once_with_dense_offsets(produced: Produced) -> None:
    seen: dict[int, int] = defaultdict(int)
    for qid, records in produced.read.items():
        assert [r.queue_offset for r in records] == list(range(len(records))), (
            f"queue {qid}: offsets are not 0..n-1 in order"
        )
        assert all(r.queue_id == qid and r.topic == produced.topic for r in records)
        for r in records:
            seen[index_of(r.body)] += 1
    assert sum(len(rs) for rs in produced.read.values()) == TOTAL
    assert sorted(seen) == list(range(TOTAL)), "some messages are missing or foreign"
    duplicates = {i: n for i, n in seen.items() if n != 1}
    assert not duplicates, f"messages read more than once: {list(duplicates.items())[:10]}"


def test_bodies_are_byte_identical(produced: Produced) -> None:
    mismatched = [
        (qid, r.queue_offset)
        for qid, records in produced.read.items()
        for r in records
        if r.body != body_for(index_of(r.body))
    ]
    assert not mismatched, f"{len(mismatched)} bodies differ, first at {mismatched[:5]}"
    # The generated bodies really exercise the awkward bytes.
    sample = produced.read[0][0].body
    assert b"\x00" in sample and b"\xff" in sample
    with pytest.raises(UnicodeDecodeError):
        sample.decode("utf-8")


def test_keys_land_on_their_md5_queue_from_both_processes(produced: Produced) -> None:
    # key -> process (index parity) -> queues it was read from
    placements: dict[str, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for qid, records in produced.read.items():
        for r in records:
            i = index_of(r.body)
            expected_key = key_for(key_index(i))
            assert r.keys == (expected_key,), f"message {i}: keys {r.keys!r}"
            placements[expected_key][i % PROCESSES].add(qid)
    assert len(placements) == DISTINCT_KEYS
    wrong = {}
    for key, by_process in placements.items():
        assert sorted(by_process) == list(range(PROCESSES)), f"key {key!r} not sent by both"
        expected = {reference_queue(key, QUEUES)}
        if any(queues != expected for queues in by_process.values()):
            wrong[key] = ({p: sorted(q) for p, q in by_process.items()}, expected)
    assert not wrong, f"{len(wrong)} keys on the wrong queue(s), e.g. {list(wrong.items())[:5]}"
    # With 1k keys over 8 queues the reference spreads them over every queue.
    assert all(produced.read[q] for q in range(QUEUES))


def test_per_sender_order_is_kept_within_each_queue(produced: Produced) -> None:
    # One sender thread sends its indexes in increasing order with sync sends,
    # so within a queue its messages must appear in that order.
    for qid, records in produced.read.items():
        last: dict[tuple[int, int], int] = {}
        for r in records:
            i = index_of(r.body)
            sender = (i % PROCESSES, (i // PROCESSES) % THREADS_PER_PROCESS)
            assert last.get(sender, -1) < i, f"queue {qid}: sender {sender} out of order at {i}"
            last[sender] = i


def test_receipts_name_where_each_message_was_stored(produced: Produced) -> None:
    for qid, records in produced.read.items():
        for r in records:
            i = index_of(r.body)
            assert produced.receipts[i] == (qid, r.queue_offset, r.msg_id), f"message {i}"


def test_tags_and_properties_round_trip(produced: Produced) -> None:
    checked = 0
    for records in produced.read.values():
        for r in records:
            i = index_of(r.body)
            tags, props = extras_for(i)
            if tags is None:
                assert r.tags is None
                assert "idx" not in r.properties
                continue
            assert props is not None
            assert r.tags == tags
            for name, value in props.items():
                assert r.properties.get(name) == value, f"message {i}: property {name!r}"
            checked += 1
    assert checked == len(range(0, TOTAL, 997))


def test_timestamps_are_sane(produced: Produced) -> None:
    low = produced.started_ms - CLOCK_SKEW_MS
    high = produced.finished_ms + CLOCK_SKEW_MS
    for qid, records in produced.read.items():
        for r in records:
            assert low <= r.born_timestamp <= high, f"queue {qid}@{r.queue_offset}: born"
            assert low <= r.store_timestamp <= high, f"queue {qid}@{r.queue_offset}: store"
            assert r.store_timestamp >= r.born_timestamp - CLOCK_SKEW_MS
        stores = [r.store_timestamp for r in records]
        # One broker appends a queue in store order.
        assert stores == sorted(stores), f"queue {qid}: store timestamps go backwards"


def test_nul_and_0xff_body_round_trips(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = f"it-nul-{uuid.uuid4().hex}"
    admin.create_topic(topic, queues=2)
    bodies = [
        b"\x00",
        b"\xff",
        b"ab\x00cd\xff",
        b"\x00" * 64,
        b"\xff\xfe\x00\x01\x80\xc0\xc1" + bytes(range(256)),
    ]
    with Producer(client_settings) as producer:
        receipts = [producer.send(topic, b, queue_id=1) for b in bodies]
    assert [r.queue_id for r in receipts] == [1] * len(bodies)
    assert [r.queue_offset for r in receipts] == list(range(len(bodies)))
    queue = MessageQueue(topic, admin.queues(topic)[1].broker_name, 1)
    wait_for(lambda: admin.max_offset(queue) == len(bodies), 10.0, "the messages to be indexed")
    reader = QueueReader(admin, group="it-nul-reader")
    try:
        records = list(reader.read(queue, 0))
    finally:
        reader.close()
    assert [r.body for r in records] == bodies
    assert [r.msg_id for r in records] == [r.msg_id for r in receipts]
