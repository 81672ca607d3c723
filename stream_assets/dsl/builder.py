"""The stream DSL: a Pythonic mirror of RocketMQ Streams 1.1.

Callable style (WordCount)::

    >>> from stream_assets.serde import text_deserializer
    >>> b = StreamBuilder("wordcount")
    >>> (b.source("sourceTopic", text_deserializer)
    ...   .flat_map(str.split)
    ...   .key_by(lambda w: w)
    ...   .count()
    ...   .to_rstream()
    ...   .sink("wordcount-out"))
    >>> [s.index for s in b.build().stages]
    [0, 1]

Field style of the seed article, for dict records::

    >>> from stream_assets.windows import Time, TumblingWindow
    >>> from stream_assets.serde import json_deserializer
    >>> b = StreamBuilder("flows")
    >>> (b.source("events", json_deserializer)
    ...   .window(TumblingWindow.of(Time.seconds(10)))
    ...   .group_by("k").sum("f", "alias").count("total").water_mark(5)
    ...   .to_rstream().print())

Mistakes fail here, at build time, naming the operator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stream_assets.operators.aggregates import (
    Accumulator,
    Avg,
    Composite,
    Count,
    Max,
    Min,
    Sum,
    field_or_fn,
)
from stream_assets.plan import nodes as n
from stream_assets.plan.topology import Topology, validate_name
from stream_assets.serde import Deserializer, Serializer, json_serializer

_DEFAULT_IDLE_TIMEOUT_MS = 10_000


def _callable(fn: Any, operator: str) -> Callable[[Any], Any]:
    if not callable(fn):
        raise TypeError(f"{operator}: expected a callable, got {type(fn).__name__} {fn!r}")
    return fn  # type: ignore[no-any-return]


def _key_selector(selector: Any, operator: str) -> Callable[[Any], Any]:
    if isinstance(selector, str):
        return field_or_fn(selector, operator)
    return _callable(selector, operator)


class StreamBuilder:
    """Collects one topology's operators; ``build()`` compiles it into stages."""

    def __init__(self, job_id: str) -> None:
        self.job_id = validate_name(job_id, "job id")
        self._nodes: list[n.Node] = []
        self._terminated = False

    def _op_id(self, kind: str) -> str:
        return f"{kind}-{len(self._nodes)}"

    def _add(self, node: n.Node) -> None:
        if self._terminated:
            raise ValueError(
                f"{self.job_id}: {type(node).__name__.lower()} after a sink/print; a sink ends "
                "the stream"
            )
        self._nodes.append(node)

    def source(self, topic: str, deserializer: Deserializer) -> RStream:
        """Read ``topic``; ``deserializer`` turns each body (bytes) into a value."""
        if self._nodes:
            raise ValueError(f"{self.job_id}: one source per topology (already reading)")
        validate_name(topic, "source topic")
        self._add(n.Source(self._op_id("source"), topic, _callable(deserializer, "source")))
        return RStream(self)

    def build(self) -> Topology:
        """Compile into a :class:`Topology` (stages cut at every key_by)."""
        if not self._nodes:
            raise ValueError(f"{self.job_id}: the topology has no source")
        return Topology(self.job_id, tuple(self._nodes))


