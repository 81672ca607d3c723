"""The stream DSL: a Pythonic mirror of RocketMQ Streams 1.1.

Callable style (WordCount)::

    >>> from stream_assets.serde import text_deserializer
    >>> b = StreamBuilder("wordcount")
    >>> (b.source("sourceTopic", text_deserializer)
    ...   .flat_map(str.split)
    ...   .key_by()
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
    whole_value,
)
from stream_assets.operators.joins import JoinCollect
from stream_assets.operators.processor import Processor
from stream_assets.plan import nodes as n
from stream_assets.plan.names import (
    default_sink_id,
    default_stateful_id,
    validate_operator_name,
)
from stream_assets.plan.topology import Topology, validate_name
from stream_assets.rocketmq.tags import TagFilter
from stream_assets.serde import Deserializer, Serializer, json_serializer

_DEFAULT_IDLE_TIMEOUT_MS = 10_000


def _callable(fn: Any, operator: str) -> Callable[..., Any]:
    if not callable(fn):
        raise TypeError(f"{operator}: expected a callable, got {type(fn).__name__} {fn!r}")
    return fn  # type: ignore[no-any-return]


def _key_selector(selector: Any, operator: str) -> Callable[[Any], Any]:
    if isinstance(selector, str):
        return field_or_fn(selector, operator)
    return _callable(selector, operator)


class StreamBuilder:
    """Collects one topology's operators; ``build()`` compiles it into stages.

    Stream handles are immutable: every operator returns a new handle, and
    using one handle twice branches the stream (both get every value).
    ``exactly_once_sinks``: the default of every ``sink(exactly_once=...)``.
    """

    def __init__(self, job_id: str, *, exactly_once_sinks: bool = False) -> None:
        self.job_id = validate_name(job_id, "job id")
        self.exactly_once_sinks = exactly_once_sinks
        self._nodes: list[n.Node] = []
        #: key_by(...) handles not (yet) followed by an aggregate: a mistake at build().
        self._open_groups: list[GroupedStream] = []
        #: Unnamed stateful operators so far, by kind; sinks so far, by topic.
        self._unnamed: dict[str, int] = {}
        self._sinks: dict[str, int] = {}

    def _op_id(self, kind: str) -> str:
        return f"{kind}-{len(self._nodes)}"

    def _stateful_id(self, kind: str, name: str | None) -> str:
        """A stateful operator's id, which names its shuffle and state topics: ``name``,
        else its kind and place among the unnamed ones of that kind (``aggregate``,
        ``aggregate_2``, ...), so edits elsewhere leave it as it is (plan/names.py)."""
        if name is not None:
            return validate_operator_name(name)
        self._unnamed[kind] = self._unnamed.get(kind, 0) + 1
        return default_stateful_id(kind, self._unnamed[kind])

    def _sink_id(self, topic: str) -> str:
        """A sink's id, part of every message key it writes: named by its topic."""
        self._sinks[topic] = self._sinks.get(topic, 0) + 1
        return default_sink_id(topic, self._sinks[topic])

    def _add(self, node: n.Node) -> str:
        self._nodes.append(node)
        return node.op_id

    def source(self, topic: str, deserializer: Deserializer, *, tags: str | None = None) -> RStream:
        """Read ``topic``; ``deserializer`` turns each body (bytes) into a value.

        ``tags``: a RocketMQ tag expression (``"TagA || TagB"``; default every
        message): the broker sends only the messages with those tags
        (:mod:`stream_assets.rocketmq.tags`). A topology may read several
        topics (one ``source`` each); combine their streams with ``union`` or
        ``join``.
        """
        validate_name(topic, "source topic")
        if any(isinstance(x, n.Source) and x.topic == topic for x in self._nodes):
            raise ValueError(
                f"{self.job_id}: {topic!r} is already a source; use its stream handle twice "
                "to branch"
            )
        try:
            wanted = TagFilter.parse(tags)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{self.job_id}: source {topic!r}: {exc}") from exc
        node = n.Source(
            self._op_id("source"),
            topic,
            _callable(deserializer, "source"),
            tags=None if wanted.tags is None else wanted.expression,
        )
        return RStream(self, self._add(node))

    def table(
        self,
        topic: str,
        deserializer: Deserializer,
        key: Callable[[Any], Any] | str,
        timestamp: Callable[[Any], Any] | str | None = None,
        *,
        tags: str | None = None,
    ) -> Table:
        """A table from ``topic``: the latest value per ``key`` (a field or function).

        Each message is an update of its key; its event time is ``timestamp``
        (a field or function) or the message's born time; ``tags`` as for
        :meth:`source`. Join a stream with it: ``stream.join_table(table, key=...)``.
        """
        stream = self.source(topic, deserializer, tags=tags)
        if timestamp is not None:
            stream = stream.select_timestamp(timestamp)
        return Table(stream, _key_selector(key, "table"))

    def build(self) -> Topology:
        """Compile into a :class:`Topology` (stages cut at every key_by)."""
        if not self._nodes:
            raise ValueError(f"{self.job_id}: the topology has no source")
        if self._open_groups:
            raise ValueError(
                f"{self.job_id}: a key_by(...) is not followed by an aggregate "
                "(count/sum/min/max/avg/aggregate) and to_rstream()"
            )
        ids = [node.op_id for node in self._nodes]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(
                f"{self.job_id}: operator name(s) {twice} given twice (an explicit name=, or "
                "one that equals another operator's default name); give each its own"
            )
        return Topology(self.job_id, tuple(self._nodes))


