"""WordCount throughput and latency, against raw read + count and Spark's own WordCount.

Input (``limits.wordcount_bodies``): ``--lines`` lines of 8 words from a
2 000-word vocabulary, ``--lines-per-message`` lines a message, fresh topics of
``--queues`` queues. Prints, measured in the same run:

- baseline "raw read + count" (``limits.consume``): one plain Python process
  pulling the input topic through the project's queue reader and counting the
  words with ``collections.Counter``, lines/s; measured on each input topic;
- baseline "Spark SQL WordCount" (``limits.spark_sql_wordcount``): Spark's own
  WordCount, plain JVM-native Structured Streaming (text files, ``split``,
  ``explode``, ``groupBy("word").count()``, memory sink, ``availableNow``) over
  the same lines written to ``--queues`` text files, on the engine's
  ``spark_master`` with ``spark.sql.shuffle.partitions`` = its ``shuffle_queues``;
  lines/s from the query's start to its end. Like ours, it leaves out the JVM
  and SparkSession start and an untimed warm-up run; unlike ours, it reads
  local files and shuffles and keeps its state inside Spark, with no broker
  and no Python in its tasks. Its counts are checked against
  ``collections.Counter`` (the benchmark fails if they differ). It runs in a
  process of its own, before our instance starts;
- pre-produced: every line in the topic before the instance starts; lines/s
  from ``Instance.start`` (SparkSession and Python workers already warm, from
  ``warm_spark``) to the end of the batch that committed the last of it, its
  ratio to the raw baseline (target >= 25 %) and ``ours / Spark SQL``;
- vectorised, pre-produced: the same input through ``examples/wordcount_arrow.py``
  (batch operators, Arrow compute), its ratio to the raw baseline (target >= 50 %)
  and to Spark SQL;
- live: the same input sent (``BatchProducer.send_all``, back to back) while the
  instance runs; lines/s from the first send to the last batch, its ratio to the
  raw baseline on its topic and ``ours / Spark SQL``;
- the shuffle traffic of each (messages, and entries: words, or pre-combined
  partials where the engine pre-combines);
- end-to-end latency p50/p99 at half the best of those two rates: messages sent
  at that steady pace for ``--latency-seconds``, each with a unique marker word;
  latency = store time of the marker's first count - send time of its message
  (target p99 <= 1.5 s).

Usage::

    python benchmarks/wordcount.py [--lines 200000] [--trigger-ms 500] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._engine import (
    WARM_UP_MESSAGES,
    EngineRun,
    Sent,
    add_engine_flags,
    create_topic,
    engine_from,
    knobs,
    latency_summary,
    latency_text,
    percentiles,
    read_all,
    run_instance,
    run_live,
    unique,
    warm_spark,
)
from benchmarks.limits import consume, produce_batched, spark_sql_wordcount, wordcount_bodies
from stream_assets.examples import wordcount, wordcount_arrow
from stream_assets.plan.topology import Topology
from stream_assets.runtime.core.shuffle_codec import decode
from stream_assets.settings import EngineSettings, RocketMQSettings

MARKER = "marker"


def shuffle_figures(run: EngineRun) -> dict[str, float]:
    """Shuffle messages and entries stage 0 sent, and the words stage 1 took in."""
    stage0, stage1 = run.totals.get(0, {}), run.totals.get(1, {})
    return {
        "messages_in": stage0.get("records_in", 0.0),
        "shuffle_messages": stage0.get("shuffle_messages", 0.0),
        "shuffle_entries": stage0.get("shuffle_records", 0.0),
        "stage1_entries_in": stage1.get("records_in", 0.0),
        "outputs": stage1.get("outputs", 0.0),
    }


def spark_sql_baseline(
    bodies: list[bytes], queues: int, engine: EngineSettings
) -> dict[str, float]:
    """Spark's own WordCount over ``bodies`` (``limits.spark_sql_wordcount``), with the
    engine's master, shuffle queues as shuffle partitions, driver memory and Spark conf.

    In a process of its own (spawned: a fresh interpreter, no state forked from
    this one), run before our instance. A SparkSession in this process would
    either launch the JVM our instance later reuses, with the baseline's conf
    and a heap full of its garbage, or be the active session our instance takes
    over (``Instance._session`` reuses one); a stopped session also leaves the
    JVM, its loaded classes and JIT, warmer than when ours runs alone. The
    subprocess's JVM, memory and threads are gone before ours is measured
    (``warm_spark``, untimed, runs in between), so ours runs exactly as without
    the baseline, and the baseline as if alone too.
    """
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=_stdout_to_stderr) as pool:
        return pool.submit(
            spark_sql_wordcount,
            bodies,
            queues,
            engine.shuffle_queues,
            engine.spark_master,
            {"spark.driver.memory": engine.driver_memory, **engine.spark_conf},
        ).result()


def _stdout_to_stderr() -> None:
    """In the baseline's process: whatever it or its JVM prints goes to stderr, so
    ``--json`` still prints one object alone on stdout."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


