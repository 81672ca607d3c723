"""The baselines engine benchmarks divide by, measured on the WordCount input itself.

On WordCount input (``--lines`` lines of 8 words, ``--lines-per-message``
lines a message, fresh topics of ``--queues`` queues), in one run:

- produce: the project's fastest produce path, one
  :class:`~stream_assets.rocketmq.batch_producer.BatchProducer` ``send_all`` of
  every body (batched, pipelined requests), messages/s and lines/s; and, for
  comparison, the C++-client path (sync sends from ``--threads`` producers);
- produce 100-byte records (batched): ``--records`` keyed 100-byte records
  through ``send_all``, records/s: the per-record produce ceiling that
  per-record engine throughput (``benchmarks/passthrough.py``) is compared with;
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
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._engine import produce, unique
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer, OutgoingMessage
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.settings import RocketMQSettings


def wordcount_bodies(lines: int, per_message: int, seed: int = 3) -> list[bytes]:
    """``lines`` lines of 8 words from a 2 000-word vocabulary, ``per_message`` a body."""
    rnd = random.Random(seed)
    vocab = [f"w{i}" for i in range(2_000)]
    text = [" ".join(rnd.choices(vocab, k=8)).encode() for _ in range(lines)]
    return [b"\n".join(text[i : i + per_message]) for i in range(0, len(text), per_message)]


def produce_batched(settings: RocketMQSettings, topic: str, bodies: Sequence[bytes]) -> float:
    """Send ``bodies`` (keyed by index) with one ``send_all``; returns msg/s.

    Timed from building the messages to the last receipt, with a started
    producer (its start is a name-server check, not part of producing).
    """
    with BatchProducer(settings) as producer:
        start = time.perf_counter()
        receipts = producer.send_all(
            [OutgoingMessage(topic, body, key=str(i)) for i, body in enumerate(bodies)]
        )
        seconds = time.perf_counter() - start
    if len(receipts) != len(bodies):
        raise RuntimeError(f"{len(receipts)} receipts for {len(bodies)} messages")
    return len(bodies) / seconds


def record_bodies(count: int, size: int) -> list[bytes]:
    """``count`` distinct bodies of exactly ``size`` bytes."""
    return [f"{i:012d}".encode().ljust(size, b".") for i in range(count)]


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
    parser.add_argument("--threads", type=int, default=4, help="sync producers (comparison)")
    parser.add_argument("--records", type=int, default=200_000, help="100-byte records")
    parser.add_argument("--record-size", type=int, default=100)
    parser.add_argument("--json", action="store_true", help="one JSON object of the figures")
    args = parser.parse_args()
    settings = RocketMQSettings()
    bodies = wordcount_bodies(args.lines, args.lines_per_message)
    records = record_bodies(args.records, args.record_size)
    topic, sync_topic, records_topic = (
        unique("bench-limits"),
        unique("bench-limits-sync"),
        unique("bench-limits-records"),
    )
    with RocketMQAdmin(settings) as admin:
        for name in (topic, sync_topic, records_topic):
            admin.create_topic(name, args.queues)
    produced = produce_batched(settings, topic, bodies)
    produced_sync = produce(settings, sync_topic, bodies, threads=args.threads)
    records_rate = produce_batched(settings, records_topic, records)
    plain = consume(settings, topic, count=False)
    counted = consume(settings, topic, count=True)
    figures = {
        "produce_msgs_per_s": produced,
        "produce_lines_per_s": produced * args.lines_per_message,
        "produce_sync_msgs_per_s": produced_sync,
        "produce_sync_lines_per_s": produced_sync * args.lines_per_message,
        "produce_records_per_s": records_rate,
        "consume_msgs_per_s": plain["messages_per_s"],
        "consume_mib_per_s": plain["mib_per_s"],
        "raw_read_count_lines_per_s": counted["lines_per_s"],
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"produce (batched, BatchProducer.send_all): {produced:.0f} msg/s = "
        f"{figures['produce_lines_per_s']:.0f} lines/s"
    )
    print(
        f"produce ({args.threads} sync C++-client producers, for comparison): "
        f"{produced_sync:.0f} msg/s = {figures['produce_sync_lines_per_s']:.0f} lines/s "
        f"(batched is {produced / produced_sync:.0f}x)"
    )
    print(f"produce {args.record_size}-byte records (batched): {records_rate:.0f} records/s")
    print(
        f"consume (queue reader, one process): {plain['messages_per_s']:.0f} msg/s, "
        f"{plain['mib_per_s']:.1f} MiB/s"
    )
    print(f"raw read + count (Counter, one process): {counted['lines_per_s']:.0f} lines/s")


if __name__ == "__main__":
    main()
