"""The logical plan: one node per DSL operator, in chain order.

Nodes are plain frozen dataclasses holding the user's functions; they are
pickled (cloudpickle) into Spark tasks with the stage that runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stream_assets.operators.aggregates import Accumulator
from stream_assets.serde import Deserializer, Serializer


@dataclass(frozen=True)
class Node:
    """Base of every plan node; ``op_id`` is unique and stable within a topology."""

    op_id: str


@dataclass(frozen=True)
class Source(Node):
    """Read ``topic``, turning each body into a value with ``deserializer``."""

    topic: str
    deserializer: Deserializer


@dataclass(frozen=True)
class Map(Node):
    """value -> fn(value)."""

    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class FlatMap(Node):
    """value -> each item of fn(value)."""

    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class Filter(Node):
    """Keep values for which fn(value) is truthy."""

    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class Foreach(Node):
    """Call fn(value) for its side effect; the value passes on unchanged."""

    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class SelectTimestamp(Node):
    """Event time (epoch ms) of each value is fn(value) from here on."""

    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class KeyBy(Node):
    """Group by fn(value): records are re-routed through a shuffle topic by key hash."""

    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class Aggregate(Node):
    """Keyed (optionally windowed) aggregation; the stateful operator of a stage."""

    accumulator: Accumulator
    window: Any | None  # a spec from stream_assets.windows, or None
    allowed_lateness_ms: int
    idle_timeout_ms: int
    late_topic: str | None


@dataclass(frozen=True)
class Print(Node):
    """Print each value to the instance's stdout (terminal)."""


@dataclass(frozen=True)
class Sink(Node):
    """Send each value to ``topic`` with ``serializer`` (terminal)."""

    topic: str
    serializer: Serializer
