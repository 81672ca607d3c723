"""Passthrough throughput and end-to-end latency, against the broker round trip.

Topology: source -> map(identity) -> sink (stage 0 only, no shuffle). Prints

- throughput: records/s over a pre-produced backlog, and its ratio to the
  ``broker_roundtrip`` baseline measured in the same run;
- latency: p50/p99 of (sink store time - source born time) with input produced
  live while the instance runs.

Usage::

    python benchmarks/passthrough.py --records 20000 --live 2000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._engine import (
    percentiles,
    produce,
    run_instance,
    run_live,
    unique,
    warm_spark,
)
from benchmarks.broker_roundtrip import measure
from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.serde import bytes_deserializer, text_serializer
from stream_assets.settings import EngineSettings, RocketMQSettings


def identity(value: Any) -> Any:
    """Pass the value on unchanged."""
    return value


def build(job: str, source: str, sink: str) -> Topology:
    """source -> map -> sink."""
    b = StreamBuilder(job)
    b.source(source, bytes_deserializer).map(identity).sink(sink, text_serializer)
    return b.build()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--live", type=int, default=2_000)
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    settings, engine = RocketMQSettings(), EngineSettings()

    base = measure(5_000, 8, args.size)
    print(f"baseline broker round trip: {base['roundtrip_msgs_per_s']:.0f} msg/s")
    warm_spark(settings, engine, build)

    job = unique("bench-pass")
    src, out = f"{job}-in", f"{job}-out"
    with RocketMQAdmin(settings) as admin:
        admin.create_topic(src, 4)
    body = b"x" * args.size
    produce(settings, src, [body] * args.records)
    run = run_instance(build(job, src, out), settings, engine, args.records)
    ratio = run.records_per_s / base["roundtrip_msgs_per_s"]
    print(
        f"passthrough throughput: {run.records_per_s:.0f} records/s "
        f"= {ratio:.2f} x broker round trip"
    )

    job = unique("bench-pass-live")
    inputs, outputs = run_live(
        build(job, f"{job}-in", f"{job}-out"), settings, engine, [body] * args.live
    )
    born = {(r.queue_id, r.queue_offset): r.born_timestamp for r in inputs}
    latencies = []
    for r in outputs:
        # key: job/op/<topic>/<queue>/<offset>/<n>
        parts = (r.key or "").split("/")
        latencies.append(r.store_timestamp - born[(int(parts[-3]), int(parts[-2]))])
    p50, p99 = percentiles(latencies)
    print(
        f"passthrough end-to-end latency over {len(latencies)} records: "
        f"p50 {p50:.0f} ms, p99 {p99:.0f} ms (trigger interval {engine.trigger_interval_ms} ms)"
    )


if __name__ == "__main__":
    main()