class RStream:
    """A stream of values (an immutable handle: each operator returns a new one)."""

    def __init__(self, builder: StreamBuilder, tail: str, window: Any | None = None) -> None:
        self._b = builder
        self._tail = tail
        self._window = window

    def _then(self, node_type: type[n.Node], kind: str, *args: Any, **kwargs: Any) -> RStream:
        if self._window is not None:
            raise ValueError(
                f"{self._b.job_id}: window(...) must be followed by group_by/key_by, not {kind}"
            )
        node = node_type(self._b._op_id(kind), *args, inputs=(self._tail,), **kwargs)
        return RStream(self._b, self._b._add(node))

    def map(self, fn: Callable[..., Any], *, metadata: bool = False) -> RStream:
        """value -> fn(value); with ``metadata=True``, fn(value, Metadata)."""
        return self._then(n.Map, "map", _callable(fn, "map"), metadata=metadata)

    def flat_map(self, fn: Callable[..., Any], *, metadata: bool = False) -> RStream:
        """value -> every item of the iterable fn(value) (or fn(value, Metadata))."""
        return self._then(n.FlatMap, "flat_map", _callable(fn, "flat_map"), metadata=metadata)

    def filter(self, fn: Callable[..., Any], *, metadata: bool = False) -> RStream:
        """Keep the values for which fn(value) (or fn(value, Metadata)) is truthy."""
        return self._then(n.Filter, "filter", _callable(fn, "filter"), metadata=metadata)

    def foreach(self, fn: Callable[..., Any], *, metadata: bool = False) -> RStream:
        """Call fn(value) (or fn(value, Metadata)) for each value; values pass on unchanged."""
        return self._then(n.Foreach, "foreach", _callable(fn, "foreach"), metadata=metadata)

    def map_batches(self, fn: Callable[[Any], Any]) -> RStream:
        """Vectorised map: fn(values), a ``pyarrow.Array`` of a batch's values, returns an
        array of the same length, one value for each (elementwise: see
        :mod:`stream_assets.operators.batches`).

        >>> import pyarrow.compute as pc
        >>> from stream_assets.serde import text_deserializer
        >>> b = StreamBuilder("shout")
        >>> b.source("in", text_deserializer).map_batches(pc.utf8_upper).sink("out")
        """
        return self._then(n.MapBatches, "map_batches", _callable(fn, "map_batches"))

    def flat_map_batches(self, fn: Callable[[Any], Any]) -> RStream:
        """Vectorised flat_map: fn(values) returns a list array of the same length; each
        value becomes the items of its list.

        >>> from stream_assets.operators.batches import lower_words
        >>> from stream_assets.serde import text_deserializer
        >>> b = StreamBuilder("wc")
        >>> (b.source("in", text_deserializer).flat_map_batches(lower_words)
        ...   .key_by(str).count().to_rstream().sink("out"))
        """
        return self._then(n.FlatMapBatches, "flat_map_batches", _callable(fn, "flat_map_batches"))

    def filter_batches(self, fn: Callable[[Any], Any]) -> RStream:
        """Vectorised filter: keep the values where fn(values), a boolean array of the same
        length, is true.

        >>> import pyarrow.compute as pc
        >>> from stream_assets.serde import text_deserializer
        >>> b = StreamBuilder("long")
        >>> (b.source("in", text_deserializer)
        ...   .filter_batches(lambda v: pc.greater(pc.utf8_length(v), 3)).sink("out"))
        """
        return self._then(n.FilterBatches, "filter_batches", _callable(fn, "filter_batches"))

    def select_timestamp(self, fn: Callable[[Any], Any] | str) -> RStream:
        """Event time (epoch ms) from fn(value) or a field; default is the message born time."""
        extract = _key_selector(fn, "select_timestamp")
        return self._then(n.SelectTimestamp, "select_timestamp", extract)

    def union(self, *others: RStream) -> RStream:
        """Every value of this stream and of ``others`` (also streams of other sources).

        >>> from stream_assets.serde import text_deserializer
        >>> b = StreamBuilder("u")
        >>> a, c = b.source("a", text_deserializer), b.source("c", text_deserializer)
        >>> a.union(c).sink("both")
        """
        if not others:
            raise ValueError("union: give at least one other stream")
        for other in others:
            if not isinstance(other, RStream) or other._b is not self._b:
                raise TypeError("union: expected streams of the same StreamBuilder")
        if self._window is not None or any(o._window is not None for o in others):
            raise ValueError(f"{self._b.job_id}: window(...) must be followed by group_by/key_by")
        inputs = tuple(dict.fromkeys((self._tail, *(o._tail for o in others))))
        node = n.Union(self._b._op_id("union"), inputs=inputs)
        return RStream(self._b, self._b._add(node))

    merge = union

    def branch(self, *predicates: Callable[[Any], Any], default: bool = False) -> list[RStream]:
        """One stream per predicate: each value goes to the first predicate it satisfies.

        With ``default=True`` one more stream gets the values no predicate took;
        otherwise they are dropped.

        >>> from stream_assets.serde import json_deserializer
        >>> b = StreamBuilder("br")
        >>> small, big = b.source("nums", json_deserializer).branch(lambda v: v < 10,
        ...                                                         lambda v: v >= 10)
        >>> small.sink("small"); big.sink("big")
        """
        if not predicates:
            raise ValueError("branch: give at least one predicate")
        checked = tuple(_callable(p, "branch") for p in predicates)
        split = self._then(n.Split, "branch", checked, default)
        count = len(checked) + (1 if default else 0)
        return [
            RStream(self._b, self._b._add(n.Pick(self._b._op_id("pick"), i, inputs=(split._tail,))))
            for i in range(count)
        ]

    split = branch

    def window(self, spec: Any) -> RStream:
        """Window the aggregation that follows (field style: window, then group_by)."""
        if not hasattr(spec, "assign"):
            raise TypeError(
                f"window: expected a window spec (TumblingWindow.of(...)), got {spec!r}"
            )
        return RStream(self._b, self._tail, window=spec)

    def _key_by_node(self, selector: Callable[[Any], Any] | str, side: int = 0) -> str:
        fn = _key_selector(selector, "key_by")
        node = n.KeyBy(self._b._op_id("key_by"), fn, inputs=(self._tail,), side=side)
        return self._b._add(node)

    def key_by(
        self, selector: Callable[[Any], Any] | str | None = None, *, name: str | None = None
    ) -> GroupedStream:
        """Group by fn(value) (or a field name; none: the value itself, which saves a
        call per element where the stage counts); records shuffle by key hash.

        Also after an aggregate: each key_by cuts a new stage with its own shuffle topic.
        ``name``: the default name of the aggregate or processor that follows (what its
        shuffle and state topics are named by; see docs/operating.md, "Upgrades").
        """
        if name is not None:
            validate_operator_name(name)
        key = whole_value if selector is None else _key_selector(selector, "key_by")
        grouped = GroupedStream(self, key, self._window, name=name)
        self._b._open_groups.append(grouped)
        return grouped

    group_by = key_by

    def join(self, other: RStream, *, name: str | None = None) -> JoinBuilder:
        """Windowed inner join with ``other``: ``.where(k).equal_to(k2).window(w).apply(fn)``;
        ``name`` names the join's state (default ``join``, ``join_2``, ...).

        >>> from stream_assets.serde import json_deserializer
        >>> from stream_assets.windows import Time, TumblingWindow
        >>> b = StreamBuilder("j")
        >>> clicks = b.source("clicks", json_deserializer)
        >>> views = b.source("views", json_deserializer)
        >>> (clicks.join(views).where("user").equal_to("user")
        ...   .window(TumblingWindow.of(Time.seconds(10)))
        ...   .apply(lambda c, v: {"user": c["user"], "page": v["page"]})
        ...   .sink("clicked-views"))
        """
        return JoinBuilder(self, other, "inner", name)

    def left_join(self, other: RStream, *, name: str | None = None) -> JoinBuilder:
        """Windowed left join: as :meth:`join`, and ``fn(left, None)`` for a left value that
        met no right value in its window."""
        return JoinBuilder(self, other, "left", name)

    def join_table(
        self,
        table: Table,
        key: Callable[[Any], Any] | str,
        joiner: Callable[[Any, Any], Any] | None = None,
        *,
        left: bool = False,
        name: str | None = None,
    ) -> StatefulOptions:
        """Each value joined with ``table``'s value for ``key`` as of the value's event time.

        ``joiner(value, table_value)`` (default: a ``(value, table_value)`` pair). Inner by
        default: a value whose key has no table value yet is dropped; with ``left=True``
        it gives ``joiner(value, None)``. A value waits until the watermark passes its event
        time, so table updates up to that time count, whatever order they arrive in.
        Options (``water_mark``, ``idle_timeout``, ``late_records_to``) follow; end with
        ``to_rstream()``. ``name`` names the join's state (default ``join_table``, ...).
        """
        if not isinstance(table, Table) or table.stream._b is not self._b:
            raise TypeError("join_table: expected a Table of the same StreamBuilder (b.table(...))")
        stream_side = self._key_by_node(key, side=0)
        table_side = table.stream._key_by_node(table.key, side=1)
        fn = _callable(joiner, "join_table") if joiner is not None else _pair
        return StatefulOptions(
            self._b,
            lambda o: n.TableJoin(
                self._b._stateful_id("join_table", name),
                None,
                o.lateness_ms,
                o.idle_ms,
                o.late_topic,
                "left" if left else "inner",
                fn,
                inputs=(stream_side, table_side),
                ttl_ms=o.ttl_ms,
            ),
        )

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
        """Print each value to the instance's stdout, in order per queue (terminal).

        So does a plain ``print()`` in your functions; see
        :class:`~stream_assets.plan.nodes.Print`.
        """
        self._then(n.Print, "print")

    def sink(
        self,
        topic: str,
        serializer: Serializer = json_serializer,
        *,
        key: Callable[[Any], Any] | str | None = None,
        tags: Callable[[Any], Any] | str | None = None,
        properties: Callable[[Any], Any] | None = None,
        exactly_once: bool | None = None,
    ) -> None:
        """Send each value to ``topic`` (terminal); the default body is JSON.

        ``key`` (a field or function of the value) is the message's user key,
        and the sink queue is chosen by its hash; ``tags`` (a field or
        function) its tag; ``properties`` a function giving a dict of user
        properties. The engine's de-duplication key is always the message's
        last key. ``exactly_once`` (default: the builder's
        ``exactly_once_sinks``): a consumer sees each result once, committed
        with the state after an aggregate, with the source position before one
        (docs/guarantees.md).

        Example::

            >>> b = StreamBuilder("wc")
            >>> counts = b.source("lines", lambda body: body.decode()).key_by(str).count()
            >>> counts.to_rstream().sink("counts", exactly_once=True)
        """
        validate_name(topic, "sink topic")
        if self._window is not None:
            raise ValueError(
                f"{self._b.job_id}: window(...) must be followed by group_by/key_by, not sink"
            )
        node = n.Sink(
            self._b._sink_id(topic),
            topic,
            _callable(serializer, "sink"),
            key=None if key is None else _key_selector(key, "sink key"),
            tags=None if tags is None else _key_selector(tags, "sink tags"),
            properties=None if properties is None else _callable(properties, "sink properties"),
            exactly_once=self._b.exactly_once_sinks if exactly_once is None else exactly_once,
            inputs=(self._tail,),
        )
        self._b._add(node)


