"""Silence alerts: an alert when a device has sent nothing for 10 minutes of event time.

Each reading (JSON with a ``device``) moves the device's one event-time timer
to 10 minutes after it; when the watermark (or the device's next reading)
reaches the timer first, the device was silent, and an alert goes out with
when it was last heard::

    >>> t = build()
    >>> t.source_topic, t.sink_topics
    ('readings', ('silent-devices',))
"""

from __future__ import annotations

from typing import Any

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.operators.processor import ProcessContext, Processor, TimerContext
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer


class SilenceAlert(Processor):
    """Emit ``{"device", "last_seen", "silent_at"}`` when a key is silent for ``silence_ms``."""

    def __init__(self, silence_ms: int) -> None:
        self.silence_ms = silence_ms

    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        due = ctx.value("due")
        if due.get() is not None:
            ctx.delete_event_timer(due.get())
        due.set(ctx.timestamp + self.silence_ms)
        ctx.set_event_timer(ctx.timestamp + self.silence_ms)

    def on_timer(self, key: Any, ctx: TimerContext) -> None:
        ctx.emit(
            {
                "device": key,
                "last_seen": ctx.timestamp - self.silence_ms,
                "silent_at": ctx.timestamp,
            }
        )
        ctx.value("due").clear()


def device(reading: dict[str, Any]) -> Any:
    """Readings are grouped by device."""
    return reading["device"]


def build(
    job_id: str = "silence-alert",
    source: str = "readings",
    sink: str = "silent-devices",
    silence_ms: int = 600_000,
) -> Topology:
    """The silence-alert topology."""
    builder = StreamBuilder(job_id)
    (
        builder.source(source, json_deserializer)
        .key_by(device)
        .process(SilenceAlert(silence_ms))
        .sink(sink)
    )
    return builder.build()
