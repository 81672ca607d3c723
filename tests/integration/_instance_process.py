"""Run one instance of the crash tests' topology in a process of its own, until killed.

Every function its tasks run comes from the installed ``stream_assets`` (the
split, the key), so nothing of this module is shipped to the executors.

Used by the crash tests: ``python -m tests.integration._instance_process
JOB STATE_DIR NAMESRV MODE [ASSIGNMENT GENERATION]`` (ASSIGNMENT: JSON, topic ->
queue ids) starts the instance and prints ``started`` once its queries run; the
test then ``kill -9``s the whole process group (driver and Spark JVM) mid-step, or
a fault (``tests.integration._faults``) kills it from a task.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples.wordcount import split_words
from stream_assets.plan.topology import Topology
from stream_assets.runtime.spark.instance import Instance
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.settings import EngineSettings, RocketMQSettings
from stream_assets.windows import Time, TumblingWindow

#: The windowed sum's windows, and how long a queue without input waits to flush them.
WINDOW_S = 10
IDLE_S = 5.0


@dataclass(frozen=True)
class CrashTopics:
    """The topics of one job's crash-test topology."""

    lines: str
    counts: str
    events: str
    windows: str
    copies: str

    @classmethod
    def of(cls, job: str) -> CrashTopics:
        return cls(f"{job}-src", f"{job}-out", f"{job}-ev", f"{job}-win", f"{job}-copy")


def build(job: str) -> Topology:
    """Three exactly-once sinks in one job: WordCount over text lines (an unwindowed
    count: each count an update); a sum per key over ``WINDOW_S``-second tumbling
    windows of JSON events ``{"key", "value", "ts"}`` (one result per window, fired by
    the watermark or the idle timeout); and each event copied as it is, before any
    aggregate (its source stage's position logged with the copies' transaction)."""
    topics = CrashTopics.of(job)
    builder = StreamBuilder(job, exactly_once_sinks=True)
    (
        builder.source(topics.lines, text_deserializer)
        .flat_map(split_words)
        .key_by()
        .count()
        .to_rstream()
        .sink(topics.counts)
    )
    events = builder.source(topics.events, json_deserializer).select_timestamp("ts")
    events.sink(topics.copies)
    (
        events.key_by("key")
        .window(TumblingWindow.of(Time.seconds(WINDOW_S)))
        .sum("value", "sum")
        .idle_timeout(IDLE_S)
        .to_rstream()
        .sink(topics.windows)
    )
    return builder.build()


def main() -> None:
    job, state_dir, namesrv, mode = sys.argv[1:5]
    assignment = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    instance = Instance(
        build(job),
        assignment=assignment,
        generation=int(sys.argv[6]) if len(sys.argv) > 6 else 0,
        rocketmq=RocketMQSettings(namesrv_addr=namesrv),
        engine=EngineSettings(
            state_dir=state_dir,
            shuffle_queues=4,
            sink_queues=4,
            trigger_interval_ms=200,
            max_records_per_batch=500,  # many small batches: a kill lands mid-batch
            # Real-time: many small steps inside one long interval, so the kill lands
            # mid-interval, with steps committed before it.
            mode=mode,
            step_max_records=50,
            interval_ms=600_000,
            spark_conf={"spark.ui.showConsoleProgress": "false"},
        ),
        progress=lambda message: None,
    )
    instance.start()
    print("started", flush=True)
    while True:
        instance.check_failed()
        time.sleep(0.5)


if __name__ == "__main__":
    main()