def _pair(value: Any, other: Any) -> Any:
    return (value, other)


class Table:
    """A table read from a topic: the latest value per key. Made by ``StreamBuilder.table``."""

    def __init__(self, stream: RStream, key: Callable[[Any], Any]) -> None:
        self.stream = stream
        self.key = key


class JoinBuilder:
    """A windowed join being declared: ``where`` / ``equal_to`` / ``window`` / ``apply``."""

    def __init__(self, left: RStream, right: RStream, kind: str, name: str | None) -> None:
        if not isinstance(right, RStream) or right._b is not left._b:
            raise TypeError(f"{kind} join: expected a stream of the same StreamBuilder")
        self._left, self._right, self._kind = left, right, kind
        self._name = None if name is None else validate_operator_name(name)
        self._where: Callable[[Any], Any] | None = None
        self._equal_to: Callable[[Any], Any] | None = None
        self._window: Any | None = None
        self._options = _Options()

    def where(self, selector: Callable[[Any], Any] | str) -> JoinBuilder:
        """The left side's join key (a field or function)."""
        self._where = _key_selector(selector, "join where")
        return self

    def equal_to(self, selector: Callable[[Any], Any] | str) -> JoinBuilder:
        """The right side's join key (a field or function)."""
        self._equal_to = _key_selector(selector, "join equal_to")
        return self

    def window(self, spec: Any) -> JoinBuilder:
        """Records of both sides meet when they fall in the same window of ``spec``."""
        if not hasattr(spec, "assign"):
            raise TypeError(f"join window: expected a window spec, got {spec!r}")
        self._window = spec
        return self

    def water_mark(self, seconds: float) -> JoinBuilder:
        """Allowed lateness in seconds."""
        self._options.water_mark(seconds)
        return self

    def idle_timeout(self, seconds: float) -> JoinBuilder:
        """Fire open windows after the sources were idle this long."""
        self._options.idle_timeout(seconds)
        return self

    def late_records_to(self, topic: str) -> JoinBuilder:
        """Also write dropped late records to ``topic``."""
        self._options.late_records_to(topic)
        return self

    def apply(self, joiner: Callable[[Any, Any], Any] | None = None) -> RStream:
        """The stream of ``joiner(left, right)`` (default: ``(left, right)`` pairs)."""
        what = f"{self._kind} join"
        if self._where is None or self._equal_to is None:
            raise ValueError(f"{what}: name both keys with .where(...) and .equal_to(...)")
        if self._window is None:
            raise ValueError(
                f"{what}: a join needs a window (.window(TumblingWindow.of(...))); to join "
                "with the latest value per key, use join_table"
            )
        b = self._left._b
        left = self._left._key_by_node(self._where, side=0)
        right = self._right._key_by_node(self._equal_to, side=1)
        o = self._options
        node = n.Join(
            b._stateful_id("join", self._name),
            self._window,
            o.lateness_ms,
            o.idle_ms,
            o.late_topic,
            JoinCollect(),
            self._kind,
            _callable(joiner, what) if joiner is not None else _pair,
            inputs=(left, right),
        )
        return RStream(b, b._add(node))


