"""End-to-end latency at half the engine's own maximum, per execution mode and workload.

For each ``--mode`` (micro-batch, real-time) and workload (``passthrough``:
source -> map -> sink, stage 0 only; ``wordcount``: two stages through the
shuffle; ``wordcount-eos`` / ``passthrough-eos``: the same with the sink exactly
once, each step's counts (records) one RocketMQ transaction, committed with the
state (the source position), for its cost against the plain workload in the
same run), measured in the same run on the same broker:

1. the engine's maximum: a fresh instance over a backlog already in its
   source topic, from ``Instance.start`` to the last input committed
   (records or lines per second);
2. latency at half that maximum: a fresh instance reads a few warm-up
   messages through every stage (its start is ``footprint.py``'s figure), then
   input is sent at that steady pace (one ``send_all`` every 20 ms, about 8 %
   of a core at WordCount's half max) for ``--seconds``; latency = the sink
   message's store time - the send time of the record it came from
   (passthrough: every record; wordcount: a word unique to each message, its
   first count).

Prints one JSON object per (mode, workload) with at least ``mode``,
``workload``, ``p50_ms``, ``p99_ms``, ``sent_per_s`` (what the producer
achieved) and ``engine_per_s`` (what the engine committed over the same
run: below ``sent_per_s``, it did not keep up). Targets (issue 30): p99 <=
100 ms passthrough, <= 250 ms wordcount, on the idle machine. A wordcount
line also splits a marker's latency by stage: ``stage0_p50_ms`` /
``stage0_p99_ms`` from its send to the first shuffle message holding its
word, ``keyed_p50_ms`` / ``keyed_p99_ms`` from there to its count in the sink.

With ``--repeat N`` each (mode, workload) runs N times, one line each (``run``:
1..N), then a line with ``"runs": N`` holding the median of each figure and
``p99_ms_range`` (lowest, highest): on a 2-core machine one run's p99 can be
twice another's, so a before -> after comparison wants several.

With ``--against FIELD=VALUE`` (an ``EngineSettings`` field, the value as
JSON or as text; repeatable) each run is a pair, the engine as configured and
with those settings, in alternating order (so a machine that speeds up or
slows down during the benchmark favours neither); each line carries
``engine`` (``default`` or the settings), and the summary lines hold each
side's medians and ``p99_ratio``, ``p50_ratio``: the other settings' median
over the default's. On a shared 2-core machine a run's p99 moves by half
from one run to the next: a change worth less than that shows only this
way, over five pairs or more.

Usage::

    python benchmarks/latency.py [--mode real-time] [--workload wordcount] [--json]
    python benchmarks/latency.py --mode real-time --workload wordcount --rate 50000 \
        --repeat 5 --against shuffle_queues=4 --json
    python benchmarks/latency.py --mode real-time --repeat 5 --json
    python benchmarks/latency.py --workload wordcount --workload wordcount-eos
    python benchmarks/latency.py --workload passthrough --workload passthrough-eos
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import passthrough
from benchmarks import wordcount as wordcount_bench
from benchmarks._engine import create_topic, run_instance, unique, warm_spark
from benchmarks.limits import produce_batched, record_bodies, wordcount_bodies
from stream_assets.examples import wordcount
from stream_assets.settings import EngineSettings, RocketMQSettings

MODES = ("micro-batch", "real-time")
#: ``-eos``: the workload with its sink exactly once (transactional messages).
#: ``-keyed``: its sink keyed per record, so a step's ends need not wait for each other.
WORKLOADS = (
    "passthrough",
    "wordcount",
    "wordcount-eos",
    "passthrough-eos",
    "passthrough-eos-keyed",
)
DEFAULT_WORKLOADS = ("passthrough", "wordcount")


def engine_max(
    settings: RocketMQSettings, engine: EngineSettings, workload: str, args: argparse.Namespace
) -> float:
    """Records (passthrough) or lines (wordcount) per second over a pre-produced backlog."""
    job = unique(f"bench-max-{workload}")
    source = f"{job}-in"
    create_topic(settings, source, args.queues)
    eos, keyed = "-eos" in workload, workload.endswith("-keyed")
    if workload.startswith("passthrough"):
        produce_batched(settings, source, record_bodies(args.records, args.size))
        topology = passthrough.build(job, source, f"{job}-out", eos, keyed)
        return run_instance(topology, settings, engine, args.records).records_per_s
    lines = args.records
    produce_batched(settings, source, wordcount_bodies(lines, args.lines_per_message))
    topology = wordcount.build(job, source, f"{job}-out", exactly_once=eos)
    return run_instance(topology, settings, engine, lines).records_per_s


def measure(
    settings: RocketMQSettings, engine: EngineSettings, workload: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One line of figures: the maximum, then latency at half of it."""
    best = engine_max(settings, engine, workload, args)
    rate = args.rate or best / 2
    eos, keyed = "-eos" in workload, workload.endswith("-keyed")
    if workload.startswith("passthrough"):
        lat = passthrough.latency(settings, args, engine, rate, eos, keyed)
        sent, done = lat["latency_sent_records_per_s"], lat["latency_engine_records_per_s"]
    else:
        lat = wordcount_bench.latency(settings, args, engine, rate, exactly_once=eos)
        sent, done = lat["latency_sent_lines_per_s"], lat["latency_engine_lines_per_s"]
    return {
        "mode": engine.mode,
        "workload": workload,
        "p50_ms": round(lat["latency_p50_ms"], 1),
        "p99_ms": round(lat["latency_p99_ms"], 1),
        "max_ms": round(lat["latency_max_ms"], 1),
        "steady_p99_ms": round(lat["latency_steady_p99_ms"], 1),
        "sent_per_s": round(sent, 1),
        "engine_per_s": round(done, 1),
        "max_per_s": round(best, 1),
        "target_per_s": round(rate, 1),
        "caught_up_after_last_send_s": round(lat["latency_drain_s"], 2),
        "samples": int(lat["latency_samples"]),
        **{k: round(lat[f"latency_{k}"], 1) for k in _HALVES if f"latency_{k}" in lat},
    }