def marked(bodies: list[bytes]) -> list[bytes]:
    """Each body with one word unique to it appended (``marker<index>``)."""
    return [body + f" {MARKER}{i}".encode() for i, body in enumerate(bodies)]


@dataclass
class MarkerRun:
    """A paced WordCount run with a marker word in every message, and when each was seen."""

    topology: Topology
    run: EngineRun
    sent: Sent
    #: Marker index -> store time of the first sink message counting it.
    first_seen: dict[int, int]
    #: ``(born_ms, latency_ms)`` per marker counted.
    samples: list[tuple[int, float]]


def marker_run(
    settings: RocketMQSettings,
    args: argparse.Namespace,
    engine: EngineSettings,
    lines_per_s: float,
    exactly_once: bool = False,
) -> MarkerRun:
    """Send ``args.latency_seconds`` of marked WordCount lines at ``lines_per_s`` while an
    instance runs; each marker's latency: send -> store of its first count."""
    msgs_per_s = lines_per_s / args.lines_per_message
    count = max(100, int(msgs_per_s * args.latency_seconds))
    bodies = marked(wordcount_bodies(count * args.lines_per_message, args.lines_per_message, 9))
    job = unique("bench-wc-lat")
    topology = wordcount.build(job, f"{job}-in", f"{job}-out", exactly_once)
    run, sent = run_live(
        topology,
        settings,
        engine,
        bodies,
        count * args.lines_per_message,
        args.queues,
        msgs_per_s,
        warm_up=wordcount_bodies(WARM_UP_MESSAGES * args.lines_per_message, args.lines_per_message),
    )
    first_seen: dict[int, int] = {}
    for r in read_all(settings, f"{job}-out"):
        key = json.loads(r.body)["key"]
        if key.startswith(MARKER):
            i = int(key[len(MARKER) :])
            first_seen[i] = min(first_seen.get(i, r.store_timestamp), r.store_timestamp)
    if len(first_seen) != count:
        print(f"warning: {len(first_seen)} of {count} markers counted", file=sys.stderr)
    samples = [(sent.born_ms[i], float(first_seen[i] - sent.born_ms[i])) for i in first_seen]
    return MarkerRun(topology, run, sent, first_seen, samples)


def latency(
    settings: RocketMQSettings,
    args: argparse.Namespace,
    engine: EngineSettings,
    lines_per_s: float,
    exactly_once: bool = False,
) -> dict[str, float]:
    """p50/p99 (ms) of marker latency with lines sent at ``lines_per_s`` (``exactly_once``:
    the sink's, so a count is seen when its step's transaction is committed)."""
    marks = marker_run(settings, args, engine, lines_per_s, exactly_once)
    run, sent, first_seen, samples = marks.run, marks.sent, marks.first_seen, marks.samples
    shuffled = marker_shuffle_times(settings, marks.topology.stages[1].input_topic)
    return {
        "latency_target_lines_per_s": lines_per_s,
        "latency_sent_lines_per_s": sent.msgs_per_s * args.lines_per_message,
        "latency_engine_lines_per_s": run.records_per_s,
        "latency_drain_s": run.seconds - sent.seconds,
        **latency_summary(samples, args.latency_warmup_s),
        **stage_halves(sent.born_ms, shuffled, first_seen),
    }


