"""Run one WordCount instance in a process of its own, until it is killed.

Used by the crash tests: ``python -m tests.integration._instance_process
JOB SOURCE SINK STATE_DIR NAMESRV [MODE [exactly-once]]`` starts the instance and prints ``started``
once its queries run; the test then ``kill -9``s the whole process group
(driver and Spark JVM) mid-batch.
"""

from __future__ import annotations

import sys
import time

from stream_assets.examples import wordcount
from stream_assets.runtime.spark.instance import Instance
from stream_assets.settings import EngineSettings, RocketMQSettings


def main() -> None:
    job, source, sink, state_dir, namesrv = sys.argv[1:6]
    mode = sys.argv[6] if len(sys.argv) > 6 else "micro-batch"
    exactly_once = sys.argv[7:8] == ["exactly-once"]
    instance = Instance(
        wordcount.build(job, source, sink, exactly_once),
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
