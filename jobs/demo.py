"""``wordcount_demo_job``: WordCount end to end through Dagster (the README's main job).

Produces generated lines into a fresh source topic, runs one instance of the
WordCount topology until it has consumed them, and logs the top words next to
an independent count of the same lines; the run fails if they differ.
"""

import dagster as dg

from stream_assets.examples.demo import run_wordcount_demo
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.resources.spark import SparkResource
from stream_assets.resources.state_store import RocksDBStateStoreResource


class DemoConfig(dg.Config):
    """How many generated lines to count."""

    lines: int = 20_000


@dg.op
def wordcount_demo(
    context: dg.OpExecutionContext,
    config: DemoConfig,
    rocketmq: RocketMQResource,
    spark: SparkResource,
    state_store: RocksDBStateStoreResource,
) -> None:
    """Run the WordCount demo and check its counts."""
    report = run_wordcount_demo(
        config.lines,
        rocketmq=rocketmq.settings(),
        engine=spark.engine_settings(state_dir=state_store.root()),
    )
    top = "\n".join(f"  {word:<12} {count}" for word, count in report.top)
    context.log.info(
        f"WordCount over {report.lines} lines ({report.words} words) in {report.seconds:.1f}s; "
        f"top words:\n{top}"
    )
    context.add_output_metadata(
        {"lines": report.lines, "words": report.words, "seconds": round(report.seconds, 1)}
    )
    if not report.matches:
        raise dg.Failure(description="WordCount's counts differ from an independent count")
    context.log.info("the counts match an independent count of the same lines")


@dg.job(description="WordCount end to end on the local broker and Spark, checked.")
def wordcount_demo_job() -> None:
    """The README's main job."""
    wordcount_demo()
