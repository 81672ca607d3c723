"""Where a stage-0 micro-batch of WordCount spends its time: the pure core, profiled.

Runs :func:`~stream_assets.runtime.core.stage0.stateless.run_source_batch` (deserialize,
flat_map, key_by, route, pack, pre-combine fold, shuffle encode, send) over
``--lines`` WordCount lines in this process: no broker (sends go to an
in-memory broker), no Spark. Prints the core's lines/s next to ``Counter``
over the same lines (the floor: the counting done in C), then the functions
that take the time (cProfile, by own time).

Usage::

    python benchmarks/profile_batch.py [--lines 20000] [--top 15] [--arrow]

``--arrow`` runs the vectorised WordCount (``examples/wordcount_arrow.py``:
batch operators, counted a whole batch at a time) instead.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.limits import wordcount_bodies
from stream_assets.examples import wordcount, wordcount_arrow
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.context import StageContext
from stream_assets.runtime.core.send_buffer import SendBuffer
from stream_assets.runtime.core.stage0.stateless import run_source_batch
from stream_assets.testing import InMemoryBroker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--lines-per-message", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--arrow", action="store_true", help="the vectorised WordCount")
    args = parser.parse_args()
    bodies = wordcount_bodies(args.lines, args.lines_per_message)
    records = [Record("src", 0, i, body, born_timestamp=1_000 + i) for i, body in enumerate(bodies)]
    topology = (wordcount_arrow if args.arrow else wordcount).build("wc", "src", "out")
    broker = InMemoryBroker()
    for stage in topology.stages[1:]:
        broker.create_topic(stage.input_topic, 8)
    broker.create_topic(topology.dead_letter_topic, 1)
    ctx = StageContext.of(topology, 0, shuffle_queues=8, source_queues=(0,), combine_from=((0, 0),))

    def batch() -> None:
        run_source_batch(ctx, 0, 0, len(records), records, SendBuffer(broker))

    batch()  # warm: first calls import and initialise (Arrow compute, msgpack)
    start = time.perf_counter()
    batch()
    core = args.lines / (time.perf_counter() - start)
    start = time.perf_counter()
    words: collections.Counter[bytes] = collections.Counter()
    for r in records:
        for line in r.body.split(b"\n"):
            words.update(line.split())
    floor = args.lines / (time.perf_counter() - start)
    print(f"stage-0 core: {core:.0f} lines/s; Counter over the same lines: {floor:.0f} lines/s")
    print(f"the core does {100 * core / floor:.1f} % of the plain count's rate\n")
    profiler = cProfile.Profile()
    profiler.runcall(batch)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
