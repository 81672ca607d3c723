"""De-duplication: the first event of each id within an hour passes, repeats do not.

Events are JSON objects with an ``id``; an id's first event is sent on, and
every event of the same id less than ``horizon_ms`` of event time after it is
dropped. An event-time timer ends the horizon (then the id may pass again),
and the state's TTL forgets ids that stay quiet, so the store holds only the
ids of the last horizon whatever the number of ids ever seen::

    >>> t = build()
    >>> t.source_topic, t.sink_topics
    ('events', ('events-unique',))
"""

from __future__ import annotations

from typing import Any

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.operators.processor import ProcessContext, Processor, TimerContext
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer


class FirstWithin(Processor):
    """Emit an id's event unless one of the same id passed less than ``horizon_ms`` before."""

    def __init__(self, horizon_ms: int) -> None:
        self.horizon_ms = horizon_ms

    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        passed = ctx.value("passed")
        if passed.get() is None:
            ctx.emit(value)
            passed.set(ctx.timestamp)
            ctx.set_event_timer(ctx.timestamp + self.horizon_ms)

    def on_timer(self, key: Any, ctx: TimerContext) -> None:
        ctx.value("passed").clear()


def event_id(event: dict[str, Any]) -> Any:
    """The id events are de-duplicated by."""
    return event["id"]


def build(
    job_id: str = "dedup",
    source: str = "events",
    sink: str = "events-unique",
    horizon_ms: int = 3_600_000,
) -> Topology:
    """The de-duplication topology."""
    builder = StreamBuilder(job_id)
    (
        builder.source(source, json_deserializer)
        .key_by(event_id)
        .process(FirstWithin(horizon_ms), ttl=2 * horizon_ms / 1000)
        .sink(sink)
    )
    return builder.build()