class _Options:
    """Watermark, idleness and late-record options of a stateful operator."""

    def __init__(self) -> None:
        self.lateness_ms = 0
        self.idle_ms = _DEFAULT_IDLE_TIMEOUT_MS
        self.late_topic: str | None = None
        self.ttl_ms: int | None = None

    def ttl(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"ttl: a key's state must live > 0 seconds, got {seconds}")
        self.ttl_ms = int(seconds * 1000)

    def water_mark(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"water_mark: lateness must be >= 0 seconds, got {seconds}")
        self.lateness_ms = int(seconds * 1000)

    def idle_timeout(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"idle_timeout: must be > 0 seconds, got {seconds}")
        self.idle_ms = int(seconds * 1000)

    def late_records_to(self, topic: str) -> None:
        self.late_topic = validate_name(topic, "late-records topic")


class StatefulOptions:
    """Options of a stateful operator being declared; ``to_rstream()`` ends it."""

    def __init__(self, builder: StreamBuilder, make: Callable[[_Options], n.Node]) -> None:
        self._b = builder
        self._make = make
        self._options = _Options()
        self._done: RStream | None = None

    def water_mark(self, seconds: float) -> StatefulOptions:
        """Allowed lateness in seconds (watermark = max event time - lateness)."""
        self._options.water_mark(seconds)
        return self

    def idle_timeout(self, seconds: float) -> StatefulOptions:
        """Treat the sources as done after this much time without input."""
        self._options.idle_timeout(seconds)
        return self

    def late_records_to(self, topic: str) -> StatefulOptions:
        """Also write dropped late records to ``topic``."""
        self._options.late_records_to(topic)
        return self

    def ttl(self, seconds: float) -> StatefulOptions:
        """Forget a key's table versions ``seconds`` of event time after its latest record."""
        self._options.ttl(seconds)
        return self

    def to_rstream(self) -> RStream:
        """The stream of results."""
        if self._done is None:
            self._done = RStream(self._b, self._b._add(self._make(self._options)))
        return self._done


