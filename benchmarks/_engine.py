"""Shared steps of the engine benchmarks: input, a warm SparkSession, timing, latency."""

from __future__ import annotations

import concurrent.futures
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.instance import Instance
from stream_assets.settings import EngineSettings, RocketMQSettings


@dataclass(frozen=True)
class EngineRun:
    """One timed run of an instance over pre-produced input."""

    records: int
    seconds: float
    totals: dict[int, dict[str, float]]

    @property
    def records_per_s(self) -> float:
        """Input records per second, start of processing to fully committed."""
        return self.records / self.seconds


def unique(prefix: str) -> str:
    """A fresh job/topic name."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def produce(
    settings: RocketMQSettings, topic: str, bodies: Sequence[bytes], threads: int = 4
) -> float:
    """Send ``bodies`` (keyed by index) with one producer per thread; returns msg/s."""

    def send(part: int) -> None:
        with Producer(settings) as producer:
            for i in range(part, len(bodies), threads):
                producer.send(topic, bodies[i], key=str(i))

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, range(threads)))
    return len(bodies) / (time.perf_counter() - start)


def warm_spark(
    settings: RocketMQSettings, engine: EngineSettings, build: Callable[..., Topology]
) -> None:
    """Start (and keep) the SparkSession and Python workers on a tiny job, untimed."""
    job = unique("bench-warmup")
    src, out = f"{job}-in", f"{job}-out"
    with RocketMQAdmin(settings) as admin:
        admin.create_topic(src, 4)
    produce(settings, src, [b"warm up the workers"] * 40, threads=1)
    instance = Instance(build(job, src, out), rocketmq=settings, engine=engine)
    instance.start()
    instance.await_caught_up(300)
    instance.stop()


def run_instance(
    topology: Topology, settings: RocketMQSettings, engine: EngineSettings, records: int
) -> EngineRun:
    """Run an instance over input already in its source topic, until all is committed."""
    instance = Instance(topology, rocketmq=settings, engine=engine)
    start = time.perf_counter()
    instance.start()
    instance.await_caught_up(1800, poll_s=0.2)
    seconds = time.perf_counter() - start
    instance.stop()
    totals = {i: dict(m.totals) for i, m in instance.metrics.items()}
    return EngineRun(records, seconds, totals)


def run_live(
    topology: Topology, settings: RocketMQSettings, engine: EngineSettings, bodies: Sequence[bytes]
) -> tuple[list[Record], list[Record]]:
    """Produce ``bodies`` one by one while an instance runs; (source, first sink) records.

    For latency: each output's store time against its input's born time.
    """
    with RocketMQAdmin(settings) as admin:
        admin.create_topic(topology.source_topic, 4)
    instance = Instance(topology, rocketmq=settings, engine=engine)
    instance.start()
    produce(settings, topology.source_topic, bodies, threads=1)
    instance.await_caught_up(600, poll_s=0.2)
    instance.stop()
    return read_all(settings, topology.source_topic), read_all(settings, topology.sink_topics[0])


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
