"""Reset and replay against the real broker and real Spark: results recomputed from a time.

WordCount runs over input produced in two halves; the time between them is taken
from the broker's own store timestamps (the latest store time of the first half,
read back), never from a sleep. After the reset to that time a new instance must
produce, as the latest count of every word, exactly ``collections.Counter`` of the
second half: the first half is gone from the state, and the second half, already
counted once, is counted again rather than skipped as a duplicate.

The local stores are *not* wiped by that reset (no state root given), as for
stores on executors of other machines: the restarted instance must find them
behind the state topic and restore them to empty on its own. A second reset, to
the earliest offsets, wipes them and recomputes everything.
"""

from __future__ import annotations

import collections
import random
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from stream_assets.control.allocation import allocate
from stream_assets.control.desired_state import DesiredState, DesiredStateStore
from stream_assets.control.reset import EARLIEST, apply_reset, plan_reset
from stream_assets.control.reset_guard import run_reset_command
from stream_assets.examples import wordcount
from stream_assets.jobs.instance_job import instance_job, instance_run_config, instance_run_tags
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.settings import RocketMQSettings
from stream_assets.state import QueueStateStore, restore_queue
from tests.integration._engine_util import (
    Message,
    final_counts,
    produce,
    read_topic,
    unique,
    wait_until,
)
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

LINES_PER_HALF = 600
LINES_PER_MESSAGE = 10
CATCH_UP_S = 90.0


def _lines(seed: int, count: int) -> list[str]:
    rnd = random.Random(seed)
    vocab = [f"w{i:03d}" for i in range(150)]
    return [" ".join(rnd.choices(vocab, k=6)) for _ in range(count)]


def _messages(lines: list[str], prefix: str) -> list[Message]:
    return [
        Message("\n".join(lines[i : i + LINES_PER_MESSAGE]).encode(), key=f"{prefix}-{i}")
        for i in range(0, len(lines), LINES_PER_MESSAGE)
    ]


def _stored(admin: RocketMQAdmin, topic: str) -> int:
    return sum(o.max_offset for o in admin.queue_offsets(topic))


