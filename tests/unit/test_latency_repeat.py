"""``benchmarks/latency.py --repeat``: the summary line of several runs."""

from __future__ import annotations

import statistics

from benchmarks.latency import _FIGURES, summary


def test_a_summary_holds_each_figures_median_and_the_p99_range() -> None:
    p99s = [415.0, 1258.0, 790.0, 442.0]
    runs = [
        {"mode": "real-time", "workload": "wordcount", **dict.fromkeys(_FIGURES, 0.0), "p99_ms": p}
        for p in p99s
    ]
    for i, run in enumerate(runs):
        run["sent_per_s"] = 1000.0 * (i + 1)
    line = summary(runs)
    assert (line["mode"], line["workload"], line["runs"]) == ("real-time", "wordcount", 4)
    assert line["p99_ms"] == statistics.median(p99s)
    assert line["p99_ms_range"] == [min(p99s), max(p99s)]
    assert line["sent_per_s"] == statistics.median(r["sent_per_s"] for r in runs)
