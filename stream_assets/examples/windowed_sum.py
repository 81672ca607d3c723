"""Windowed sum per key over JSON events ``{"key", "value", "ts"}``.

Ten-second tumbling windows on the events' own time (``ts``, epoch ms), five
seconds of allowed lateness; late events are counted and go to a late topic::

    >>> build().sink_topics
    ('windowed-sum-out',)
"""

from __future__ import annotations

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer
from stream_assets.windows import Time, TumblingWindow


def build(
    job_id: str = "windowed-sum",
    source: str = "events",
    sink: str = "windowed-sum-out",
    window_s: int = 10,
    lateness_s: float = 5,
    idle_timeout_s: float = 10,
) -> Topology:
    """The windowed-sum topology."""
    builder = StreamBuilder(job_id)
    (
        builder.source(source, json_deserializer)
        .select_timestamp("ts")
        .key_by("key")
        .window(TumblingWindow.of(Time.seconds(window_s)))
        .sum("value", "sum")
        .water_mark(lateness_s)
        .idle_timeout(idle_timeout_s)
        .late_records_to(f"{job_id}-late")
        .to_rstream()
        .sink(sink)
    )
    return builder.build()
