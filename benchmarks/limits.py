"""The baselines engine benchmarks divide by, measured on the WordCount input itself.

On one topic of WordCount input (``--lines`` lines of 8 words, ``--lines-per-message``
lines a message, ``--queues`` queues), in one run:

- produce: the project's fastest produce path today (sync sends from
  ``--threads`` producers), messages/s and lines/s;
- consume: one Python process pulling every message through the project's
  queue reader, messages/s and MiB/s;
- raw read + count: the same pull plus ``collections.Counter`` over the words,
  lines/s: what one plain Python process does with no engine at all. WordCount
  throughput is quoted as a ratio to this (``benchmarks/wordcount.py``).

Usage::

    python benchmarks/limits.py --lines 200000
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._engine import produce, unique
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.settings import RocketMQSettings


def wordcount_bodies(lines: int, per_message: int, seed: int = 3) -> list[bytes]:
    """``lines`` lines of 8 words from a 2 000-word vocabulary, ``per_message`` a body."""
    rnd = random.Random(seed)
    vocab = [f"w{i}" for i in range(2_000)]
    text = [" ".join(rnd.choices(vocab, k=8)).encode() for _ in range(lines)]
    return [b"\n".join(text[i : i + per_message]) for i in range(0, len(text), per_message)]


def consume(settings: RocketMQSettings, topic: str, count: bool) -> dict[str, float]:
    """Pull every message of ``topic`` (and count its words if ``count``); the rates."""
    words: collections.Counter[bytes] = collections.Counter()
    messages = lines = size = 0
    with RocketMQAdmin(settings) as admin:
        reader = QueueReader(admin, unique("bench-limits"))
        try:
            start = time.perf_counter()
            for queue in admin.queues(topic):
                for record in reader.read(queue, 0):
                    messages += 1
                    size += len(record.body)
                    if count:
                        for line in record.body.split(b"\n"):
                            lines += 1
                            words.update(line.split())
            seconds = time.perf_counter() - start
        finally:
            reader.close()
    return {
        "messages_per_s": messages / seconds,
        "mib_per_s": size / seconds / 2**20,
        "lines_per_s": lines / seconds,
        "distinct_words": float(len(words)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--lines-per-message", type=int, default=20)
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="one JSON object of the figures")
    args = parser.parse_args()
    settings = RocketMQSettings()
    bodies = wordcount_bodies(args.lines, args.lines_per_message)
    topic = unique("bench-limits")
    with RocketMQAdmin(settings) as admin:
        admin.create_topic(topic, args.queues)
    produced = produce(settings, topic, bodies, threads=args.threads)
    plain = consume(settings, topic, count=False)
    counted = consume(settings, topic, count=True)
    figures = {
        "produce_msgs_per_s": produced,
        "produce_lines_per_s": produced * args.lines_per_message,
        "consume_msgs_per_s": plain["messages_per_s"],
        "consume_mib_per_s": plain["mib_per_s"],
        "raw_read_count_lines_per_s": counted["lines_per_s"],
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"produce ({args.threads} sync producers): {produced:.0f} msg/s = "
        f"{figures['produce_lines_per_s']:.0f} lines/s"
    )
    print(
        f"consume (queue reader, one process): {plain['messages_per_s']:.0f} msg/s, "
        f"{plain['mib_per_s']:.1f} MiB/s"
    )
    print(f"raw read + count (Counter, one process): {counted['lines_per_s']:.0f} lines/s")


if __name__ == "__main__":
    main()
