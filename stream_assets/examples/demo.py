"""Run an example topology end to end on the local broker and show its results.

``stream-assets run wordcount --demo-lines 20000`` produces that many generated
lines into ``sourceTopic``, runs one instance until it has consumed them all,
prints the top words from the sink topic and checks them against a count made
here from the same lines.

Example::

    >>> report = run_wordcount_demo(lines=1000)  # doctest: +SKIP
    >>> report.matches  # doctest: +SKIP
    True
"""

from __future__ import annotations

import json
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.runtime.spark.instance import Instance
from stream_assets.settings import EngineSettings, RocketMQSettings

_VOCABULARY = [
    "stream",
    "queue",
    "topic",
    "broker",
    "shuffle",
    "state",
    "window",
    "key",
    "count",
    "sum",
    "offset",
    "spark",
    "dagster",
    "rocksdb",
    "snapshot",
    "changelog",
    "watermark",
    "instance",
    "scale",
    "restore",
]


@dataclass(frozen=True)
class DemoReport:
    """What the demo did."""

    lines: int
    words: int
    seconds: float
    top: list[tuple[str, int]]
    matches: bool


def demo_lines(n: int, seed: int = 7) -> list[str]:
    """``n`` reproducible lines of 3-12 words."""
    rnd = random.Random(seed)
    return [" ".join(rnd.choices(_VOCABULARY, k=rnd.randint(3, 12))) for _ in range(n)]


def run_wordcount_demo(
    lines: int = 20_000,
    rocketmq: RocketMQSettings | None = None,
    engine: EngineSettings | None = None,
    timeout_s: float = 600,
) -> DemoReport:
    """Produce ``lines`` lines, run WordCount until caught up, compare with Counter."""
    rocketmq = rocketmq or RocketMQSettings()
    run_id = uuid.uuid4().hex[:6]
    source, sink = f"demo-wordcount-{run_id}-in", f"demo-wordcount-{run_id}-out"
    text = demo_lines(lines)
    expected = Counter(w for line in text for w in wordcount.split_words(line))
    with RocketMQAdmin(rocketmq) as admin:
        admin.create_topic(source, 4)
        print(f"producing {lines} lines into {source} ...", file=sys.stderr)
        with Producer(rocketmq, admin) as producer:
            for i, line in enumerate(text):
                producer.send(source, line.encode(), key=str(i))
        instance = Instance(
            wordcount.build(f"demo-wordcount-{run_id}", source, sink),
            rocketmq=rocketmq,
            engine=engine or EngineSettings(),
        )
        start = time.perf_counter()
        instance.start()
        try:
            instance.await_caught_up(timeout_s)
        finally:
            instance.close()
        seconds = time.perf_counter() - start
        reader = QueueReader(admin, f"{sink}-check")
        counts: dict[str, int] = {}
        for queue in admin.queues(sink):
            for record in reader.read(queue, 0):
                value = json.loads(record.body)
                counts[value["key"]] = value["count"]
        reader.close()
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    return DemoReport(lines, sum(expected.values()), seconds, top, counts == dict(expected))