def test_reset_to_a_time_in_the_middle_recomputes_from_there(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    job = unique("rs-wc")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 2)
    first, second = _lines(61, LINES_PER_HALF), _lines(62, LINES_PER_HALF)
    first_msgs, second_msgs = _messages(first, "a"), _messages(second, "b")

    produce(client_settings, source, first_msgs)
    wait_until(lambda: _stored(admin, source) == len(first_msgs), 20, "the first half stored")
    stored_first = read_topic(admin, source)
    cut = max(r.store_timestamp for r in stored_first) + 1
    # The second half must be stored strictly later than the first half's latest message
    # (the broker's clock is this machine's): wait for the clock to pass it.
    wait_until(lambda: time.time() * 1000 > cut + 2, 5, "the clock to pass the first half")
    produce(client_settings, source, second_msgs)
    total = len(first_msgs) + len(second_msgs)
    wait_until(lambda: _stored(admin, source) == total, 20, "the second half stored")
    stored = read_topic(admin, source)
    halves = {m.body: "a" for m in first_msgs} | {m.body: "b" for m in second_msgs}
    assert all((r.store_timestamp >= cut) == (halves[r.body] == "b") for r in stored)
    first_per_queue = collections.Counter(r.queue_id for r in stored if halves[r.body] == "a")

    topology = wordcount.build(job, source, sink)
    state_dir = tmp_path / "state"
    inst = engine.start(engine.instance(topology, state_dir))
    inst.await_caught_up(CATCH_UP_S)
    engine.stop(inst)
    counted = final_counts(read_topic(admin, sink))
    assert counted == dict(collections.Counter(" ".join(first + second).split()))
    (shuffle,), (state_topic,) = topology.shuffle_topics, topology.state_topics
    sink_ends = {q.queue.queue_id: q.max_offset for q in admin.queue_offsets(sink)}

    # A run of the topology in Dagster: the command refuses, naming it, and changes nothing.
    committed = admin.group_offsets(job, source)
    with dg.DagsterInstance.ephemeral() as dagster:
        run = dagster.create_run_for_job(
            instance_job,
            run_config=instance_run_config(job, 0, 0, None),
            tags=instance_run_tags(job, 0, 0, {}),
        )
        said: list[str] = []
        code = run_reset_command(
            topology,
            cut,
            apply=True,
            settings=client_settings,
            state_root=None,
            instance=dagster,
            say=said.append,
            show=said.append,
        )
    assert code == 3
    assert any(run.run_id in line and "refusing to reset" in line for line in said), said
    assert admin.group_offsets(job, source) == committed

    reader = QueueReader(admin, f"{job}-check")
    try:
        plan = plan_reset(topology, cut, admin, reader)
        report(plan.describe())
        source_moves = [m for m in plan.topics[0].moves if m.group == job]
        assert {m.queue.queue_id: m.new for m in source_moves} == {
            q.queue_id: first_per_queue[q.queue_id] for q in admin.queues(source)
        }
        # Every queue moves back: a lower offset than the one committed.
        assert all(m.current is not None and m.new < m.current for m in source_moves)
        result = apply_reset(plan, admin, progress=report)
        report(result.describe())

        # The broker took the lower offsets, in the group and its planned sibling.
        expected = {q: first_per_queue[q.queue_id] for q in admin.queues(source)}
        assert admin.group_offsets(job, source) == expected
        assert admin.group_offsets(f"{job}-planned", source) == expected
        ends = {q: o.max_offset for q, o in admin.topic_offsets(shuffle).items()}
        assert admin.group_offsets(job, shuffle) == ends
        # Every state queue that held state restores to empty: no values, no origins
        # (nothing recomputed is skipped as a duplicate), no watermark.
        assert result.snapshots
        for snap in result.snapshots:
            with QueueStateStore(tmp_path / "check", job, "op", snap.queue.queue_id) as store:
                restore_queue(store, state_topic, snap.queue.queue_id, admin, reader)
                assert dict(store.items()) == {}
                meta = store.meta
                assert (meta.origins, meta.watermark, meta.seq) == ({}, {}, snap.seq)
    finally:
        reader.close()

    again = engine.start(engine.instance(topology, state_dir))
    again.await_caught_up(CATCH_UP_S)
    engine.stop(again)
    stage1 = again.metrics[1].totals
    report(
        f"after the reset: {int(stage1['restores'])} stores restored, "
        f"{int(stage1['catch_ups'])} caught up, {int(stage1['skipped_duplicates'])} skipped"
    )
    # The stores of the first run were left on disk: each was found behind and restored.
    assert stage1["restores"] >= len(result.snapshots)
    assert stage1["skipped_duplicates"] == 0
    after = [r for r in read_topic(admin, sink) if r.queue_offset >= sink_ends[r.queue_id]]
    recounted = dict(collections.Counter(" ".join(second).split()))
    assert final_counts(after) == recounted
    # Over the whole sink, old updates included: a recomputed key's new versions are above
    # its old ones (a word of only the first half keeps its old value).
    current = final_counts(read_topic(admin, sink))
    assert {w: current[w] for w in recounted} == recounted

    # To the earliest offsets through the command's path, with a deployed but stopped
    # topology in Dagster, wiping the local stores too: everything is counted again.
    sink_ends = {q.queue.queue_id: q.max_offset for q in admin.queue_offsets(sink)}
    stores = list(state_dir.glob(f"{job}/*/queue-*"))
    assert len(stores) == len(admin.queues(state_topic))
    deployed = DesiredState(1, allocate({source: [0, 1], shuffle: [0, 1, 2, 3]}, 1))
    with dg.DagsterInstance.ephemeral() as dagster:
        DesiredStateStore(dagster).set(job, deployed)
        said.clear()
        shown: list[str] = []
        code = run_reset_command(
            topology,
            EARLIEST,
            apply=True,
            settings=client_settings,
            state_root=state_dir,
            instance=dagster,
            say=said.append,
            show=shown.append,
        )
        assert code == 0, said
        assert DesiredStateStore(dagster).get(job) == deployed  # paused, then resumed
    assert "4. local stores under" in shown[0] and f"{len(stores)} wiped" in shown[0]
    assert any(line.startswith("paused supervision") for line in said)
    assert any(line.startswith("resumed supervision") for line in said)
    assert not any(p.exists() for p in stores)
    assert set(admin.group_offsets(job, source).values()) == {0}
    third = engine.start(engine.instance(topology, state_dir))
    third.await_caught_up(CATCH_UP_S)
    engine.stop(third)
    after = [r for r in read_topic(admin, sink) if r.queue_offset >= sink_ends[r.queue_id]]
    assert final_counts(after) == dict(collections.Counter(" ".join(first + second).split()))
    assert final_counts(read_topic(admin, sink)) == final_counts(after)  # newest versions win
    assert third.metrics[1].totals["skipped_duplicates"] == 0
