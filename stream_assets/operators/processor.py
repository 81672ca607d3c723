"""The user's own stateful logic: a :class:`Processor` per keyed stream.

``key_by(...).process(MyProcessor())`` calls ``process(key, value, ctx)`` for
each record, with the key's state at hand (:meth:`ProcessContext.value`,
:meth:`~ProcessContext.list`, :meth:`~ProcessContext.map`), timers by event
time and by the wall clock, and :meth:`~ProcessContext.emit` to the stream.
State, timers and emitted results are exactly once through the state topic:
they commit with the batch, restore on any executor, and a state query shows
them.

When timers fire (the contract the tests hold):

- An **event-time** timer at ``T`` fires once the watermark reaches ``T``, and
  always before its key's first record at or after ``T``. So ``on_timer`` sees
  exactly the key's records before ``T`` (in arrival order; records behind the
  watermark are late and go where late records go), whatever the batches were.
- A **processing-time** timer at ``T`` (ms since the epoch) fires in the first
  batch that runs at or after ``T`` (stages with timers get a batch now and
  then even without input).
- With a **TTL** (``process(..., ttl=s)``), a key lives ``s`` seconds of event
  time past the latest of its records and of the event-time timers set for it,
  so a timer always fires, with the key's state, before the key expires; a
  record at or after the expiry then finds the key forgotten.
- When **every source queue is idle**, every pending event-time timer fires
  (``fire_timers_when_idle=False``: they wait for the watermark), and a later
  record behind the latest of them is late.

Example: drop repeats of an id seen within the last hour of event time::

    >>> class Dedup(Processor):
    ...     def process(self, key, value, ctx):
    ...         seen = ctx.value("seen")
    ...         if seen.get() is None:
    ...             ctx.emit(value)
    ...             ctx.set_event_timer(ctx.timestamp + 3_600_000)
    ...         seen.set(True)
    ...     def on_timer(self, key, ctx):
    ...         ctx.value("seen").clear()
    >>> stream.key_by("id").process(Dedup()).sink("unique")  # doctest: +SKIP
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, Protocol

_BIAS = 2**63


class StateAccess(Protocol):
    """What a state handle reads and writes through: one key's part of the batch state."""

    def get(self, item: bytes) -> Any: ...

    def put(self, item: bytes, value: Any) -> None: ...

    def items(self, start: bytes, stop: bytes | None) -> Iterator[tuple[bytes, Any]]: ...


class ValueState:
    """One value per key: ``get()``, ``set(value)``, ``clear()``.

    >>> count = ctx.value("count")  # doctest: +SKIP
    >>> count.set((count.get() or 0) + 1)  # doctest: +SKIP
    """

    def __init__(self, access: StateAccess) -> None:
        self._access = access

    def get(self, default: Any = None) -> Any:
        """The value, or ``default`` when none is set."""
        value = self._access.get(b"")
        return default if value is None else value

    def set(self, value: Any) -> None:
        """Set the value (msgpack-friendly: numbers, strings, lists, dicts); None clears."""
        self._access.put(b"", value)

    def clear(self) -> None:
        """Remove the value."""
        self._access.put(b"", None)


class ListState(ValueState):
    """A list per key: ``append(item)``, ``get()`` (a list), ``set(items)``, ``clear()``.

    >>> ctx.list("recent").append(value)  # doctest: +SKIP
    """

    def get(self, default: Any = None) -> list[Any]:
        """The items, oldest first ([] when empty)."""
        return list(super().get(default or []))

    def append(self, item: Any) -> None:
        """Add ``item`` at the end."""
        self.set([*self.get(), item])


class MapState:
    """A sorted map per key, read by range: keys are ints, strings or bytes.

    Keys of one type sort naturally (ints numerically, strings by code point), so
    ``items(start, stop)`` reads a range, e.g. a top-N by score or events by time.

    >>> scores = ctx.map("scores")  # doctest: +SKIP
    >>> scores.put(42, "alice"); [k for k, _ in scores.items(0, 100)]  # doctest: +SKIP
    [42]
    """

    def __init__(self, access: StateAccess) -> None:
        self._access = access

    def get(self, key: int | str | bytes, default: Any = None) -> Any:
        """The value of ``key``, or ``default``."""
        value = self._access.get(map_item(key))
        return default if value is None else value

    def put(self, key: int | str | bytes, value: Any) -> None:
        """Set ``key`` to ``value`` (None removes it)."""
        self._access.put(map_item(key), value)

    def delete(self, key: int | str | bytes) -> None:
        """Remove ``key``."""
        self._access.put(map_item(key), None)

    def items(
        self, start: int | str | bytes | None = None, stop: int | str | bytes | None = None
    ) -> Iterator[tuple[Any, Any]]:
        """``(key, value)`` pairs with ``start <= key < stop``, in key order."""
        low = b"" if start is None else map_item(start)
        high = None if stop is None else map_item(stop)
        for raw, value in list(self._access.items(low, high)):
            yield map_key(raw), value

    def keys(self) -> list[Any]:
        """Every key, in order."""
        return [k for k, _ in self.items()]

    def clear(self) -> None:
        """Remove every entry."""
        for raw, _ in list(self._access.items(b"", None)):
            self._access.put(raw, None)


