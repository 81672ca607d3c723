"""WordCount's latency second by second over a long paced run: where, not how much, it spikes.

A p99 over a whole run says how bad the worst hundredth was, not when: a
pause every 30 s (a real-time interval's end, a snapshot, a collection) and
a steady slowness give the same figure. This sends marked WordCount lines
(benchmarks/wordcount.py's markers: a word unique to each message) at
``--rate`` lines/s for ``--seconds`` while a real-time instance runs, and
prints, for each second of sending, the p50, p99 and max latency of the
markers sent in it (send -> store of the first sink message counting the
marker), then the median and worst of the per-second p99s after
``--warmup`` seconds.

Usage::

    python benchmarks/latency_by_second.py [--rate 45000] [--seconds 70] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._engine import percentiles, warm_spark
from benchmarks.wordcount import marker_run
from stream_assets.examples import wordcount
from stream_assets.settings import EngineSettings, RocketMQSettings


def by_second(samples: Sequence[tuple[int, float]]) -> list[dict[str, float]]:
    """Per second of sending (from the first send): markers, p50, p99, max latency (ms).

    >>> rows = by_second([(1_000, 10.0), (1_400, 30.0), (2_100, 500.0), (2_200, 20.0)])
    >>> [(r["second"], r["markers"], r["max_ms"]) for r in rows]
    [(0, 2, 30.0), (1, 2, 500.0)]
    """
    first = min(born for born, _ in samples)
    seconds: defaultdict[int, list[float]] = defaultdict(list)
    for born, latency in samples:
        seconds[(born - first) // 1000].append(latency)
    rows = []
    for second in sorted(seconds):
        values = seconds[second]
        p50, p99 = percentiles(values) if len(values) >= 2 else (values[0], values[0])
        rows.append(
            {
                "second": second,
                "markers": len(values),
                "p50_ms": p50,
                "p99_ms": p99,
                "max_ms": max(values),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=45_000, help="lines a second")
    parser.add_argument("--seconds", type=float, default=70.0)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds left out of the summary")
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    args = parser.parse_args()
    runs = argparse.Namespace(lines_per_message=20, latency_seconds=args.seconds, queues=8)
    settings, engine = RocketMQSettings(), EngineSettings(mode="real-time")
    warm_spark(settings, engine, wordcount.build)
    marks = marker_run(settings, runs, engine, args.rate)
    rows = by_second(marks.samples)
    steady = [r for r in rows if r["second"] >= args.warmup]
    worst = max(steady, key=lambda r: r["p99_ms"])
    summary = {
        "rate": args.rate,
        "seconds": len(rows),
        "median_second_p99_ms": statistics.median(r["p99_ms"] for r in steady),
        "worst_second_p99_ms": worst["p99_ms"],
        "worst_second": worst["second"],
    }
    for row in [*rows, summary]:
        if args.json:
            print(json.dumps(row))
        else:
            print(
                "  ".join(
                    f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                )
            )


if __name__ == "__main__":
    main()