class GroupedStream:
    """A keyed stream: window it, then aggregate."""

    def __init__(
        self,
        stream: RStream,
        key: Callable[[Any], Any],
        window: Any | None,
        root: GroupedStream | None = None,
        name: str | None = None,
    ) -> None:
        self._stream = stream
        self._key = key
        self._window = window
        #: The key_by(...) handle this one was made from (itself for key_by's own).
        self._root: GroupedStream = root or self
        #: key_by(name=...): the default name of the stateful operator after it.
        self._name: str | None = name if root is None else root._name

    def window(self, spec: Any) -> GroupedStream:
        """Aggregate per window of ``spec`` (tumbling, sliding or session)."""
        if not hasattr(spec, "assign"):
            raise TypeError(
                f"window: expected a window spec (TumblingWindow.of(...)), got {spec!r}"
            )
        return GroupedStream(self._stream, self._key, spec, root=self._root)

    def _agg(self, alias: str | None, acc: Accumulator, name: str | None) -> AggregatedStream:
        named = self._name if name is None else validate_operator_name(name)
        return AggregatedStream(self, [(alias or acc.kind, acc)], named)

    def count(self, alias: str | None = None, *, name: str | None = None) -> AggregatedStream:
        """Number of records per key (and window). ``name``: the aggregate's name, which its
        shuffle and state topics go by (default: ``aggregate``, ``aggregate_2``, ...)."""
        return self._agg(alias, Count(), name)

    def sum(
        self,
        selector: str | Callable[[Any], Any] | None = None,
        alias: str | None = None,
        *,
        name: str | None = None,
    ) -> AggregatedStream:
        """Sum of a field / function per key (``name`` as for :meth:`count`)."""
        return self._agg(alias, Sum(field_or_fn(selector, "sum")), name)

    def min(
        self,
        selector: str | Callable[[Any], Any] | None = None,
        alias: str | None = None,
        *,
        name: str | None = None,
    ) -> AggregatedStream:
        """Smallest field / function value per key (``name`` as for :meth:`count`)."""
        return self._agg(alias, Min(field_or_fn(selector, "min")), name)

    def max(
        self,
        selector: str | Callable[[Any], Any] | None = None,
        alias: str | None = None,
        *,
        name: str | None = None,
    ) -> AggregatedStream:
        """Largest field / function value per key (``name`` as for :meth:`count`)."""
        return self._agg(alias, Max(field_or_fn(selector, "max")), name)

    def avg(
        self,
        selector: str | Callable[[Any], Any] | None = None,
        alias: str | None = None,
        *,
        name: str | None = None,
    ) -> AggregatedStream:
        """Mean of a field / function per key (``name`` as for :meth:`count`)."""
        return self._agg(alias, Avg(field_or_fn(selector, "avg")), name)

    def process(
        self,
        processor: Processor,
        *,
        water_mark: float = 0,
        ttl: float | None = None,
        idle_timeout: float | None = None,
        late_records_to: str | None = None,
        fire_timers_when_idle: bool = True,
        name: str | None = None,
    ) -> RStream:
        """The user's own stateful logic per key: state, timers, emit (see
        :mod:`stream_assets.operators.processor`).

        ``water_mark``: allowed lateness in seconds (event-time timers fire once
        the watermark passes them; records behind it are late). ``ttl``: forget
        a key's state that many seconds of event time after the latest of its
        records and of the event-time timers it set (so a timer always sees its
        key's state). ``idle_timeout``: a source queue whose end offset has not
        moved for this long (and that was read to its end) leaves the watermark's
        minimum; when every source queue is idle, every pending event-time timer
        fires, as open windows do, and a later record behind the latest timer
        fired is late (``fire_timers_when_idle=False``: timers wait for the
        watermark instead). ``name``: the processor's name, which its shuffle and state
        topics go by (default ``process``, ``process_2``, ...).

        >>> from stream_assets.operators.processor import Processor
        >>> from stream_assets.serde import json_deserializer
        >>> class First(Processor):
        ...     def process(self, key, value, ctx):
        ...         if ctx.value("seen").get() is None:
        ...             ctx.value("seen").set(True)
        ...             ctx.emit(value)
        >>> b = StreamBuilder("dedup")
        >>> b.source("events", json_deserializer).key_by("id").process(First(), ttl=3600).sink("o")
        """
        if not isinstance(processor, Processor):
            raise TypeError(
                "process: expected a Processor instance (a subclass of "
                f"stream_assets.operators.processor.Processor), got {type(processor).__name__}"
            )
        if self._window is not None:
            raise ValueError(
                "process: a processor takes no window; keep per-key state and set "
                "event-time timers instead (ctx.set_event_timer)"
            )
        o = _Options()
        o.water_mark(water_mark)
        if ttl is not None:
            o.ttl(ttl)
        if idle_timeout is not None:
            o.idle_timeout(idle_timeout)
        if late_records_to is not None:
            o.late_records_to(late_records_to)
        b = self._stream._b
        if self._root in b._open_groups:
            b._open_groups.remove(self._root)
        key_by = self._stream._key_by_node(self._key)
        node = n.Process(
            b._stateful_id("process", name if name is not None else self._name),
            None,
            o.lateness_ms,
            o.idle_ms,
            o.late_topic,
            processor,
            inputs=(key_by,),
            ttl_ms=o.ttl_ms,
            fire_timers_when_idle=fire_timers_when_idle,
        )
        return RStream(b, b._add(node))

    def aggregate(
        self, accumulator: Accumulator, alias: str | None = None, *, name: str | None = None
    ) -> AggregatedStream:
        """A user :class:`Accumulator` per key (``name`` as for :meth:`count`)."""
        if not isinstance(accumulator, Accumulator):
            raise TypeError(
                f"aggregate: expected an Accumulator instance, got {type(accumulator).__name__}"
            )
        return self._agg(alias, accumulator, name)