def map_item(key: int | str | bytes) -> bytes:
    """A map key as bytes whose order is the keys' order (ints before strings before bytes).

    >>> map_item(-1) < map_item(2) < map_item(300) < map_item("a") < map_item(b"a")
    True
    >>> [map_key(map_item(k)) for k in (-5, "né", b"\\x00")]
    [-5, 'né', b'\\x00']
    """
    if isinstance(key, bool) or not isinstance(key, int | str | bytes):
        raise TypeError(
            f"map state keys are ints, strings or bytes (ordered for range reads), got "
            f"{type(key).__name__}: convert it, e.g. str(key)"
        )
    if isinstance(key, int):
        if not -_BIAS <= key < _BIAS:
            raise ValueError(f"map state int keys must fit in 64 bits, got {key}")
        return b"i" + struct.pack(">Q", key + _BIAS)
    if isinstance(key, str):
        return b"s" + key.encode()
    return b"y" + key


def map_key(raw: bytes) -> int | str | bytes:
    """The key back from :func:`map_item`."""
    kind, body = raw[:1], raw[1:]
    if kind == b"i":
        return int(struct.unpack(">Q", body)[0]) - _BIAS
    return body.decode() if kind == b"s" else body


class ProcessContext(ABC):
    """What ``process`` and ``on_timer`` see: the key, time, state, timers and emit."""

    #: The key being processed.
    key: Any
    #: Event time (ms) of the record, or the time of the timer firing.
    timestamp: int
    #: The stage's watermark: as the batch started for ``process``, as it ended for a
    #: timer the batch's watermark fired (None: no watermark yet).
    watermark: int | None
    #: Wall-clock ms this batch runs at (one value for the whole batch).
    processing_time: int

    @abstractmethod
    def value(self, name: str) -> ValueState:
        """The key's value state ``name``."""

    @abstractmethod
    def list(self, name: str) -> ListState:
        """The key's list state ``name``."""

    @abstractmethod
    def map(self, name: str) -> MapState:
        """The key's map state ``name`` (sorted, read by range)."""

    @abstractmethod
    def set_event_timer(self, at_ms: int) -> None:
        """Call ``on_timer`` for this key once event time reaches ``at_ms`` (once per time)."""

    @abstractmethod
    def delete_event_timer(self, at_ms: int) -> None:
        """Cancel the event-time timer at ``at_ms`` (nothing if there is none)."""

    @abstractmethod
    def set_processing_timer(self, at_ms: int) -> None:
        """Call ``on_timer`` for this key in the first batch at or after wall-clock ``at_ms``."""

    @abstractmethod
    def delete_processing_timer(self, at_ms: int) -> None:
        """Cancel the processing-time timer at ``at_ms``."""

    @abstractmethod
    def emit(self, value: Any, timestamp: int | None = None) -> None:
        """Send ``value`` down the stream (event time: ``timestamp`` or ``ctx.timestamp``)."""


class TimerContext(ProcessContext):
    """``on_timer``'s context: also which kind of timer fired."""

    #: "event" or "processing".
    timer: str


class Processor(ABC):
    """Per-key logic with state and timers; subclass it and pass an instance to
    ``key_by(...).process(...)``. Instances are pickled into Spark tasks: keep
    only configuration on ``self``, and everything per key in ``ctx`` state.

    Example: alert when a key has been silent for 10 minutes of event time::

        >>> class Silence(Processor):
        ...     def process(self, key, value, ctx):
        ...         last = ctx.value("due")
        ...         if last.get() is not None:
        ...             ctx.delete_event_timer(last.get())
        ...         last.set(ctx.timestamp + 600_000)
        ...         ctx.set_event_timer(ctx.timestamp + 600_000)
        ...     def on_timer(self, key, ctx):
        ...         ctx.emit({"key": key, "silent_since": ctx.timestamp - 600_000})
        ...         ctx.value("due").clear()
    """

    @abstractmethod
    def process(self, key: Any, value: Any, ctx: ProcessContext) -> None:
        """Handle one record of ``key``."""

    def on_timer(self, key: Any, ctx: TimerContext) -> None:  # noqa: B027 - optional hook
        """Handle a timer of ``key`` firing (``ctx.timestamp``: the timer's time)."""
