"""Top-N per window: the 3 most frequent words of each minute, per language.

Words are counted per language in a map state keyed by window start (a range
read finds every window that has ended), and an event-time timer at each
window's end emits its top 3 (ties by word) and forgets the window::

    >>> t = build()
    >>> t.source_topic, t.sink_topics
    ('words', ('top-words',))
"""

from __future__ import annotations

from typing import Any

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.operators.processor import ProcessContext, Processor, TimerContext
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer


def top(counts: dict[str, int], n: int) -> list[list[Any]]:
    """The ``n`` highest counts as ``[word, count]``, ties by word.

    >>> top({"b": 2, "a": 2, "c": 5}, 2)
    [['c', 5], ['a', 2]]
    """
    return [[w, c] for w, c in sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))[:n]]


class TopN(Processor):
    """Per key, the ``n`` most frequent words of each window of ``window_ms``."""

    def __init__(self, window_ms: int, n: int) -> None:
        self.window_ms = window_ms
        self.n = n

    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        start = ctx.timestamp - ctx.timestamp % self.window_ms
        windows = ctx.map("windows")
        counts = windows.get(start, {})
        counts[value["word"]] = counts.get(value["word"], 0) + 1
        windows.put(start, counts)
        ctx.set_event_timer(start + self.window_ms)

    def on_timer(self, key: Any, ctx: TimerContext) -> None:
        windows = ctx.map("windows")
        # Every window that ended by now (a range read up to this timer's window).
        for start, counts in windows.items(stop=ctx.timestamp - self.window_ms + 1):
            end = start + self.window_ms
            ctx.emit({"key": key, "window_start": start, "top": top(counts, self.n)}, end - 1)
            windows.delete(start)


def language(entry: dict[str, Any]) -> Any:
    """Words are ranked per language."""
    return entry["lang"]


def build(
    job_id: str = "top-words",
    source: str = "words",
    sink: str = "top-words",
    window_ms: int = 60_000,
    n: int = 3,
) -> Topology:
    """The top-N topology."""
    builder = StreamBuilder(job_id)
    (
        builder.source(source, json_deserializer)
        .key_by(language)
        .process(TopN(window_ms, n))
        .sink(sink)
    )
    return builder.build()
