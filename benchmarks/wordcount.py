"""WordCount throughput (with and without pre-shuffle combine) and latency.

Prints, against baselines measured in the same run (``broker_roundtrip``, and
"raw read + count" from ``limits.py``: one plain Python process pulling the
same input and counting with ``collections.Counter``):

- throughput in input lines/s (input produced while the instance runs, several
  lines a message), with pre-shuffle combine on and off, and the shuffle
  traffic each caused;
- end-to-end latency p50/p99: lines produced live carry a unique marker word;
  latency = store time of that word's first count - born time of its line.

Usage::

    python benchmarks/wordcount.py --lines 50000 --live 1000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._engine import percentiles, produce, run_live, unique, warm_spark
from benchmarks.broker_roundtrip import measure
from benchmarks.limits import consume
from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.runtime.instance import Instance
from stream_assets.settings import EngineSettings, RocketMQSettings


def lines(n: int, seed: int = 3) -> list[bytes]:
    """``n`` lines of 8 words from a 2 000-word vocabulary."""
    rnd = random.Random(seed)
    vocab = [f"w{i}" for i in range(2_000)]
    return [" ".join(rnd.choices(vocab, k=8)).encode() for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--live", type=int, default=1_000)
    parser.add_argument("--lines-per-message", type=int, default=20)
    args = parser.parse_args()
    settings = RocketMQSettings()
    engine = EngineSettings(max_records_per_batch=10_000)

    base = measure(5_000, 8, 64)
    print(f"baseline broker round trip: {base['roundtrip_msgs_per_s']:.0f} msg/s")
    warm_spark(settings, engine, wordcount.build)

    # Input arrives while the instance runs (pre-shuffle combine applies only to
    # input newer than the instance's start), LINES_PER_MESSAGE lines a message.
    text = lines(args.lines)
    bodies = [
        b"\n".join(text[i : i + args.lines_per_message])
        for i in range(0, len(text), args.lines_per_message)
    ]
    for combine in (True, False):
        job = unique("bench-wc")
        src = f"{job}-in"
        with RocketMQAdmin(settings) as admin:
            admin.create_topic(src, 4)
        instance = Instance(
            wordcount.build(job, src, f"{job}-out"),
            rocketmq=settings,
            engine=engine.model_copy(update={"pre_combine": combine}),
        )
        instance.start()
        start = time.perf_counter()
        produce(settings, src, bodies)
        instance.await_caught_up(1800, poll_s=0.2)
        seconds = time.perf_counter() - start
        instance.stop()
        stage0, stage1 = instance.metrics[0].totals, instance.metrics[1].totals
        rate = args.lines / seconds
        raw = consume(settings, src, count=True)["lines_per_s"]
        print(
            f"wordcount, pre-shuffle combine {'on ' if combine else 'off'}: "
            f"{rate:.0f} lines/s ({rate * 8:.0f} words/s) = "
            f"{100 * rate / raw:.1f} % of raw read + count ({raw:.0f} lines/s), "
            f"{rate / base['roundtrip_msgs_per_s']:.2f} x broker round trip; "
            f"{stage0.get('shuffle_messages', 0):.0f} shuffle messages carrying "
            f"{stage0.get('shuffle_records', 0):.0f} entries for "
            f"{stage1.get('records_in', 0):.0f} words"
        )

    job = unique("bench-wc-live")
    live = [line + f" marker{i}".encode() for i, line in enumerate(lines(args.live, seed=9))]
    inputs, outputs = run_live(
        wordcount.build(job, f"{job}-in", f"{job}-out"), settings, engine, live
    )
    born = {int(r.body.rsplit(b"marker", 1)[1]): r.born_timestamp for r in inputs}
    first_seen: dict[int, int] = {}
    for r in outputs:
        key = json.loads(r.body)["key"]
        if key.startswith("marker"):
            i = int(key[len("marker") :])
            first_seen[i] = min(first_seen.get(i, r.store_timestamp), r.store_timestamp)
    p50, p99 = percentiles([first_seen[i] - born[i] for i in first_seen])
    print(
        f"wordcount end-to-end latency over {len(first_seen)} marker words: "
        f"p50 {p50:.0f} ms, p99 {p99:.0f} ms"
    )


if __name__ == "__main__":
    main()
