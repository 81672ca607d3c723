"""A Dagster job that proves the broker path: produce, read back, check every byte."""

import dagster as dg

from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.roundtrip import run_roundtrip


class RoundtripConfig(dg.Config):
    """How many messages over how many queues."""

    messages: int = 1000
    queues: int = 8


@dg.op
def roundtrip(
    context: dg.OpExecutionContext, config: RoundtripConfig, rocketmq: RocketMQResource
) -> None:
    """Send ``messages`` keyed messages to a fresh topic and read them back."""
    report = run_roundtrip(config.messages, config.queues, settings=rocketmq.settings())
    context.log.info(report.describe())
    context.log_event(
        dg.AssetObservation(
            asset_key=dg.AssetKey(["rocketmq", "roundtrip"]),
            metadata={
                "produce_msgs_per_s": report.rate(report.produce_s),
                "consume_msgs_per_s": report.rate(report.consume_s, report.received),
                "messages": report.received,
            },
        )
    )
    if not report.ok:
        raise dg.Failure(description=report.describe())


@dg.job
def roundtrip_job() -> None:
    """Broker round trip through the RocketMQ client layer."""
    roundtrip()
