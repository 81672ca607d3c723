"""The logical plan: one node per DSL operator, linked to its inputs by op id.

Nodes are plain frozen dataclasses holding the user's functions; they are
pickled (cloudpickle) into Spark tasks with the stage that runs them. A node
names its inputs (``inputs``), so a plan is a graph: a stream handle used
twice branches, ``union`` has several inputs, and a join's head has one
``key_by`` per side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stream_assets.operators.aggregates import Accumulator
from stream_assets.operators.processor import Processor
from stream_assets.serde import Deserializer, Serializer
from stream_assets.windows.assigners import Window


@dataclass(frozen=True)
class Node:
    """Base of every plan node; ``op_id`` is unique and stable within a topology."""

    op_id: str
    #: Op ids of the nodes this one reads from (none for a source).
    inputs: tuple[str, ...] = field(default=(), kw_only=True)


@dataclass(frozen=True)
class Source(Node):
    """Read ``topic``, turning each body into a value with ``deserializer``; with
    ``tags`` (a RocketMQ tag expression, ``"A || B"``) only the messages it selects."""

    topic: str
    deserializer: Deserializer
    tags: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class UserFunction(Node):
    """An operator around one user function; ``metadata`` passes the record's
    :class:`~stream_assets.operators.metadata.Metadata` as a second argument."""

    fn: Callable[..., Any]
    metadata: bool = field(default=False, kw_only=True)


@dataclass(frozen=True)
class Map(UserFunction):
    """value -> fn(value)."""


@dataclass(frozen=True)
class FlatMap(UserFunction):
    """value -> each item of fn(value)."""


@dataclass(frozen=True)
class Filter(UserFunction):
    """Keep values for which fn(value) is truthy."""


@dataclass(frozen=True)
class Foreach(UserFunction):
    """Call fn(value) for its side effect; the value passes on unchanged."""


@dataclass(frozen=True)
class SelectTimestamp(UserFunction):
    """Event time (epoch ms) of each value is fn(value) from here on."""


@dataclass(frozen=True)
class BatchFunction(Node):
    """An operator around one vectorised user function: it takes a ``pyarrow.Array``
    of values and answers for each of them, in order (it must be elementwise: a
    value's answer may not depend on the other values of its batch)."""

    fn: Callable[[Any], Any]


@dataclass(frozen=True)
class MapBatches(BatchFunction):
    """values -> fn(values): an array of the same length, one value for each."""


@dataclass(frozen=True)
class FlatMapBatches(BatchFunction):
    """values -> fn(values): a list array of the same length; each value becomes the
    items of its list."""


@dataclass(frozen=True)
class FilterBatches(BatchFunction):
    """Keep the values where fn(values), a boolean array of the same length, is true
    (null drops the value)."""


@dataclass(frozen=True)
class Union(Node):
    """Every value of every input, unchanged."""


@dataclass(frozen=True)
class Split(Node):
    """Sends each value to the :class:`Pick` of the first predicate it satisfies."""

    predicates: tuple[Callable[[Any], Any], ...]
    #: Values no predicate accepts go to the Pick numbered len(predicates), if any.
    default: bool = False


@dataclass(frozen=True)
class Pick(Node):
    """Output ``index`` of a :class:`Split` (its only input)."""

    index: int


@dataclass(frozen=True)
class KeyBy(Node):
    """Group by fn(value): records are re-routed through a shuffle topic by key hash.

    ``side`` tells a join's head which input a record came from (0: left or
    stream, 1: right or table).
    """

    fn: Callable[[Any], Any]
    side: int = field(default=0, kw_only=True)


@dataclass(frozen=True)
class Stateful(Node):
    """The head of a keyed stage: keeps state per key in RocksDB, with a changelog.

    Its inputs are the :class:`KeyBy` nodes that shuffle records to it.
    """

    window: Any | None  # a spec from stream_assets.windows, or None
    allowed_lateness_ms: int
    idle_timeout_ms: int
    late_topic: str | None
    #: Per-key state expires this long (event time) after the key's latest record.
    ttl_ms: int | None = field(default=None, kw_only=True)

    @property
    def judges_lateness(self) -> bool:
        """Whether a record can be late here (it falls in windows of event time)."""
        return self.window is not None

    @property
    def waits_for_time(self) -> bool:
        """Whether state waits for time to pass (windows, timers, TTL): the stage then
        needs batches with no input now and then, to fire what time made due."""
        return self.window is not None or self.ttl_ms is not None

    def windows_of(self, ts: int) -> list[Window | None]:
        """The windows a record at ``ts`` counts in (``[None]``: unwindowed)."""
        return list(self.window.assign(ts)) if self.window is not None else [None]

    def may_be_late(self, ts: int, progress: int) -> bool:
        """Whether a record at ``ts`` can be late once its source queue's progress (max
        event time read before it) is ``progress``; False: surely on time.

        Exact for fixed windows and points in time. A session's verdict also
        depends on the sessions the record touches, each ending at or after
        ``ts``: it can be late only when ``ts`` itself is at or behind the
        closed line.
        """
        closed_to = progress - self.allowed_lateness_ms
        if self.window is not None and self.window.is_merging:
            return ts <= closed_to
        return any(w is not None and w.end <= closed_to for w in self.windows_of(ts))


@dataclass(frozen=True)
class Aggregate(Stateful):
    """Keyed (optionally windowed) aggregation."""

    accumulator: Accumulator
    #: Results of open windows too: None only final results; 0 an update per window
    #: changed in a batch; N one update of every open window each N ms (wall clock).
    emit_every_ms: int | None = field(default=None, kw_only=True)
    #: With a TTL: a key that expires emits a deletion (``{"key": ..., "expired": true}``
    #: under its next version); False: it is forgotten silently.
    expiry_tombstones: bool = field(default=True, kw_only=True)


@dataclass(frozen=True)
class Join(Aggregate):
    """Windowed join of two keyed streams: the records of both sides that fall in one
    window with one key are collected (``accumulator`` is a
    :class:`~stream_assets.operators.joins.JoinCollect`), and when the window fires
    every left-right pair becomes ``joiner(left, right)``; a ``left`` join also gives
    ``joiner(left, None)`` for a left record that met no right one."""

    kind: str  # "inner" | "left"
    joiner: Callable[[Any, Any], Any]


@dataclass(frozen=True)
class TableJoin(Stateful):
    """Stream-table join: each stream record (side 0) meets the table's value for its key
    as of the record's event time (the latest table record, side 1, at or before it)."""

    kind: str  # "inner" | "left"
    joiner: Callable[[Any, Any], Any]

    @property
    def judges_lateness(self) -> bool:
        """Always: a record of either side is a point in event time."""
        return True

    @property
    def waits_for_time(self) -> bool:
        """Always: stream records wait for the watermark."""
        return True

    def windows_of(self, ts: int) -> list[Window | None]:
        """A record of either side is a point in time: ``[ts, ts + 1)``."""
        return [Window(ts, ts + 1)]


@dataclass(frozen=True)
class Process(Stateful):
    """The user's own stateful logic: a :class:`~stream_assets.operators.processor.Processor`
    sees each record of its key with the key's state, sets timers and emits."""

    processor: Processor
    #: When every source queue is idle, pending event-time timers fire as open windows
    #: do (and later records behind the latest of them are late); False: they wait
    #: for the watermark.
    fire_timers_when_idle: bool = field(default=True, kw_only=True)

    @property
    def judges_lateness(self) -> bool:
        """Always: a record is a point in event time, and one behind the watermark is late
        (what keeps ``on_timer`` independent of batches: see the processor's contract)."""
        return True

    @property
    def waits_for_time(self) -> bool:
        """Always: timers fire as event time and the wall clock pass."""
        return True

    def windows_of(self, ts: int) -> list[Window | None]:
        """A record is a point in time: ``[ts, ts + 1)``."""
        return [Window(ts, ts + 1)]


@dataclass(frozen=True)
class Print(Node):
    """Print each value (``print(value)``) to the instance's stdout (terminal).

    Wherever the task ran, the line reaches the instance process's stdout (for
    a run under Dagster, the run's captured stdout), in order per queue, at
    least once (:mod:`~stream_assets.runtime.spark.task_stdout`).
    """


@dataclass(frozen=True)
class Sink(Node):
    """Send each value to ``topic`` with ``serializer`` (terminal).

    ``key``, ``tags`` and ``properties``, functions of the value, set the
    message's user key, tag and user properties. ``exactly_once``: each step's
    messages are one RocketMQ transaction, committed with the step's state
    (:mod:`~stream_assets.runtime.core.sink_transactions`).
    """

    topic: str
    serializer: Serializer
    key: Callable[[Any], Any] | None = field(default=None, kw_only=True)
    tags: Callable[[Any], Any] | None = field(default=None, kw_only=True)
    properties: Callable[[Any], Any] | None = field(default=None, kw_only=True)
    exactly_once: bool = field(default=False, kw_only=True)
