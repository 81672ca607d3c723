"""Sessions of activity: a summary of each burst of a key's events, closed by an
event-time timer once the key has been quiet for ``gap_ms``.

Each summary says how many records the session had, its first and last event
time, and the key's running total of records since its state was last
forgotten. The state lives under a TTL (``ttl_s``) counted from the key's
latest record *or* pending timer, so the timer that closes a session always
sees that session, even with a TTL shorter than the gap; a key quiet for the
gap plus the TTL starts over (its total restarts)::

    >>> t = build()
    >>> t.source_topic, t.sink_topics
    ('activity', ('activity-sessions',))
"""

from __future__ import annotations

from typing import Any

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.operators.processor import ProcessContext, Processor, TimerContext
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer


class ActivitySessions(Processor):
    """Emit ``{"key", "records", "first", "last", "total"}`` when a key's session ends:
    ``gap_ms`` of event time after its latest record."""

    def __init__(self, gap_ms: int) -> None:
        self.gap_ms = gap_ms

    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        session = ctx.value("session")
        open_session = session.get()
        if open_session is None:
            first, records = ctx.timestamp, 0
        else:
            first, records, last = open_session
            ctx.delete_event_timer(last + self.gap_ms)  # the session goes on
        session.set([first, records + 1, ctx.timestamp])
        total = ctx.value("total")
        total.set(total.get(0) + 1)
        ctx.set_event_timer(ctx.timestamp + self.gap_ms)

    def on_timer(self, key: Any, ctx: TimerContext) -> None:
        # Raises (a dead letter) if the session were gone: the TTL must not beat its timer.
        first, records, last = ctx.value("session").get()
        ctx.emit(
            {
                "key": key,
                "records": records,
                "first": first,
                "last": last,
                "total": ctx.value("total").get(),
            }
        )
        ctx.value("session").clear()


def build(
    job_id: str = "activity-sessions",
    source: str = "activity",
    sink: str = "activity-sessions",
    key: str = "user",
    time_field: str = "t",
    gap_ms: int = 1_800_000,
    ttl_s: float = 3_600,
    lateness_s: float = 0,
) -> Topology:
    """Sessions of ``key``'s events (JSON, event time in ``time_field``, epoch ms)."""
    builder = StreamBuilder(job_id)
    (
        builder.source(source, json_deserializer)
        .select_timestamp(time_field)
        .key_by(key)
        .process(ActivitySessions(gap_ms), ttl=ttl_s, water_mark=lateness_s)
        .sink(sink)
    )
    return builder.build()
