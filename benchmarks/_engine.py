"""Shared steps of the engine benchmarks: input, a warm SparkSession, timing, latency."""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer, OutgoingMessage
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.spark.instance import Instance
from stream_assets.settings import EngineSettings, RocketMQSettings

#: Seconds between two sends of a paced producer.
PACE_TICK_S = 0.02
#: Messages per ``send_all`` of an unpaced live producer.
LIVE_CHUNK = 500


@dataclass(frozen=True)
class EngineRun:
    """One timed run of an instance: from its start (or the first send) to the last batch."""

    records: int
    seconds: float
    totals: dict[int, dict[str, float]]
    batches: dict[int, int] = field(default_factory=dict)
    max_batch_s: dict[int, float] = field(default_factory=dict)

    @property
    def records_per_s(self) -> float:
        """Input records per second, start of processing to fully committed."""
        return self.records / self.seconds


@dataclass(frozen=True)
class Sent:
    """What :func:`produce_paced` sent: per body (by index), where and when."""

    #: (queue id, queue offset) of each body.
    positions: list[tuple[int, int]]
    #: Wall-clock ms just before the ``send_all`` that carried each body.
    born_ms: list[int]
    seconds: float

    @property
    def msgs_per_s(self) -> float:
        """Achieved send rate."""
        return len(self.positions) / self.seconds

    def born_at(self) -> dict[tuple[int, int], int]:
        """Born ms by (queue id, queue offset)."""
        return dict(zip(self.positions, self.born_ms, strict=True))


#: The names :func:`unique` gave out in this process. Every topic and consumer group
#: whose name starts with one of them is this benchmark's own (a job's topics and
#: groups are named after it), deleted when the process exits.
_MADE: list[str] = []


