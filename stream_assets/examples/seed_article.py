"""The seed article's example: window, groupBy, sum, count, waterMark, print.

Dict records with ``groupByKey`` and ``OutFlow`` fields, ten-second tumbling
windows, five seconds out of order allowed::

    >>> build().stages[1].aggregate.allowed_lateness_ms
    5000
"""

from __future__ import annotations

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer
from stream_assets.windows import Time, TumblingWindow


def build(job_id: str = "seed-article", source: str = "topicName") -> Topology:
    """The seed article's topology (prints its results)."""
    builder = StreamBuilder(job_id)
    (
        builder.source(source, json_deserializer)
        .window(TumblingWindow.of(Time.seconds(10)))
        .group_by("groupByKey")
        .sum("OutFlow", "OutFlow")
        .count("total")
        .water_mark(5)
        .to_rstream()
        .print()
    )
    return builder.build()
