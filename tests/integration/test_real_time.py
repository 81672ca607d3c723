"""The real-time mode on the real broker and Spark: pipelined, exact, stoppable within a step.

Every test here runs with an interval (``EngineSettings.interval_ms``) far
longer than the test: a result that reaches the sink proves the stages ran
at the same time inside one interval (nothing is handed over at its end), and
a stop or a rebalance that returns proves it waited for a step, not for the
interval. The crash cases run elsewhere: kill -9 of an instance in both modes
(test_engine.py), a Spark worker killed mid-interval on the 2-worker cluster
(test_cluster.py) and over two broker groups under load (test_multi_broker.py).
"""

from __future__ import annotations

import collections
import random
import time
from pathlib import Path
from typing import Any

from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.settings import RocketMQSettings
from tests.consumer_rule import final_counts
from tests.integration._engine_util import Message, produce, read_topic, unique
from tests.integration.conftest import EngineHarness

#: Longer than any test here: no interval ends while one runs.
INTERVAL_MS = 900_000
REAL_TIME = {"mode": "real-time", "interval_ms": INTERVAL_MS, "step_max_records": 200}


def _lines(seed: int, count: int) -> list[str]:
    rnd = random.Random(seed)
    vocab = [f"w{i:03d}" for i in range(300)]
    return [" ".join(rnd.choices(vocab, k=rnd.randint(1, 9))) for _ in range(count)]


def _messages(lines: list[str], tag: str) -> list[Message]:
    return [
        Message("\n".join(lines[i : i + 5]).encode(), key=f"{tag}-{i}")
        for i in range(0, len(lines), 5)
    ]


def _reference(*waves: list[str]) -> dict[str, int]:
    return dict(collections.Counter(w for wave in waves for line in wave for w in line.split()))


def test_wordcount_results_flow_within_one_interval_and_a_stop_waits_for_a_step_only(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    job = unique("it-rt")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 4)
    inst = engine.start(
        engine.instance(wordcount.build(job, source, sink), tmp_path / "s", **REAL_TIME)
    )
    waves = [_lines(seed, 3_000) for seed in (1, 2, 3)]
    for i, wave in enumerate(waves):
        # Each wave is sent while the instance runs; its counts reach the sink in the
        # same interval (the interval is longer than the test).
        produce(client_settings, source, _messages(wave, f"w{i}"), threads=2)
        inst.await_caught_up(180)
        assert final_counts(read_topic(admin, sink)) == _reference(*waves[: i + 1])
    steps0, steps1 = inst.metrics[0].batches, inst.metrics[1].batches
    # Small steps (200 records at most), both stages stepping while the other does.
    assert steps0 >= len(waves) * 3_000 // 5 // 200 and steps1 > len(waves)
    assert inst.metrics[1].totals["skipped_duplicates"] == 0
    began = time.monotonic()
    engine.stop(inst)
    stop_s = time.monotonic() - began
    report(f"real-time wordcount: {steps0}/{steps1} steps of stages 0/1; stop in {stop_s:.2f} s")
    assert stop_s < INTERVAL_MS / 1000 / 10, "the stop waited for the interval"


def test_queues_move_between_running_real_time_instances_exactly(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    """Rebalance in place: the first instance gives half its queues (source and shuffle)
    to a second, which takes them over as a newer generation; counts stay exact."""
    job = unique("it-rt-move")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 4)
    topology = wordcount.build(job, source, sink)
    shuffle = topology.shuffle_topics[0]
    every = {source: [0, 1, 2, 3], shuffle: [0, 1, 2, 3]}
    # One long-running task each: both instances share this process's SparkSession
    # (local[2]), and a task holds its slot for the whole interval.
    first = engine.instance(
        topology, tmp_path / "a", assignment=every, real_time_tasks=1, **REAL_TIME
    )
    engine.start(first)
    waves = [_lines(seed, 2_000) for seed in (7, 8, 9)]
    produce(client_settings, source, _messages(waves[0], "a"), threads=2)
    first.await_caught_up(180)

    produce(client_settings, source, _messages(waves[1], "b"), threads=2)
    # Mid-stream: half the queues go to a second instance (its own state dir: another
    # machine's disk), which restores their state from the state topic.
    first.reassign({source: [0, 1], shuffle: [0, 1]}, generation=1)
    second = engine.instance(
        topology,
        tmp_path / "b",
        assignment={source: [2, 3], shuffle: [2, 3]},
        generation=1,
        real_time_tasks=1,
        **REAL_TIME,
    )
    engine.start(second)
    produce(client_settings, source, _messages(waves[2], "c"), threads=2)
    for inst in (first, second):
        inst.await_caught_up(180)
    # Each instance committed its queues: every count is in the sink.
    assert final_counts(read_topic(admin, sink)) == _reference(*waves)
    assert second.metrics[1].totals["restores"] + second.metrics[1].totals["catch_ups"] >= 1