def marker_shuffle_times(settings: RocketMQSettings, topic: str) -> dict[int, int]:
    """By marker index, the store time of the first shuffle message that holds its word."""
    first: dict[int, int] = {}
    for r in read_all(settings, topic):
        body = decode(r.body)
        for entry in body.get("comb") or body.get("recs") or ():
            key = entry[0]
            if isinstance(key, str) and key.startswith(MARKER):
                i = int(key[len(MARKER) :])
                first[i] = min(first.get(i, r.store_timestamp), r.store_timestamp)
    return first


def stage_halves(
    born_ms: list[int], shuffled: dict[int, int], counted: dict[int, int]
) -> dict[str, float]:
    """p50/p99 of each half of a marker's latency: sent -> stored in a shuffle message
    (stage 0: its wait for a step, the step, the send), and shuffle message -> its count
    stored in the sink (the keyed stage's). Where a record's time goes, by stage.

    >>> halves = stage_halves([0, 0, 0], {0: 10, 1: 20, 2: 30}, {0: 15, 1: 40, 2: 90})
    >>> halves["latency_stage0_p50_ms"], halves["latency_keyed_p99_ms"]
    (20.0, 59.2)
    """
    both = [i for i in counted if i in shuffled]
    if len(both) < 2:
        return {}
    stage0 = percentiles([float(shuffled[i] - born_ms[i]) for i in both])
    keyed = percentiles([float(counted[i] - shuffled[i]) for i in both])
    return {
        "latency_stage0_p50_ms": stage0[0],
        "latency_stage0_p99_ms": stage0[1],
        "latency_keyed_p50_ms": keyed[0],
        "latency_keyed_p99_ms": keyed[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--lines-per-message", type=int, default=20)
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument(
        "--latency-seconds", type=float, default=20.0, help="length of the paced latency run"
    )
    parser.add_argument(
        "--latency-warmup-s",
        type=float,
        default=5.0,
        help="first seconds of the latency run left out of the 'steady' percentiles",
    )
    parser.add_argument(
        "--pre-combine",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pre-shuffle combine (default: EngineSettings)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object of the figures")
    add_engine_flags(parser)
    args = parser.parse_args()
    settings = RocketMQSettings()
    more = {} if args.pre_combine is None else {"pre_combine": args.pre_combine}
    engine = engine_from(args, **more)
    used = {
        **knobs(engine),
        "lines": args.lines,
        "lines_per_message": args.lines_per_message,
        "queues": args.queues,
    }
    say = (lambda _text: None) if args.json else print
    say("knobs: " + ", ".join(f"{k}={v}" for k, v in used.items()))
    figures: dict[str, Any] = {"knobs": used}
    began = time.perf_counter()

    bodies = wordcount_bodies(args.lines, args.lines_per_message)
    job = unique("bench-wc")
    src = f"{job}-in"
    create_topic(settings, src, args.queues)
    produced = produce_batched(settings, src, bodies)
    raw = consume(settings, src, count=True)["lines_per_s"]
    figures["produce_lines_per_s"] = produced * args.lines_per_message
    figures["raw_read_count_lines_per_s"] = raw
    say(
        f"input: {len(bodies)} messages, produced (batched) at "
        f"{figures['produce_lines_per_s']:.0f} lines/s"
    )
    say(f"baseline raw read + count (Counter, one process): {raw:.0f} lines/s")

    spark_sql = spark_sql_baseline(bodies, args.queues, engine)
    figures["spark_sql_wordcount"] = spark_sql
    figures["spark_sql_lines_per_s"] = spark_sql["lines_per_s"]
    say(
        f"Spark SQL WordCount (files, JVM-native): {spark_sql['lines_per_s']:.0f} lines/s "
        f"in {spark_sql['seconds']:.2f} s ({args.queues} files read in "
        f"{spark_sql['input_partitions']:.0f} tasks, {spark_sql['shuffle_partitions']:.0f} "
        f"shuffle partitions, {engine.spark_master}; counts equal Counter's)"
    )

    warm_spark(settings, engine, wordcount.build)

    pre = run_instance(wordcount.build(job, src, f"{job}-out"), settings, engine, args.lines)
    figures["pre_lines_per_s"] = pre.records_per_s
    figures["pre_ratio"] = pre.records_per_s / raw
    figures["pre_spark_sql_ratio"] = pre.records_per_s / spark_sql["lines_per_s"]
    figures["pre_shuffle"] = shuffle_figures(pre)
    figures["pre_batches"] = pre.batches
    say(
        f"pre-produced: {pre.records_per_s:.0f} lines/s in {pre.seconds:.2f} s = "
        f"{100 * figures['pre_ratio']:.1f} % of raw read + count (target >= 25 %)"
    )
    say(f"  ours / Spark SQL: {figures['pre_spark_sql_ratio']:.2f}x")
    say(_shuffle_line(pre))

    # The vectorised WordCount (Arrow batch operators) over the same pre-produced input.
    arrow_job = unique("bench-wc-arrow")
    arrow = run_instance(
        wordcount_arrow.build(arrow_job, src, f"{arrow_job}-out"), settings, engine, args.lines
    )
    figures["arrow_lines_per_s"] = arrow.records_per_s
    figures["arrow_ratio"] = arrow.records_per_s / raw
    figures["arrow_spark_sql_ratio"] = arrow.records_per_s / spark_sql["lines_per_s"]
    say(
        f"vectorised (batch operators), pre-produced: {arrow.records_per_s:.0f} lines/s in "
        f"{arrow.seconds:.2f} s = {100 * figures['arrow_ratio']:.1f} % of raw read + count "
        f"(target >= 50 %); ours / Spark SQL: {figures['arrow_spark_sql_ratio']:.2f}x"
    )
    say(_shuffle_line(arrow))

    job = unique("bench-wc-live")
    live, sent = run_live(
        wordcount.build(job, f"{job}-in", f"{job}-out"),
        settings,
        engine,
        bodies,
        args.lines,
        args.queues,
    )
    raw_live = consume(settings, f"{job}-in", count=True)["lines_per_s"]
    figures["live_lines_per_s"] = live.records_per_s
    figures["live_sent_lines_per_s"] = sent.msgs_per_s * args.lines_per_message
    figures["live_raw_read_count_lines_per_s"] = raw_live
    figures["live_ratio"] = live.records_per_s / raw_live
    figures["live_spark_sql_ratio"] = live.records_per_s / spark_sql["lines_per_s"]
    figures["live_shuffle"] = shuffle_figures(live)
    figures["live_batches"] = live.batches
    say(
        f"live: {live.records_per_s:.0f} lines/s in {live.seconds:.2f} s "
        f"(sent in {sent.seconds:.2f} s) = {100 * figures['live_ratio']:.1f} % of raw "
        f"read + count on its topic ({raw_live:.0f} lines/s) (target >= 25 %)"
    )
    say(f"  ours / Spark SQL: {figures['live_spark_sql_ratio']:.2f}x")
    say(_shuffle_line(live))

    best = max(pre.records_per_s, live.records_per_s)
    lat = latency(settings, args, engine, best / 2)
    figures.update(lat)
    say(
        latency_text(
            lat,
            lat["latency_target_lines_per_s"],
            lat["latency_sent_lines_per_s"],
            "lines",
            "markers",
            args.latency_warmup_s,
        )
    )
    figures["wall_s"] = time.perf_counter() - began
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"(whole benchmark: {figures['wall_s']:.0f} s)")


def _shuffle_line(run: EngineRun) -> str:
    f = shuffle_figures(run)
    return (
        f"  {f['messages_in']:.0f} messages in, {f['shuffle_messages']:.0f} shuffle "
        f"messages carrying {f['shuffle_entries']:.0f} entries, "
        f"{f['outputs']:.0f} count updates out; "
        f"batches per stage {run.batches}, slowest batch per stage "
        + ", ".join(f"{k}: {v:.2f} s" for k, v in run.max_batch_s.items())
    )


if __name__ == "__main__":
    main()
