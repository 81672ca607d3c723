"""What progress travelling with the data costs per batch: messages, bytes, time.

Each source queue's progress reaches every shuffle queue (docs/engine.md,
"Progress travels with the data"): the last message of a batch to each queue
carries it, a queue the batch sent nothing else to gets a mark, and a
stateful queue that got only marks commits its watermark. This runs the
engine's real per-queue cores (the :class:`~stream_assets.testing.TopologyTestDriver`:
in-memory broker, real RocksDB) twice over the same input, with progress on
and with it switched off (``ShuffleOut.observe`` a no-op: no marks, nothing
carried: the engine before issue 18), and prints per round (one batch of
every source queue, then of every shuffle queue) the shuffle messages,
marks, shuffle bytes, state-topic messages and core time, with the on/off
ratios. Two shapes:

- ``wordcount``: unwindowed, so nothing can be late: no progress travels at all;
- ``windowed-wordcount``: dense keys in 10 s windows, every batch reaches every
  shuffle queue (marks are rare, each queue's last message carries ``p``);
- ``sparse-join``: a windowed join whose batches reach one or two of the
  shuffle queues (each batch sends a mark to nearly every queue).

Usage::

    python benchmarks/progress_cost.py [--rounds 200] [--shuffle-queues 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import wordcount
from stream_assets.plan.topology import Topology
from stream_assets.runtime.core.stage0 import shuffle_out
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.testing import TopologyTestDriver
from stream_assets.windows import Time, TumblingWindow

SOURCE_QUEUES = 4


@dataclass
class Figures:
    rounds: int = 0
    shuffle_messages: int = 0
    marks: int = 0
    shuffle_bytes: int = 0
    state_messages: int = 0
    seconds: float = 0.0

    def per_round(self, value: float) -> float:
        return value / max(self.rounds, 1)


def _windowed_wordcount() -> Topology:
    b = StreamBuilder("windowed-wc")
    (
        b.source("in", text_deserializer)
        .flat_map(str.split)
        .key_by(lambda w: w)
        .window(TumblingWindow.of(Time.seconds(10)))
        .count()
        .to_rstream()
        .sink("out")
    )
    return b.build()


def _join() -> Topology:
    b = StreamBuilder("sparse-join")
    left = b.source("orders", json_deserializer).select_timestamp("ts")
    right = b.source("payments", json_deserializer).select_timestamp("ts")
    (
        left.join(right)
        .where("key")
        .equal_to("key")
        .window(TumblingWindow.of(Time.seconds(10)))
        .water_mark(2)
        .apply(lambda o, p: [o["id"], p["id"]])
        .sink("out")
    )
    return b.build()


def _wordcount_feed(rounds: int) -> Callable[[TopologyTestDriver], None]:
    rnd = random.Random(3)
    vocab = [f"w{i}" for i in range(2_000)]

    def feed(driver: TopologyTestDriver) -> None:
        for i in range(rounds):
            for q in range(SOURCE_QUEUES):
                lines = [" ".join(rnd.choices(vocab, k=8)) for _ in range(20)]
                driver.pipe("\n".join(lines), queue=q, event_time=1_000 * i)
            driver.advance()

    return feed


def _join_feed(rounds: int) -> Callable[[TopologyTestDriver], None]:
    rnd = random.Random(5)

    def feed(driver: TopologyTestDriver) -> None:
        for i in range(rounds):
            key = f"user-{rnd.randrange(50)}"  # one user per batch and queue: sparse routes
            for q in range(SOURCE_QUEUES):
                for topic in ("orders", "payments"):
                    event = {"key": key, "id": f"{topic}-{i}-{q}", "ts": 1_000 * i}
                    driver.pipe(event, topic=topic, queue=q, event_time=1_000 * i)
            driver.advance()

    return feed


def _run(
    topology: Topology,
    feed: Callable[[TopologyTestDriver], None],
    shuffle_queues: int,
    rounds: int,
) -> Figures:
    figures = Figures()
    with TopologyTestDriver(
        topology, source_queues=SOURCE_QUEUES, shuffle_queues=shuffle_queues
    ) as driver:
        start = time.perf_counter()
        feed(driver)
        figures.seconds = time.perf_counter() - start
        figures.rounds = rounds
        figures.shuffle_messages = sum(s.shuffle_messages for s in driver.stats)
        figures.marks = sum(s.progress_marks for s in driver.stats)
        for topic in topology.shuffle_topics:
            figures.shuffle_bytes += sum(len(r.body) for r in driver.output_records(topic))
        for stage in topology.stages:
            if stage.state_topic is not None:
                figures.state_messages += len(driver.output_records(stage.state_topic))
    return figures


def _without_progress() -> Callable[[], None]:
    """Switch progress off (the engine before issue 18); returns the undo."""
    real = shuffle_out.ShuffleOut.observe

    def no_progress(self: Any) -> None:
        return None

    shuffle_out.ShuffleOut.observe = no_progress  # type: ignore[method-assign]

    def undo() -> None:
        shuffle_out.ShuffleOut.observe = real  # type: ignore[method-assign]

    return undo


def _nothing() -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--shuffle-queues", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode (fastest kept)")
    args = parser.parse_args()
    shapes = {
        "wordcount": (wordcount.build("wc", "in", "out"), _wordcount_feed),
        "windowed-wordcount": (_windowed_wordcount(), _wordcount_feed),
        "sparse-join": (_join(), _join_feed),
    }
    print(
        f"{SOURCE_QUEUES} source queues per topic, {args.shuffle_queues} shuffle queues, "
        f"{args.rounds} rounds; figures per round (one batch of every source queue of "
        "every source topic, then of every shuffle queue), on / off = ratio"
    )
    for name, (topology, feed) in shapes.items():
        # Alternated, the fastest of each kept: a busy machine slows one run, not a mode.
        runs: dict[bool, list[Figures]] = {True: [], False: []}
        for _ in range(args.repeat):
            for progress in (True, False):
                undo = _nothing if progress else _without_progress()
                try:
                    runs[progress].append(
                        _run(topology, feed(args.rounds), args.shuffle_queues, args.rounds)
                    )
                finally:
                    undo()
        on, off = (min(runs[p], key=lambda f: f.seconds) for p in (True, False))
        print(f"\n{name}:")
        for label, attr in (
            ("shuffle messages", "shuffle_messages"),
            ("  of which marks", "marks"),
            ("shuffle bytes", "shuffle_bytes"),
            ("state-topic messages", "state_messages"),
            ("core seconds", "seconds"),
        ):
            a, b = on.per_round(getattr(on, attr)), off.per_round(getattr(off, attr))
            ratio = f"{a / b:.2f}x" if b else "-"
            print(f"  {label:22} {a:12.4f} / {b:12.4f} = {ratio}")


if __name__ == "__main__":
    main()
