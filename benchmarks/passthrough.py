"""Passthrough throughput (pre-produced and live) and latency, against batched produce.

Topology: source -> map(identity) -> sink (stage 0 only, no shuffle). Input
(``limits.record_bodies``): ``--records`` distinct records of ``--size`` bytes,
keyed, on fresh topics of ``--queues`` queues. Prints, measured in the same run:

- baseline: the batched produce of those records into the input topic
  (``limits.produce_batched``: one ``BatchProducer.send_all``), records/s;
- pre-produced: records/s from ``Instance.start`` to the end of the batch that
  committed the last record, and its ratio to the baseline (target >= 50 %);
- live: the same records sent (``send_all``, back to back) while the instance
  runs; records/s from the first send to the last batch, and its ratio;
- end-to-end latency p50/p99 at half the best of those two rates: records sent
  at that steady pace for ``--latency-seconds``; latency = sink store time -
  send time of the source record it came from (target p99 <= 1.5 s).

Usage::

    python benchmarks/passthrough.py [--records 200000] [--trigger-ms 500] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._engine import (
    WARM_UP_MESSAGES,
    EngineRun,
    add_engine_flags,
    create_topic,
    engine_from,
    knobs,
    latency_summary,
    latency_text,
    read_all,
    run_instance,
    run_live,
    unique,
    warm_spark,
)
from benchmarks.limits import produce_batched, record_bodies
from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.serde import bytes_deserializer, text_serializer
from stream_assets.settings import EngineSettings, RocketMQSettings


def identity(value: Any) -> Any:
    """Pass the value on unchanged."""
    return value


def record_key(value: bytes) -> str:
    """A key of the record's own (its first bytes): a sink keyed by it keeps order per key,
    which every record has to itself."""
    return value[:16].hex()


def build(
    job: str, source: str, sink: str, exactly_once: bool = False, keyed: bool = False
) -> Topology:
    """source -> map -> sink (``exactly_once``: the sink's records committed with the source
    position, one transaction a step; ``keyed``: the sink keyed by :func:`record_key`)."""
    b = StreamBuilder(job)
    b.source(source, bytes_deserializer).map(identity).sink(
        sink, text_serializer, key=record_key if keyed else None, exactly_once=exactly_once
    )
    return b.build()


def latency(
    settings: RocketMQSettings,
    args: argparse.Namespace,
    engine: EngineSettings,
    records_per_s: float,
    exactly_once: bool = False,
    keyed: bool = False,
) -> dict[str, float]:
    """p50/p99 (ms) of source send -> sink store with records sent at ``records_per_s``
    (``exactly_once``: the sink's, committed with the source position)."""
    count = max(100, int(records_per_s * args.latency_seconds))
    job = unique("bench-pass-lat")
    run, sent = run_live(
        build(job, f"{job}-in", f"{job}-out", exactly_once, keyed),
        settings,
        engine,
        record_bodies(count, args.size),
        count,
        args.queues,
        records_per_s,
        warm_up=[b"warm-up"] * WARM_UP_MESSAGES,
    )
    born = sent.born_at()
    samples: list[tuple[int, float]] = []
    seen: set[tuple[int, int]] = set()
    for r in read_all(settings, f"{job}-out"):
        # keys: [the sink's key] job/op/<topic>/<queue>/<offset>/<n> (the engine's, last)
        parts = (r.keys[-1] if r.keys else "").split("/")
        origin = (int(parts[-3]), int(parts[-2]))
        if origin in seen or origin not in born:  # a replayed batch's copy, or a warm-up
            continue
        seen.add(origin)
        samples.append((born[origin], float(r.store_timestamp - born[origin])))
    if len(samples) != count:
        print(f"warning: {len(samples)} of {count} records reached the sink", file=sys.stderr)
    return {
        "latency_target_records_per_s": records_per_s,
        "latency_sent_records_per_s": sent.msgs_per_s,
        "latency_engine_records_per_s": run.records_per_s,
        "latency_drain_s": run.seconds - sent.seconds,
        **latency_summary(samples, args.latency_warmup_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=100, help="bytes a record")
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
    parser.add_argument("--json", action="store_true", help="one JSON object of the figures")
    add_engine_flags(parser)
    args = parser.parse_args()
    settings = RocketMQSettings()
    engine = engine_from(args)
    used = {**knobs(engine), "records": args.records, "size": args.size, "queues": args.queues}
    say = (lambda _text: None) if args.json else print
    say("knobs: " + ", ".join(f"{k}={v}" for k, v in used.items()))
    figures: dict[str, Any] = {"knobs": used}
    began = time.perf_counter()

    records = record_bodies(args.records, args.size)
    job = unique("bench-pass")
    src = f"{job}-in"
    create_topic(settings, src, args.queues)
    base = produce_batched(settings, src, records)
    figures["produce_records_per_s"] = base
    say(f"baseline produce {args.size}-byte records (batched, send_all): {base:.0f} records/s")

    warm_spark(settings, engine, build)

    pre = run_instance(build(job, src, f"{job}-out"), settings, engine, args.records)
    figures["pre_records_per_s"] = pre.records_per_s
    figures["pre_ratio"] = pre.records_per_s / base
    figures["pre_batches"] = pre.batches
    say(
        f"pre-produced: {pre.records_per_s:.0f} records/s in {pre.seconds:.2f} s = "
        f"{100 * figures['pre_ratio']:.1f} % of batched produce (target >= 50 %)"
    )
    say(_run_line(pre))

    job = unique("bench-pass-live")
    live, sent = run_live(
        build(job, f"{job}-in", f"{job}-out"), settings, engine, records, args.records, args.queues
    )
    figures["live_records_per_s"] = live.records_per_s
    figures["live_sent_records_per_s"] = sent.msgs_per_s
    figures["live_ratio"] = live.records_per_s / base
    figures["live_batches"] = live.batches
    say(
        f"live: {live.records_per_s:.0f} records/s in {live.seconds:.2f} s (sent in "
        f"{sent.seconds:.2f} s at {sent.msgs_per_s:.0f} records/s) = "
        f"{100 * figures['live_ratio']:.1f} % of batched produce (target >= 50 %)"
    )
    say(_run_line(live))

    best = max(pre.records_per_s, live.records_per_s)
    lat = latency(settings, args, engine, best / 2)
    figures.update(lat)
    say(
        latency_text(
            lat,
            lat["latency_target_records_per_s"],
            lat["latency_sent_records_per_s"],
            "records",
            "records",
            args.latency_warmup_s,
        )
    )
    figures["wall_s"] = time.perf_counter() - began
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"(whole benchmark: {figures['wall_s']:.0f} s)")


def _run_line(run: EngineRun) -> str:
    stage0 = run.totals.get(0, {})
    return (
        f"  {stage0.get('records_in', 0):.0f} records in, {stage0.get('outputs', 0):.0f} out; "
        f"{run.batches.get(0, 0)} batches, slowest {run.max_batch_s.get(0, 0.0):.2f} s"
    )


if __name__ == "__main__":
    main()