def unique(prefix: str) -> str:
    """A fresh job/topic name, whose topics and groups go when the benchmark exits."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    _MADE.append(name)
    return name


@atexit.register
def _delete_own_topics() -> None:
    """Delete the topics and groups named after :func:`unique`'s names.

    Left alone they piled up on the local broker: 953 topics after a few days of
    benchmarks, and loading their consume queues took its start past 90 s. (The
    messages stay in the commit log until the broker's retention removes them.)
    """
    if not _MADE:
        return
    prefixes = tuple(_MADE)
    try:
        with RocketMQAdmin(RocketMQSettings()) as admin:
            topics = sorted(t for t in admin.topic_names() if t.startswith(prefixes))
            groups = sorted(g for g in admin.group_names() if g.startswith(prefixes))
            for topic in topics:
                admin.delete_topic(topic)
            for group in groups:
                admin.delete_group(group)
    except RocketMQError as exc:
        left = ", ".join(f"{p}*" for p in prefixes)
        print(f"this benchmark's topics ({left}) stay on the broker: {exc}", file=sys.stderr)
        return
    done = f"deleted this benchmark's {len(topics)} topics and {len(groups)} consumer groups"
    print(done, file=sys.stderr)


def create_topic(settings: RocketMQSettings, topic: str, queues: int) -> None:
    """Create ``topic`` with ``queues`` queues."""
    with RocketMQAdmin(settings) as admin:
        admin.create_topic(topic, queues)


def produce(
    settings: RocketMQSettings, topic: str, bodies: Sequence[bytes], threads: int = 4
) -> float:
    """Send ``bodies`` (keyed by index) with one C++-client producer per thread; msg/s.

    One synchronous send at a time per thread: slow, kept for comparison
    (``limits.py``) and tiny inputs. Pre-produce with ``limits.produce_batched``.
    """

    def send(part: int) -> None:
        with Producer(settings) as producer:
            for i in range(part, len(bodies), threads):
                producer.send(topic, bodies[i], key=str(i))

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, range(threads)))
    return len(bodies) / (time.perf_counter() - start)


def produce_paced(
    settings: RocketMQSettings,
    topic: str,
    bodies: Sequence[bytes],
    msgs_per_s: float | None,
    chunk: int = LIVE_CHUNK,
) -> Sent:
    """Send ``bodies`` (keyed by index) with a :class:`BatchProducer`, at a steady pace.

    ``msgs_per_s``: every :data:`PACE_TICK_S`, one ``send_all`` of the messages
    due by then; None: back-to-back ``send_all`` calls of ``chunk`` messages.
    A paced send waits for its tick even when messages are due sooner: sent as
    soon as due, they went two to a call, at 124 us of CPU a message, half a
    core at WordCount's half max taken from the engine on a 2-core machine.
    """
    n = len(bodies)
    positions: list[tuple[int, int]] = []
    born: list[int] = []
    with BatchProducer(settings) as producer:
        start = time.perf_counter()
        sent = ticks = 0
        while sent < n:
            if msgs_per_s is None:
                due = min(n, sent + chunk)
            else:
                # On the schedule, not after the last send: a slow send does not slow the pace.
                wait = start + ticks * PACE_TICK_S - time.perf_counter()
                ticks += 1
                if wait > 0:
                    time.sleep(wait)
                due = min(n, int((time.perf_counter() - start) * msgs_per_s) + 1)
                if due <= sent:
                    continue
            born_ms = int(time.time() * 1000)
            receipts = producer.send_all(
                [OutgoingMessage(topic, bodies[i], key=str(i)) for i in range(sent, due)]
            )
            if len(receipts) != due - sent:
                raise RuntimeError(f"{len(receipts)} receipts for {due - sent} messages")
            positions.extend((r.queue_id, r.queue_offset) for r in receipts)
            born.extend([born_ms] * len(receipts))
            sent = due
        seconds = time.perf_counter() - start
    return Sent(positions, born, seconds)


def warm_spark(
    settings: RocketMQSettings, engine: EngineSettings, build: Callable[..., Topology]
) -> None:
    """Start (and keep) the SparkSession and Python workers on a tiny job, untimed."""
    job = unique("bench-warmup")
    src, out = f"{job}-in", f"{job}-out"
    create_topic(settings, src, 4)
    produce(settings, src, [b"warm up the workers"] * 40, threads=1)
    instance = Instance(build(job, src, out), rocketmq=settings, engine=engine, progress=_quiet)
    instance.start()
    instance.await_caught_up(300)
    instance.stop()


def _quiet(message: str) -> None:
    """Progress sink of benchmark instances: drop the start/stop chatter."""


def _finish(instance: Instance, start_wall: float, records: int) -> EngineRun:
    """Stop a caught-up ``instance``; its run ends at its last batch (not the lag poll)."""
    end_wall = max(m.last_batch_at for m in instance.metrics.values())
    instance.stop()
    metrics = instance.metrics
    return EngineRun(
        records,
        end_wall - start_wall,
        {i: dict(m.totals) for i, m in metrics.items()},
        {i: m.batches for i, m in metrics.items()},
        {i: m.max_batch_s for i, m in metrics.items()},
    )


def run_instance(
    topology: Topology, settings: RocketMQSettings, engine: EngineSettings, records: int
) -> EngineRun:
    """Run an instance over input already in its source topic, until all is committed.

    Timed from before :meth:`Instance.start` to the end of its last batch.
    """
    instance = Instance(topology, rocketmq=settings, engine=engine, progress=_quiet)
    start_wall = time.time()
    instance.start()
    instance.await_caught_up(1800, poll_s=0.2)
    return _finish(instance, start_wall, records)


#: Messages a latency run's instance reads through every stage before its clock starts
#: (``run_live``'s ``warm_up``): enough for every source queue, and every shuffle queue
#: of WordCount, to hold some, so every task has stepped.
WARM_UP_MESSAGES = 32


def run_live(
    topology: Topology,
    settings: RocketMQSettings,
    engine: EngineSettings,
    bodies: Sequence[bytes],
    records: int,
    queues: int,
    msgs_per_s: float | None = None,
    warm_up: Sequence[bytes] = (),
) -> tuple[EngineRun, Sent]:
    """Create the source, start an instance, then send ``bodies`` while it runs.

    ``msgs_per_s`` paces the sends (None: as fast as the producer goes). Timed
    from the first send to the end of the batch that committed the last input.
    ``warm_up``: bodies sent and committed through every stage first, so what is
    timed is a running instance, not its start (``footprint.py`` measures that):
    without them the first records waited for the tasks to come up.
    """
    create_topic(settings, topology.source_topic, queues)
    instance = Instance(topology, rocketmq=settings, engine=engine, progress=_quiet)
    instance.start()
    if warm_up:
        produce_paced(settings, topology.source_topic, warm_up, None)
        instance.await_caught_up(300, poll_s=0.05)
    start_wall = time.time()
    sent = produce_paced(settings, topology.source_topic, bodies, msgs_per_s)
    instance.await_caught_up(1800, poll_s=0.2)
    return _finish(instance, start_wall, records), sent


def read_all(settings: RocketMQSettings, topic: str) -> list[Record]:
    """Every record of ``topic``."""
    with RocketMQAdmin(settings) as admin:
        reader = QueueReader(admin, unique("bench-read"))
        try:
            return [r for q in admin.queues(topic) for r in reader.read(q, 0)]
        finally:
            reader.close()


def percentiles(values: Sequence[float]) -> tuple[float, float]:
    """p50 and p99 of ``values``."""
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[98]


def latency_summary(samples: Sequence[tuple[int, float]], warmup_s: float) -> dict[str, float]:
    """p50/p99/max of ``(born_ms, latency_ms)`` samples, overall and after ``warmup_s``."""
    values = [lat for _, lat in samples]
    first = min(born for born, _ in samples)
    steady = [lat for born, lat in samples if born - first >= warmup_s * 1000]
    p50, p99 = percentiles(values)
    s50, s99 = percentiles(steady) if len(steady) >= 2 else (float("nan"), float("nan"))
    return {
        "latency_samples": float(len(values)),
        "latency_p50_ms": p50,
        "latency_p99_ms": p99,
        "latency_max_ms": float(max(values)),
        "latency_steady_p50_ms": s50,
        "latency_steady_p99_ms": s99,
    }


def latency_text(
    lat: dict[str, float], target: float, sent: float, unit: str, noun: str, warmup_s: float
) -> str:
    """The benchmarks' one-line report of :func:`latency_summary` plus the drain time."""
    return (
        f"latency at half the max ({target:.0f} {unit}/s target, {sent:.0f} sent) over "
        f"{lat['latency_samples']:.0f} {noun}: p50 {lat['latency_p50_ms']:.0f} ms, "
        f"p99 {lat['latency_p99_ms']:.0f} ms, max {lat['latency_max_ms']:.0f} ms "
        f"(target p99 <= 1500 ms); after the first {warmup_s:g} s: "
        f"p50 {lat['latency_steady_p50_ms']:.0f} ms, p99 {lat['latency_steady_p99_ms']:.0f} ms; "
        f"caught up {lat['latency_drain_s']:.2f} s after the last send"
    )


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """``--trigger-ms``, ``--mode`` and ``--max-records-per-batch`` (default: EngineSettings,
    env included)."""
    defaults = EngineSettings()
    parser.add_argument(
        "--trigger-ms",
        type=int,
        default=defaults.trigger_interval_ms,
        help="trigger interval of every stage query (default %(default)s)",
    )
    parser.add_argument(
        "--mode",
        choices=("micro-batch", "real-time"),
        default=defaults.mode,
        help="execution mode (default %(default)s)",
    )
    parser.add_argument(
        "--max-records-per-batch",
        type=int,
        default=defaults.max_records_per_batch,
        help="messages a stage reads per micro-batch at most (default %(default)s)",
    )


def engine_from(args: argparse.Namespace, **more: object) -> EngineSettings:
    """EngineSettings with the knobs of :func:`add_engine_flags` (and ``more``) applied."""
    defaults = EngineSettings()
    update: dict[str, object] = {
        # No console progress bars on stderr between the figures.
        "spark_conf": {"spark.ui.showConsoleProgress": "false", **defaults.spark_conf},
        "trigger_interval_ms": args.trigger_ms,
        "max_records_per_batch": args.max_records_per_batch,
        "mode": args.mode,
        **more,
    }
    return defaults.model_copy(update=update)


def knobs(engine: EngineSettings) -> dict[str, object]:
    """The engine settings a benchmark's figures depend on."""
    return {
        "mode": engine.mode,
        "spark_master": engine.spark_master,
        "trigger_interval_ms": engine.trigger_interval_ms,
        "max_records_per_batch": engine.max_records_per_batch,
        "pre_combine": engine.pre_combine,
        "shuffle_queues": engine.shuffle_queues,
        "sink_queues": engine.sink_queues,
    }