class RStream:
    """A stream of values."""

    def __init__(self, builder: StreamBuilder, window: Any | None = None) -> None:
        self._b = builder
        self._window = window

    def _then(self, node: n.Node) -> RStream:
        if self._window is not None:
            raise ValueError(
                f"{self._b.job_id}: window(...) must be followed by group_by/key_by, "
                f"not {type(node).__name__.lower()}"
            )
        self._b._add(node)
        return RStream(self._b)

    def map(self, fn: Callable[[Any], Any]) -> RStream:
        """value -> fn(value)."""
        return self._then(n.Map(self._b._op_id("map"), _callable(fn, "map")))

    def flat_map(self, fn: Callable[[Any], Any]) -> RStream:
        """value -> every item of the iterable fn(value)."""
        return self._then(n.FlatMap(self._b._op_id("flat_map"), _callable(fn, "flat_map")))

    def filter(self, fn: Callable[[Any], Any]) -> RStream:
        """Keep the values for which fn(value) is truthy."""
        return self._then(n.Filter(self._b._op_id("filter"), _callable(fn, "filter")))

    def foreach(self, fn: Callable[[Any], Any]) -> RStream:
        """Call fn(value) for each value (side effect); values pass on unchanged."""
        return self._then(n.Foreach(self._b._op_id("foreach"), _callable(fn, "foreach")))

    def select_timestamp(self, fn: Callable[[Any], Any] | str) -> RStream:
        """Event time (epoch ms) from fn(value) or a field; default is the message born time."""
        extract = _key_selector(fn, "select_timestamp")
        return self._then(n.SelectTimestamp(self._b._op_id("select_timestamp"), extract))

    def window(self, spec: Any) -> RStream:
        """Window the aggregation that follows (field style: window, then group_by)."""
        if not hasattr(spec, "assign"):
            raise TypeError(
                f"window: expected a window spec (TumblingWindow.of(...)), got {spec!r}"
            )
        return RStream(self._b, window=spec)

    def key_by(self, selector: Callable[[Any], Any] | str) -> GroupedStream:
        """Group by fn(value) (or a field name); records shuffle by key hash."""
        fn = _key_selector(selector, "key_by")
        self._b._add(n.KeyBy(self._b._op_id("key_by"), fn))
        return GroupedStream(self._b, self._window)

    group_by = key_by

    def _needs_key(self, operator: str) -> Any:
        raise TypeError(
            f"{operator}: an aggregate needs a key; call key_by(...) or group_by(...) first"
        )

    def count(self, *_: Any) -> Any:
        """Not available before key_by (raises a build-time error)."""
        return self._needs_key("count")

    def sum(self, *_: Any) -> Any:
        """Not available before key_by (raises a build-time error)."""
        return self._needs_key("sum")

    def min(self, *_: Any) -> Any:
        """Not available before key_by (raises a build-time error)."""
        return self._needs_key("min")

    def max(self, *_: Any) -> Any:
        """Not available before key_by (raises a build-time error)."""
        return self._needs_key("max")

    def avg(self, *_: Any) -> Any:
        """Not available before key_by (raises a build-time error)."""
        return self._needs_key("avg")

    def aggregate(self, *_: Any) -> Any:
        """Not available before key_by (raises a build-time error)."""
        return self._needs_key("aggregate")

    def to_rstream(self) -> RStream:
        """Already a stream; kept for symmetry with RocketMQ Streams."""
        return self

    def print(self) -> None:
        """Print each value (terminal)."""
        self._then(n.Print(self._b._op_id("print")))
        self._b._terminated = True

    def sink(self, topic: str, serializer: Serializer = json_serializer) -> None:
        """Send each value to ``topic`` (terminal); the default body is JSON."""
        validate_name(topic, "sink topic")
        self._then(n.Sink(self._b._op_id("sink"), topic, _callable(serializer, "sink")))
        self._b._terminated = True


class GroupedStream:
    """A keyed stream: window it, then aggregate."""

    def __init__(self, builder: StreamBuilder, window: Any | None) -> None:
        self._b = builder
        self._window = window

    def window(self, spec: Any) -> GroupedStream:
        """Aggregate per window of ``spec`` (tumbling, sliding or session)."""
        if not hasattr(spec, "assign"):
            raise TypeError(
                f"window: expected a window spec (TumblingWindow.of(...)), got {spec!r}"
            )
        return GroupedStream(self._b, spec)

    def _agg(self, alias: str | None, acc: Accumulator) -> AggregatedStream:
        return AggregatedStream(self._b, self._window, [(alias or acc.kind, acc)])

    def count(self, alias: str | None = None) -> AggregatedStream:
        """Number of records per key (and window)."""
        return self._agg(alias, Count())

    def sum(
        self, selector: str | Callable[[Any], Any] | None = None, alias: str | None = None
    ) -> AggregatedStream:
        """Sum of a field / function per key."""
        return self._agg(alias, Sum(field_or_fn(selector, "sum")))

    def min(
        self, selector: str | Callable[[Any], Any] | None = None, alias: str | None = None
    ) -> AggregatedStream:
        """Smallest field / function value per key."""
        return self._agg(alias, Min(field_or_fn(selector, "min")))

    def max(
        self, selector: str | Callable[[Any], Any] | None = None, alias: str | None = None
    ) -> AggregatedStream:
        """Largest field / function value per key."""
        return self._agg(alias, Max(field_or_fn(selector, "max")))

    def avg(
        self, selector: str | Callable[[Any], Any] | None = None, alias: str | None = None
    ) -> AggregatedStream:
        """Mean of a field / function per key."""
        return self._agg(alias, Avg(field_or_fn(selector, "avg")))

    def aggregate(self, accumulator: Accumulator, alias: str | None = None) -> AggregatedStream:
        """A user :class:`Accumulator` per key."""
        if not isinstance(accumulator, Accumulator):
            raise TypeError(
                f"aggregate: expected an Accumulator instance, got {type(accumulator).__name__}"
            )
        return self._agg(alias, accumulator)


