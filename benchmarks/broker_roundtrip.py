"""Baseline: raw produce / consume / round-trip throughput of the RocketMQ broker.

Sends ``--messages`` keyed messages of ``--size`` bytes to a fresh topic of
``--queues`` queues (through :func:`stream_assets.roundtrip.run_roundtrip`:
the C++-client producer, one synchronous send at a time), reads every queue
back with the remoting queue reader, checks every byte, and prints messages/s
and MiB/s. The broker is the one ``RocketMQSettings()`` addresses (env
``STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR``, default the dev broker at
127.0.0.1:9876; ``stream-assets broker start`` starts it).

Other benchmarks divide by these figures::

    from benchmarks.broker_roundtrip import measure  # or `from broker_roundtrip ...`
                                                     # in a script run from benchmarks/
    base = measure(20_000, 8, 1024)
    base["roundtrip_msgs_per_s"]

Usage::

    python benchmarks/broker_roundtrip.py --messages 20000 --queues 8 --size 1024
"""

from __future__ import annotations

import argparse
import json
import sys

from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.roundtrip import RoundtripReport, run_roundtrip
from stream_assets.settings import RocketMQSettings

_MIB = 1024 * 1024

#: The keys of :func:`measure`'s result.
FIGURE_KEYS = ("produce_msgs_per_s", "consume_msgs_per_s", "roundtrip_msgs_per_s")


def run(
    messages: int, queues: int, size: int, settings: RocketMQSettings | None = None
) -> RoundtripReport:
    """One checked round trip; raises RuntimeError if any message was lost or altered."""
    if messages <= 0 or queues <= 0 or size < 6:
        raise ValueError(
            f"need messages > 0, queues > 0 and size >= 6 (the body carries a 6-byte header); "
            f"got messages={messages}, queues={queues}, size={size}"
        )
    report = run_roundtrip(
        messages, queues, body_bytes=size, settings=settings or RocketMQSettings()
    )
    if not report.ok:
        raise RuntimeError(
            f"round trip failed, figures are not a valid baseline:\n{report.describe()}"
        )
    return report


def figures(report: RoundtripReport) -> dict[str, float]:
    """Messages per second of a report: produce, consume and the whole round trip."""
    return {
        "produce_msgs_per_s": report.rate(report.produce_s),
        "consume_msgs_per_s": report.rate(report.consume_s, report.received),
        "roundtrip_msgs_per_s": report.rate(report.produce_s + report.consume_s),
    }


def measure(
    messages: int, queues: int, size: int, settings: RocketMQSettings | None = None
) -> dict[str, float]:
    """Run one checked round trip and return its rates (keys: :data:`FIGURE_KEYS`)."""
    return figures(run(messages, queues, size, settings))


def _mib_per_s(msgs_per_s: float, size: int) -> float:
    return msgs_per_s * size / _MIB


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=20_000, help="messages to send (20000)")
    parser.add_argument("--queues", type=int, default=8, help="queues of the topic (8)")
    parser.add_argument("--size", type=int, default=1024, help="body bytes per message (1024)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)

    settings = RocketMQSettings()
    try:
        report = run(args.messages, args.queues, args.size, settings)
    except (RocketMQError, RuntimeError, ValueError) as exc:
        print(f"broker_roundtrip: {exc}", file=sys.stderr)
        return 1
    rates = figures(report)
    if args.json:
        out: dict[str, object] = {
            "namesrv_addr": settings.namesrv_addr,
            "messages": args.messages,
            "queues": args.queues,
            "size": args.size,
            "produce_s": report.produce_s,
            "consume_s": report.consume_s,
            **rates,
            **{k.replace("msgs", "mib"): _mib_per_s(v, args.size) for k, v in rates.items()},
        }
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"broker {settings.namesrv_addr}: {args.messages} messages x {args.size} bytes, "
        f"{args.queues} queues (topic {report.topic}, every byte checked)"
    )
    phases = (
        ("produce", report.produce_s, rates["produce_msgs_per_s"]),
        ("consume", report.consume_s, rates["consume_msgs_per_s"]),
        ("round trip", report.produce_s + report.consume_s, rates["roundtrip_msgs_per_s"]),
    )
    for name, seconds, rate in phases:
        print(
            f"  {name:<10} {seconds:8.2f} s  {rate:10.0f} msg/s  "
            f"{_mib_per_s(rate, args.size):8.2f} MiB/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
