"""The ``stream-assets`` command line.

Examples::

    stream-assets broker start          # resolve + start the local RocketMQ
    stream-assets cluster start         # a local cluster: broker-a master + slave, broker-b
    stream-assets deploy up             # the production-shaped deployment (docs/deployment.md)
    stream-assets topic create orders --queues 8
    stream-assets topic offsets orders
    stream-assets roundtrip             # produce and read back, printing what it did
    stream-assets reset wordcount --to-time 2025-11-21T14:30:00Z   # show the plan; --yes applies
    stream-assets stop wordcount        # as stop_topology_job, when Dagster itself is slow
    stream-assets start wordcount
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


def _cluster(args: argparse.Namespace) -> int:
    from stream_assets.broker.cluster import LocalCluster

    cluster = LocalCluster()
    if args.action == "start":
        cluster.start()
    elif args.action == "stop":
        cluster.stop()
        print("RocketMQ cluster stopped")
    else:
        status = cluster.status()
        print(status.describe())
        return 0 if status.serving else 3
    return 0


def _deploy(args: argparse.Namespace) -> int:
    from stream_assets.deploy.prod_like import ProdLike

    deployment = ProdLike()
    if args.action == "up":
        timings = deployment.up()
        print(f"production-shaped deployment up in {max(timings.values()):.0f} s: {timings}")
    elif args.action == "down":
        deployment.down()
    elif args.action == "feeder-stop":
        print("feeder stopped" if deployment.feeder.stop() else "the feeder was not running")
    elif args.action == "feeder-start":
        print(f"feeder running (pid {deployment.start_feeder()})")
    elif args.action == "topology-stop":
        deployment.stop_topology(through_dagster=False)
    elif args.action == "topology-start":
        deployment.start_topology(through_dagster=False)
    else:
        print(deployment.status())
    return 0


def _topic(args: argparse.Namespace) -> int:
    from stream_assets.rocketmq.admin import RocketMQAdmin
    from stream_assets.settings import RocketMQSettings

    with RocketMQAdmin(RocketMQSettings()) as admin:
        if args.action == "create":
            route = admin.create_topic(args.name, args.queues)
            print(f"topic {args.name}: {route.write_queue_count} queues")
        else:
            for q in admin.queue_offsets(args.name):
                print(f"{q.queue.topic}[{q.queue.queue_id}] min={q.min_offset} max={q.max_offset}")
    return 0


def _roundtrip(args: argparse.Namespace) -> int:
    from stream_assets.roundtrip import run_roundtrip
    from stream_assets.settings import RocketMQSettings

    report = run_roundtrip(messages=args.messages, queues=args.queues, settings=RocketMQSettings())
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
    from stream_assets.runtime.spark.instance import Instance
    from stream_assets.settings import EngineSettings, RocketMQSettings

    instance = Instance(
        EXAMPLES[args.example](), rocketmq=RocketMQSettings(), engine=EngineSettings()
    )
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


def _state(args: argparse.Namespace) -> int:
    from stream_assets.control.state_query import parse_key, parse_window, query_state
    from stream_assets.settings import RocketMQSettings

    key = parse_key(args.key, as_json=args.json)
    window = parse_window(args.window) if args.window else None
    answer = query_state(
        args.topology,
        key,
        window=window,
        operator=args.operator,
        rocketmq=RocketMQSettings(),
        progress=lambda line: print(line, file=sys.stderr),
    )
    if not answer.found:
        # Not an error of the command: the key has no committed state (yet).
        what = "no open window" if answer.windowed and window is None else "no state"
        why = (
            "fired windows leave the state (their results are in the sink topic), or the key "
            "was never seen"
            if answer.windowed
            else "the key was never seen"
        )
        print(
            f"{what} for key {key!r} in queue {answer.queue_id} of {answer.state_topic} "
            f"(read to seq {answer.seq}): {why}; a key is a string unless --json "
            "(numbers, lists)",
            file=sys.stderr,
        )
        return 1
    print(answer.value_json(indent=2))  # stdout holds only the JSON value (pipe it to jq)
    return 0


def _reset(args: argparse.Namespace) -> int:
    import contextlib
    import os
    from pathlib import Path

    from stream_assets.control.registry import registration
    from stream_assets.control.reset import parse_reset_time
    from stream_assets.control.reset_guard import run_reset_command
    from stream_assets.settings import EngineSettings, RocketMQSettings

    target = parse_reset_time("earliest" if args.to_earliest else args.to_time)
    try:
        topology = registration(args.topology).topology()
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    root = Path(args.state_dir) if args.state_dir else EngineSettings().resolved_state_dir()
    with contextlib.ExitStack() as stack:
        instance = None
        if os.environ.get("DAGSTER_HOME"):
            # Its runs and supervisor are what may still run the topology.
            import dagster as dg

            instance = stack.enter_context(dg.DagsterInstance.get())
        return run_reset_command(
            topology,
            target,
            apply=args.yes,
            settings=RocketMQSettings(),
            state_root=root,
            instance=instance,
            say=lambda line: print(line, file=sys.stderr),
        )


def _upgrade(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stream_assets.control.registry import registration
    from stream_assets.control.upgrade import apply_upgrade
    from stream_assets.rocketmq.admin import RocketMQAdmin
    from stream_assets.settings import EngineSettings, RocketMQSettings

    try:
        topology = registration(args.topology).topology()
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    root = Path(args.state_dir) if args.state_dir else EngineSettings().resolved_state_dir()
    with RocketMQAdmin(RocketMQSettings()) as admin:
        outcome = apply_upgrade(
            topology,
            admin,
            drop=args.drop_state,
            state_root=root,
            say=lambda line: print(line, file=sys.stderr),
            apply=args.yes,
        )
    print(outcome.describe())
    if not args.yes:
        print("(a dry run: add --yes to drop that state and record the topology)", file=sys.stderr)
    return 0


def _lifecycle(args: argparse.Namespace) -> int:
    """stop/start a topology through the Dagster instance's storage alone (DAGSTER_HOME):
    the same desired state and fencing as the jobs, for when the daemon or the code
    server is what is slow. The supervisor sensor acts on it at its next tick."""
    import dagster as dg

    from stream_assets.jobs.lifecycle import PrintLog, start, stop
    from stream_assets.settings import EngineSettings, RocketMQSettings

    log = PrintLog(lambda line: print(line, file=sys.stderr))

    try:
        instance = dg.DagsterInstance.get()
    except dg.DagsterError as exc:
        raise ValueError(
            f"no Dagster instance to act on ({exc}); set DAGSTER_HOME to the deployment's "
            "(bash infra/dev.sh sets .local/dagster); for the production-shaped deployment "
            "use `stream-assets deploy topology-stop` / `topology-start`"
        ) from None
    try:
        with instance:
            if args.command == "stop":
                before, runs = stop(instance, args.topology, args.timeout, args.drain, log)
                print(
                    f"{args.topology}: stopped ({before} instances before, {len(runs)} runs ended)"
                )
            else:
                outcome = start(
                    instance,
                    args.topology,
                    args.instances,
                    RocketMQSettings(),
                    EngineSettings(),
                    args.wait,
                    log,
                )
                print(f"{args.topology}: {outcome}")
    except dg.Failure as exc:
        print(f"stream-assets: error: {exc.description}", file=sys.stderr)
        return 1
    return 0


def _jvm_archive(args: argparse.Namespace) -> int:
    from stream_assets.runtime.spark.class_archive import build

    # No archive is no error: JVMs start without one, as before.
    build(lambda line: print(line, file=sys.stderr), force=args.force)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``stream-assets``."""
    parser = argparse.ArgumentParser(prog="stream-assets", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    broker = sub.add_parser("broker", help="the local Apache RocketMQ namesrv + broker")
    broker.add_argument("action", choices=["start", "stop", "status"])
    broker.set_defaults(func=_broker)

    cluster = sub.add_parser(
        "cluster",
        help="a local Apache RocketMQ cluster: name server, broker-a master + slave, broker-b "
        "master (settings: STREAM_ASSETS_CLUSTER_*)",
    )
    cluster.add_argument("action", choices=["start", "stop", "status"])
    cluster.set_defaults(func=_cluster)

    deploy = sub.add_parser(
        "deploy",
        help="the production-shaped deployment on this machine: Postgres, a RocketMQ cluster "
        "with ACL, a 2-worker Spark cluster, Dagster webserver + daemon, WordCount fed live "
        "(settings: STREAM_ASSETS_DEPLOY_*; docs/deployment.md)",
    )
    deploy.add_argument(
        "action",
        choices=[
            "up",
            "down",
            "status",
            "feeder-stop",
            "feeder-start",
            "topology-stop",
            "topology-start",
        ],
        help="topology-stop/-start act through the deployment's Dagster storage, without "
        "its webserver, daemon or code server",
    )
    deploy.set_defaults(func=_deploy)

    archive = sub.add_parser(
        "jvm-archive",
        help="write this machine's class-data archive for the Spark driver JVM (once per JDK "
        "and Spark version; infra/dev.sh's setup runs it): JVMs start ~3 s sooner",
    )
    archive.add_argument("--force", action="store_true", help="write it again")
    archive.set_defaults(func=_jvm_archive)

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

    state = sub.add_parser(
        "state", help="read a key's current aggregate from a topology's state topic"
    )
    state.add_argument("action", choices=["get"])
    state.add_argument("topology", help="a registered topology (job id)")
    state.add_argument("key", help="the grouping key; a string unless --json")
    state.add_argument(
        "--json", action="store_true", help="parse KEY as JSON (42 is an int, [1, 2] a tuple)"
    )
    state.add_argument(
        "--window", metavar="START,END", help="one window of a windowed aggregate (epoch ms)"
    )
    state.add_argument(
        "--operator", metavar="OP_ID", help="the aggregate, when the topology has several"
    )
    state.set_defaults(func=_state)

    reset = sub.add_parser(
        "reset",
        help="reset a topology to its first offsets or to a time; results are recomputed",
    )
    reset.add_argument("topology", help="a registered topology (job id)")
    when = reset.add_mutually_exclusive_group(required=True)
    when.add_argument("--to-earliest", action="store_true", help="each queue's first offset")
    when.add_argument(
        "--to-time",
        metavar="TIME",
        help="ISO 8601 with a UTC offset (2025-11-21T14:30:00Z) or epoch ms: the first message "
        "stored at or after it",
    )
    reset.add_argument("--yes", action="store_true", help="apply the plan (default: show it)")
    reset.add_argument(
        "--state-dir", metavar="PATH", help="local state root (default: the engine's state dir)"
    )
    reset.set_defaults(func=_reset)

    upgrade = sub.add_parser(
        "upgrade",
        help="show what starting a changed topology does with its state; with --drop-state "
        "and --yes, drop the state of operators that cannot carry it over (docs/operating.md)",
    )
    upgrade.add_argument("topology", help="a registered topology (job id)")
    upgrade.add_argument(
        "--drop-state",
        metavar="OPERATOR",
        action="append",
        default=[],
        help="an operator whose state may go (repeatable): it starts empty",
    )
    upgrade.add_argument("--yes", action="store_true", help="apply (default: show the plan)")
    upgrade.add_argument(
        "--state-dir", metavar="PATH", help="local state root (default: the engine's state dir)"
    )
    upgrade.set_defaults(func=_upgrade)

    stop = sub.add_parser(
        "stop",
        help="stop a topology as stop_topology_job does, without Dagster's daemon or code "
        "server (DAGSTER_HOME's storage): every instance finishes its batch and exits",
    )
    stop.add_argument("topology", help="a registered topology (job id)")
    stop.add_argument("--drain", action="store_true", help="consume every shuffle topic first")
    stop.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a run is cancelled"
    )
    stop.set_defaults(func=_lifecycle)

    start = sub.add_parser(
        "start",
        help="start a stopped topology as start_topology_job does (DAGSTER_HOME's storage); "
        "the supervisor sensor launches its instances",
    )
    start.add_argument("topology", help="a registered topology (job id)")
    start.add_argument(
        "--instances", type=int, default=0, help="how many (default: as before the stop)"
    )
    start.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="seconds to wait for every instance to heartbeat (default: return at once)",
    )
    start.set_defaults(func=_lifecycle)
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