class AggregatedStream:
    """Aggregates being declared; chain more (field style) or call ``to_rstream()``."""

    def __init__(
        self, builder: StreamBuilder, window: Any | None, parts: list[tuple[str, Accumulator]]
    ) -> None:
        self._b = builder
        self._window = window
        self._parts = parts
        self._lateness_ms = 0
        self._idle_ms = _DEFAULT_IDLE_TIMEOUT_MS
        self._late_topic: str | None = None

    def _more(self, alias: str | None, acc: Accumulator) -> AggregatedStream:
        name = alias or acc.kind
        if any(existing == name for existing, _ in self._parts):
            raise ValueError(f"{acc.kind}: output alias {name!r} is already used; pass an alias")
        self._parts.append((name, acc))
        return self

    def count(self, alias: str | None = None) -> AggregatedStream:
        """Also count records, as ``alias``."""
        return self._more(alias, Count())

    def sum(
        self, selector: str | Callable[[Any], Any], alias: str | None = None
    ) -> AggregatedStream:
        """Also sum a field, as ``alias``."""
        return self._more(alias, Sum(field_or_fn(selector, "sum")))

    def min(
        self, selector: str | Callable[[Any], Any], alias: str | None = None
    ) -> AggregatedStream:
        """Also the minimum of a field, as ``alias``."""
        return self._more(alias, Min(field_or_fn(selector, "min")))

    def max(
        self, selector: str | Callable[[Any], Any], alias: str | None = None
    ) -> AggregatedStream:
        """Also the maximum of a field, as ``alias``."""
        return self._more(alias, Max(field_or_fn(selector, "max")))

    def avg(
        self, selector: str | Callable[[Any], Any], alias: str | None = None
    ) -> AggregatedStream:
        """Also the mean of a field, as ``alias``."""
        return self._more(alias, Avg(field_or_fn(selector, "avg")))

    def water_mark(self, seconds: float) -> AggregatedStream:
        """Allowed lateness in seconds (watermark = max event time - lateness)."""
        if seconds < 0:
            raise ValueError(f"water_mark: lateness must be >= 0 seconds, got {seconds}")
        self._lateness_ms = int(seconds * 1000)
        return self

    def idle_timeout(self, seconds: float) -> AggregatedStream:
        """Fire open windows after this much processing time without input."""
        if seconds <= 0:
            raise ValueError(f"idle_timeout: must be > 0 seconds, got {seconds}")
        self._idle_ms = int(seconds * 1000)
        return self

    def late_records_to(self, topic: str) -> AggregatedStream:
        """Also write dropped late records to ``topic``."""
        self._late_topic = validate_name(topic, "late-records topic")
        return self

    def to_rstream(self) -> RStream:
        """The stream of results: dicts with ``key``, each alias, and window bounds."""
        self._b._add(
            n.Aggregate(
                self._b._op_id("aggregate"),
                Composite(list(self._parts)),
                self._window,
                self._lateness_ms,
                self._idle_ms,
                self._late_topic,
            )
        )
        return RStream(self._b)