class AggregatedStream:
    """Aggregates being declared; chain more (field style) or call ``to_rstream()``."""

    def __init__(
        self, grouped: GroupedStream, parts: list[tuple[str, Accumulator]], name: str | None
    ) -> None:
        self._grouped = grouped
        self._name = name
        self._b = grouped._stream._b
        self._parts = parts
        self._options = _Options()
        self._emit_every_ms: int | None = None
        self._tombstones = True
        self._done: RStream | None = None

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
        self._options.water_mark(seconds)
        return self

    def idle_timeout(self, seconds: float) -> AggregatedStream:
        """Fire open windows after this much processing time without input."""
        self._options.idle_timeout(seconds)
        return self

    def late_records_to(self, topic: str) -> AggregatedStream:
        """Also write dropped late records to ``topic``."""
        self._options.late_records_to(topic)
        return self

    def ttl(self, seconds: float, *, tombstones: bool = True) -> AggregatedStream:
        """Forget a key's aggregate ``seconds`` of event time after its latest record
        (unwindowed only: windows end by the watermark). A key seen again starts over.

        A key that expires emits a deletion, ``{"key": ..., "expired": true}`` under
        the key's next version, to every sink after the aggregate (past the stage's
        own functions), so a consumer that keeps the highest version forgets the
        key too; ``tombstones=False`` forgets it silently.

        >>> from stream_assets.serde import json_deserializer
        >>> b = StreamBuilder("t")
        >>> b.source("s", json_deserializer).key_by("user").count().ttl(86_400).to_rstream()
        ... # doctest: +ELLIPSIS
        <...RStream object at ...>
        """
        if self._grouped._window is not None:
            raise ValueError(
                "ttl: a window's state ends when the watermark passes the window; "
                "ttl is for unwindowed aggregates"
            )
        self._options.ttl(seconds)
        self._tombstones = tombstones
        return self

    def emit_early(self, every: float = 0) -> AggregatedStream:
        """Also emit open windows' current results: ``every=0`` an update for each window
        a batch changed, ``every=N`` every open window once per N seconds (wall clock).

        Each result of a window then carries a version (the commit's seq) in its
        message key and ``"final"`` in its value, so a consumer keeps the latest.

        >>> from stream_assets.serde import json_deserializer
        >>> from stream_assets.windows import Time, TumblingWindow
        >>> b = StreamBuilder("e")
        >>> (b.source("s", json_deserializer).key_by("user")
        ...   .window(TumblingWindow.of(Time.minutes(10))).count().emit_early(every=5)
        ...   .to_rstream())  # doctest: +ELLIPSIS
        <...RStream object at ...>
        """
        if self._grouped._window is None:
            raise ValueError(
                "emit_early: an unwindowed aggregate already emits every update; "
                "emit_early is for windows"
            )
        if every < 0:
            raise ValueError(f"emit_early: every must be >= 0 seconds, got {every}")
        self._emit_every_ms = int(every * 1000)
        return self

    def to_rstream(self) -> RStream:
        """The stream of results: dicts with ``key``, each alias, and window bounds.

        The key_by and the aggregate enter the plan here (once per aggregate).
        """
        if self._done is None:
            g = self._grouped
            # This key_by is used (also when aggregated through a window(...) handle).
            if g._root in self._b._open_groups:
                self._b._open_groups.remove(g._root)
            key_by = g._stream._key_by_node(g._key)
            o = self._options
            node = n.Aggregate(
                self._b._stateful_id("aggregate", self._name),
                g._window,
                o.lateness_ms,
                o.idle_ms,
                o.late_topic,
                Composite(list(self._parts)),
                inputs=(key_by,),
                ttl_ms=o.ttl_ms,
                emit_every_ms=self._emit_every_ms,
                expiry_tombstones=self._tombstones,
            )
            self._done = RStream(self._b, self._b._add(node))
        return self._done
