"""The ``stream-assets`` command line.

Examples::

    stream-assets broker start          # resolve + start the local RocketMQ
    stream-assets topic create orders --queues 8
    stream-assets topic offsets orders
    stream-assets roundtrip             # produce and read back, printing what it did
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from stream_assets.rocketmq.errors import RocketMQError


def _broker(args: argparse.Namespace) -> int:
    from stream_assets.broker.local import LocalBroker

    broker = LocalBroker()
    if args.action == "start":
        broker.start()
    elif args.action == "stop":
        broker.stop()
        print("RocketMQ stopped")
    else:
        status = broker.status()
        print(status.describe())
        return 0 if status.serving else 3
    return 0


def _topic(args: argparse.Namespace) -> int:
    from stream_assets.rocketmq.admin import RocketMQAdmin

    with RocketMQAdmin() as admin:
        if args.action == "create":
            route = admin.create_topic(args.name, args.queues)
            print(f"topic {args.name}: {route.write_queue_count} queues")
        else:
            for q in admin.queue_offsets(args.name):
                print(f"{q.queue.topic}[{q.queue.queue_id}] min={q.min_offset} max={q.max_offset}")
    return 0


def _roundtrip(args: argparse.Namespace) -> int:
    from stream_assets.roundtrip import run_roundtrip

    report = run_roundtrip(messages=args.messages, queues=args.queues)
    print(report.describe())
    return 0 if report.ok else 1


def _run(args: argparse.Namespace) -> int:
    from stream_assets.examples import EXAMPLES

    if args.example not in EXAMPLES:
        raise ValueError(f"unknown example {args.example!r}; choose from {sorted(EXAMPLES)}")
    if args.example == "wordcount" and args.demo_lines:
        from stream_assets.examples.demo import run_wordcount_demo

        report = run_wordcount_demo(args.demo_lines)
        print(
            f"WordCount over {report.lines} lines ({report.words} words) in {report.seconds:.1f}s"
        )
        for word, count in report.top:
            print(f"  {word:<12} {count}")
        print("matches an independent count: " + ("yes" if report.matches else "NO"))
        return 0 if report.matches else 1
    from stream_assets.runtime.instance import Instance

    instance = Instance(EXAMPLES[args.example]())
    instance.start()
    try:
        while True:
            instance.check_failed()
            time.sleep(5)
            print(f"lag: {instance.lag()}", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        instance.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``stream-assets``."""
    parser = argparse.ArgumentParser(prog="stream-assets", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    broker = sub.add_parser("broker", help="the local Apache RocketMQ namesrv + broker")
    broker.add_argument("action", choices=["start", "stop", "status"])
    broker.set_defaults(func=_broker)

    topic = sub.add_parser("topic", help="create a topic or show its queue offsets")
    topic.add_argument("action", choices=["create", "offsets"])
    topic.add_argument("name")
    topic.add_argument("--queues", type=int, default=8)
    topic.set_defaults(func=_topic)

    rt = sub.add_parser("roundtrip", help="produce messages and read them back")
    rt.add_argument("--messages", type=int, default=1000)
    rt.add_argument("--queues", type=int, default=8)
    rt.set_defaults(func=_roundtrip)
    run = sub.add_parser("run", help="run one instance of an example topology")
    run.add_argument("example", help="wordcount | windowed-sum | seed-article")
    run.add_argument(
        "--demo-lines",
        type=int,
        default=0,
        help="wordcount only: produce N generated lines, run until done, check the counts",
    )
    run.set_defaults(func=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-assets`` console script."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (RocketMQError, ValueError) as exc:
        print(f"stream-assets: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