#: The figures of a line that are medians in a ``--repeat`` summary.
_FIGURES = (
    "p50_ms",
    "p99_ms",
    "max_ms",
    "steady_p99_ms",
    "sent_per_s",
    "engine_per_s",
    "max_per_s",
    "target_per_s",
    "caught_up_after_last_send_s",
)
#: WordCount's figures per stage (``wordcount.stage_halves``): sent -> in a shuffle
#: message, and shuffle message -> count in the sink; medians where every run has them.
_HALVES = ("stage0_p50_ms", "stage0_p99_ms", "keyed_p50_ms", "keyed_p99_ms")


def summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over repeated runs of one (mode, workload), and the
    range of p99.

    >>> runs = [{"mode": "m", "workload": "w", **dict.fromkeys(_FIGURES, v)} for v in (1, 5, 3)]
    >>> s = summary(runs)
    >>> s["runs"], s["p99_ms"], s["p99_ms_range"]
    (3, 3, [1, 5])
    """
    p99s = [line["p99_ms"] for line in lines]
    return {
        "mode": lines[0]["mode"],
        "workload": lines[0]["workload"],
        "runs": len(lines),
        **{
            k: statistics.median(line[k] for line in lines)
            for k in (*_FIGURES, *_HALVES)
            if all(k in line for line in lines)
        },
        "p99_ms_range": [min(p99s), max(p99s)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, action="append", help="default: both")
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        action="append",
        help=f"default: {' and '.join(DEFAULT_WORKLOADS)}",
    )
    parser.add_argument(
        "--records", type=int, default=100_000, help="backlog of the maximum's run (lines)"
    )
    parser.add_argument("--size", type=int, default=100, help="bytes a passthrough record")
    parser.add_argument("--lines-per-message", type=int, default=20)
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the paced run")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="records (lines) per second sent; 0: half the max"
    )
    parser.add_argument("--warmup-s", type=float, default=5.0, help="left out of steady_p99_ms")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per (mode, workload), then their medians"
    )
    parser.add_argument(
        "--against",
        action="append",
        metavar="FIELD=VALUE",
        help="also run the engine with this EngineSettings field set, alternating with "
        "the default, run by run (repeatable: all of them in one variant)",
    )
    parser.add_argument("--json", action="store_true", help="only the JSON lines")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    # The names the passthrough and wordcount latency steps read.
    args.latency_seconds, args.latency_warmup_s = args.seconds, args.warmup_s
    settings = RocketMQSettings()
    base = EngineSettings()
    base = base.model_copy(
        update={"spark_conf": {"spark.ui.showConsoleProgress": "false", **base.spark_conf}}
    )
    against = _against(parser, args.against or [])
    began = time.perf_counter()
    for mode in args.mode or MODES:
        engine = base.model_copy(update={"mode": mode})
        warm_spark(settings, engine, passthrough.build)
        for workload in args.workload or DEFAULT_WORKLOADS:
            if against:
                _compare(settings, engine, against, workload, args)
                continue
            lines = []
            for run in range(1, args.repeat + 1):
                line = measure(settings, engine, workload, args)
                if args.repeat > 1:
                    line["run"] = run
                lines.append(line)
                _report(line, args.json)
            if args.repeat > 1:
                _report(summary(lines), args.json)
    if not args.json:
        print(f"(whole benchmark: {time.perf_counter() - began:.0f} s)", file=sys.stderr)


#: Settings that shape the SparkSession, which a benchmark process starts once: an
#: instance of the other settings would run on the same session, the setting unused.
_SESSION_FIELDS = (
    "spark_master",
    "spark_conf",
    "driver_memory",
    "jvm_class_archive",
    "worker_preconnect",
)


def _against(parser: argparse.ArgumentParser, given: list[str]) -> dict[str, Any]:
    """``--against`` as settings to update, each value as JSON if it parses, else text;
    a parser error naming what is wrong otherwise."""
    update: dict[str, Any] = {}
    comparable = sorted(set(EngineSettings.model_fields) - {*_SESSION_FIELDS, "mode"})
    for item in given:
        field, sep, text = item.partition("=")
        if field in _SESSION_FIELDS or field == "mode":
            parser.error(
                f"--against {item!r}: {field} is fixed for the whole benchmark process "
                f"({'--mode chooses it' if field == 'mode' else 'it shapes the SparkSession'}); "
                f"compare it with two runs of this benchmark instead"
            )
        if not sep or field not in comparable:
            parser.error(
                f"--against {item!r}: give FIELD=VALUE with FIELD one of {', '.join(comparable)}"
            )
        try:
            update[field] = json.loads(text)
        except json.JSONDecodeError:
            update[field] = text
    if update:
        try:
            EngineSettings.model_validate({**EngineSettings().model_dump(), **update})
        except ValueError as exc:
            parser.error(f"--against: {exc}")
    return update


def _compare(
    settings: RocketMQSettings,
    engine: EngineSettings,
    update: dict[str, Any],
    workload: str,
    args: argparse.Namespace,
) -> None:
    """``args.repeat`` pairs of runs, the default engine and ``engine`` with ``update``,
    in alternating order; a line per run, then each side's medians and their ratios."""
    name = " ".join(f"{k}={v}" for k, v in update.items())
    other = engine.model_copy(update=update)
    sides: dict[str, list[dict[str, Any]]] = {"default": [], name: []}
    for run in range(1, args.repeat + 1):
        order = [("default", engine), (name, other)]
        for label, chosen in order if run % 2 else order[::-1]:
            line = {**measure(settings, chosen, workload, args), "engine": label, "run": run}
            sides[label].append(line)
            _report(line, args.json)
    medians = {label: summary(lines) for label, lines in sides.items()}
    for label, line in medians.items():
        _report({**line, "engine": label}, args.json)
    base, changed = medians["default"], medians[name]
    ratios = {
        "mode": engine.mode,
        "workload": workload,
        "engine": name,
        "runs": args.repeat,
        "p50_ratio": round(changed["p50_ms"] / max(base["p50_ms"], 1e-9), 3),
        "p99_ratio": round(changed["p99_ms"] / max(base["p99_ms"], 1e-9), 3),
    }
    print(json.dumps(ratios), flush=True)
    if not args.json:
        print(
            f"  {name} against the default: p50 x{ratios['p50_ratio']}, "
            f"p99 x{ratios['p99_ratio']} (medians of {args.repeat} runs each)",
            file=sys.stderr,
        )


def _report(line: dict[str, Any], quiet: bool) -> None:
    """Print ``line`` as JSON, and unless ``quiet`` a readable line on stderr."""
    print(json.dumps(line), flush=True)
    if not quiet:
        runs = f" (median of {line['runs']} runs)" if "runs" in line else ""
        print(
            f"  {line['mode']} {line['workload']}{runs}: p50 {line['p50_ms']} ms, p99 "
            f"{line['p99_ms']} ms at {line['sent_per_s']:.0f}/s sent, "
            f"{line['engine_per_s']:.0f}/s committed (max {line['max_per_s']:.0f}/s)",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
