"""Where a WordCount step spends its time in the pure core, profiled: stage 0, or the keyed stage.

No broker (sends go to an in-memory broker) and no Spark: the core alone,
so a change to it can be measured in seconds, on a machine whose end-to-end
figures move by half from one run to the next.

- stage 0 (default): :func:`~stream_assets.runtime.core.stage0.stateless.run_source_batch`
  (deserialize, flat_map, key_by, route, pack, pre-combine fold, shuffle
  encode, send) over ``--lines`` WordCount lines. Prints the core's lines/s
  next to ``Counter`` over the same lines (the floor: the counting done in C).
- ``--keyed``: the keyed stage's steps, shaped as in the real-time mode. Two
  tasks each run ``--steps`` stage-0 steps of four source queues
  (``run_source_batches``: partials combined across them), and every keyed
  step of shuffle queue 0 applies one message of each task, then folds,
  emits and commits (RocksDB, changelog) as
  :func:`~stream_assets.runtime.core.keyed.batch.run_keyed_batch` does. A
  keyed step's cost follows the distinct keys it updates, not the lines
  behind them: it prints microseconds per result, next to a plain dict
  adding up the same partials (the floor).

Then the functions that take the time (cProfile, by own time).

Usage::

    python benchmarks/profile_batch.py [--lines 20000] [--top 15] [--arrow]
    python benchmarks/profile_batch.py --keyed [--lines 3000] [--steps 30]

``--arrow`` runs the vectorised WordCount (``examples/wordcount_arrow.py``:
batch operators, counted a whole batch at a time) instead.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.limits import wordcount_bodies
from stream_assets.examples import wordcount, wordcount_arrow
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.context import StageContext
from stream_assets.runtime.core.keyed.batch import run_keyed_batch
from stream_assets.runtime.core.send_buffer import SendBuffer
from stream_assets.runtime.core.shuffle_codec import decode
from stream_assets.runtime.core.stage0.stateless import run_source_batch, run_source_batches
from stream_assets.state.store import QueueStateStore
from stream_assets.testing import InMemoryBroker

#: Source queues per task, and tasks, of the keyed profile (the real-time mode's
#: default on a 2-core machine: 8 source queues over 2 tasks).
_QUEUES_PER_TASK, _TASKS = 4, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=None, help="stage 0: 20 000; keyed: 3 000")
    parser.add_argument("--lines-per-message", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--arrow", action="store_true", help="the vectorised WordCount")
    parser.add_argument("--keyed", action="store_true", help="the keyed stage's steps")
    parser.add_argument("--steps", type=int, default=30, help="keyed steps (--keyed)")
    args = parser.parse_args()
    topology = (wordcount_arrow if args.arrow else wordcount).build("wc", "src", "out")
    broker = _broker(topology)
    run = _keyed(topology, broker, args) if args.keyed else _stage0(topology, broker, args)
    profiler = cProfile.Profile()
    profiler.runcall(run)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


def _broker(topology: Topology) -> InMemoryBroker:
    """An in-memory broker with the topics of ``topology``'s stages."""
    broker = InMemoryBroker()
    for stage in topology.stages[1:]:
        broker.create_topic(stage.input_topic, 8)
        if stage.state_topic is not None:
            broker.create_topic(stage.state_topic, 8)
    for sink in topology.sink_topics:
        broker.create_topic(sink, 8)
    broker.create_topic(topology.dead_letter_topic, 1)
    return broker


def _stage0(
    topology: Topology, broker: InMemoryBroker, args: argparse.Namespace
) -> Callable[[], object]:
    """Time one stage-0 batch against ``Counter``; the batch, to profile."""
    lines = args.lines or 20_000
    bodies = wordcount_bodies(lines, args.lines_per_message)
    records = [Record("src", 0, i, body, born_timestamp=1_000 + i) for i, body in enumerate(bodies)]
    ctx = StageContext.of(topology, 0, shuffle_queues=8, source_queues=(0,), combine_from=((0, 0),))

    def batch() -> None:
        run_source_batch(ctx, 0, 0, len(records), records, SendBuffer(broker))

    batch()  # warm: first calls import and initialise (Arrow compute, msgpack)
    start = time.perf_counter()
    batch()
    core = lines / (time.perf_counter() - start)
    start = time.perf_counter()
    words: collections.Counter[bytes] = collections.Counter()
    for r in records:
        for line in r.body.split(b"\n"):
            words.update(line.split())
    floor = lines / (time.perf_counter() - start)
    print(f"stage-0 core: {core:.0f} lines/s; Counter over the same lines: {floor:.0f} lines/s")
    print(f"the core does {100 * core / floor:.1f} % of the plain count's rate\n")
    return batch


def _keyed(
    topology: Topology, broker: InMemoryBroker, args: argparse.Namespace
) -> Callable[[], object]:
    """Stage 0 as two real-time tasks would run it; time the keyed steps of shuffle queue 0
    against a dict adding up the same partials; the keyed steps again, to profile."""
    lines, steps = args.lines or 3_000, args.steps
    per = lines // (_QUEUES_PER_TASK * args.lines_per_message)  # messages per queue and step
    bodies = iter(wordcount_bodies(lines * steps * _TASKS, args.lines_per_message, seed=5))
    contexts = [
        StageContext.of(
            topology, 0, shuffle_queues=8, source_queues=qs, combine_from=tuple((q, 0) for q in qs)
        )
        for qs in _task_queues()
    ]
    for step in range(steps):
        for ctx, queues in zip(contexts, _task_queues(), strict=True):
            parts = []
            for q in queues:
                start = step * per
                records = [
                    Record("src", q, start + i, next(bodies), born_timestamp=1_000 + step)
                    for i in range(per)
                ]
                parts.append((q, start, start + per, records))
            run_source_batches(ctx, parts, SendBuffer(broker))
    keyed = StageContext.of(topology, 1, shuffle_queues=8)
    messages = broker.topic(keyed.stage.input_topic).read(0, 0)
    per_step = len(messages) // steps

    def floor() -> None:
        counts: dict[str, int] = {}
        for message in messages:
            for key, _ws, _we, acc, _ts, _n in decode(message.body)["comb"]:
                counts[key] = counts.get(key, 0) + acc[0]

    def keyed_steps() -> int:
        results, out = 0, _broker(topology)  # a fresh state topic: a run starts from nothing
        with (
            tempfile.TemporaryDirectory() as root,
            QueueStateStore(root, "wc", "keyed", 0) as store,
        ):
            for step in range(steps):
                batch = messages[step * per_step : (step + 1) * per_step]
                end = (step + 1) * per_step
                results += run_keyed_batch(keyed, 0, end, batch, store, SendBuffer(out)).outputs
        return results

    keyed_steps()  # warm: first calls import and initialise
    start = time.perf_counter()
    results = keyed_steps()
    took = time.perf_counter() - start
    start = time.perf_counter()
    floor()
    plain = time.perf_counter() - start
    print(
        f"keyed core: {steps} steps of {per_step} shuffle messages, {results} results: "
        f"{1000 * took / steps:.2f} ms a step, {1e6 * took / results:.1f} us a result; "
        f"a dict adding up the same partials: {1e6 * plain / results:.2f} us a result "
        f"({took / plain:.0f}x)\n"
    )
    return keyed_steps


def _task_queues() -> list[tuple[int, ...]]:
    """The source queues of each task."""
    return [tuple(range(t * _QUEUES_PER_TASK, (t + 1) * _QUEUES_PER_TASK)) for t in range(_TASKS)]


if __name__ == "__main__":
    main()
