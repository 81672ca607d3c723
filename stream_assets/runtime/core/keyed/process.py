"""The user's :class:`~stream_assets.operators.processor.Processor` as keyed logic.

Its state lives under the key's :func:`~stream_assets.state.layout.user_prefix`,
its timers in two time-ordered indexes (event time, wall clock) plus, for
event-time timers, a list per key: a key's timers due at or before its next
record fire first (before its TTL is judged), so ``on_timer`` sees the same
state whatever the batches were (the contract in
:mod:`stream_assets.operators.processor`). A call that fails
leaves none of its changes or emits (a savepoint of the batch state), and
becomes a dead letter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stream_assets.operators.processor import (
    ListState,
    MapState,
    TimerContext,
    ValueState,
    map_key,
)
from stream_assets.plan import nodes as n
from stream_assets.runtime.core.keyed.batch_state import BatchState
from stream_assets.runtime.core.keyed.logic import KeyedBatch, KeyedLogic
from stream_assets.runtime.core.keyed.results import Result, result_key
from stream_assets.runtime.core.shuffle_codec import decode_key, encode_key
from stream_assets.serde.packing import unpack
from stream_assets.state import layout as lay
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import Window, later


class ProcessLogic(KeyedLogic):
    """Runs ``process`` per record and ``on_timer`` per due timer, each all or nothing.

    With ``fire_timers_when_idle`` (the default), every pending event-time timer
    fires when every source queue is idle, as open windows do, and a later
    record behind the latest of them is late; without it, event-time timers
    wait for the watermark whatever the idleness.
    """

    def __init__(self, head: n.Process) -> None:
        self.head = head
        self.closes_when_idle = head.fire_timers_when_idle

    def before_record(self, batch: KeyedBatch, key_bytes: bytes, ts: int) -> None:
        """The key's event-time timers due at or before ``ts``, earliest first (including
        those their ``on_timer`` sets), so the record sees what they left."""
        fired: set[int] = set()
        while True:
            timers = batch.state.get(lay.KEY_TIMERS + key_bytes) or []
            due = [t for t in timers if t <= ts and t not in fired]
            if not due:
                return
            fired.add(due[0])
            self._fire_one(batch, lay.EVENT_TIMERS, due[0], key_bytes)

    def fold(
        self,
        batch: KeyedBatch,
        key: Any,
        key_bytes: bytes,
        window: Window | None,
        partial: Any,
        value: Any,
        ts: int,
        origin: str,
    ) -> None:
        """Run ``process`` (the key's due timers fired in :meth:`before_record`)."""
        ctx = _Context(batch, key, key_bytes, ts, (origin,))
        batch.state.savepoint()
        try:
            self.head.processor.process(key, value, ctx)
        except Exception:
            batch.state.rollback()
            raise
        batch.state.release()
        batch.results.extend(ctx.emitted)

    def fire(self, batch: KeyedBatch, fire_to: int | None, fire_all: bool) -> int | None:
        """Event-time timers the watermark reached (when all sources are idle and
        ``fire_timers_when_idle``, every one pending now), processing-time ones the
        clock reached; a timer an ``on_timer`` sets within that reach fires too (one set
        beyond it waits, so a timer that always sets the next one cannot loop). Returns
        the latest event-time timer fired when all sources are idle (what is closed
        now), else None."""
        idle_fires = fire_all and self.head.fire_timers_when_idle
        if idle_fires:
            pending = (lay.time_of(raw) for raw, _ in batch.state.items(lay.EVENT_TIMERS))
            fire_to = later(fire_to, max(pending, default=None))
        fired: set[bytes] = set()
        latest: int | None = None
        while due := [d for d in self._due(batch, fire_to) if d[1] not in fired]:
            for kind, raw in due:
                fired.add(raw)
                # A timer fired before its key's record in this batch is gone already.
                if batch.state.get(raw) is None:
                    continue
                at = lay.time_of(raw)
                self._fire_one(batch, kind, at, lay.key_of_timed(raw))
                if kind == lay.EVENT_TIMERS and (latest is None or at > latest):
                    latest = at
        return latest if idle_fires else None

    def _due(self, batch: KeyedBatch, fire_to: int | None) -> list[tuple[bytes, bytes]]:
        """Due timers as (kind, state key): event time first, each kind earliest first."""
        due: list[tuple[bytes, bytes]] = []
        if fire_to is not None:
            below = lay.timer_key(lay.EVENT_TIMERS, fire_to + 1, b"")
            due += [
                (lay.EVENT_TIMERS, raw) for raw, _ in batch.state.items(lay.EVENT_TIMERS, below)
            ]
        below = lay.timer_key(lay.PROCESSING_TIMERS, batch.now_ms + 1, b"")
        due += [
            (lay.PROCESSING_TIMERS, raw)
            for raw, _ in batch.state.items(lay.PROCESSING_TIMERS, below)
        ]
        return due

    def _fire_one(self, batch: KeyedBatch, kind: bytes, at: int, key_bytes: bytes) -> None:
        """Remove the timer and run ``on_timer``; a failure is the timer's dead letter."""
        _delete_timer(batch.state, kind, at, key_bytes)
        key = decode_key(key_bytes)
        event = kind == lay.EVENT_TIMERS
        ts = at if event else (batch.watermark if batch.watermark is not None else 0)
        timer = "event" if event else "processing"
        ctx = _Context(batch, key, key_bytes, ts, (f"{timer[0]}{at}", result_key(key)))
        ctx.timer = timer
        batch.state.savepoint()
        try:
            self.head.processor.on_timer(key, ctx)
        except Exception as exc:
            batch.state.rollback()
            _delete_timer(batch.state, kind, at, key_bytes)  # it fired; it must not fail again
            batch.fail(exc, {"key": key, "timer": timer, "at": at}, f"timer/{timer}/{at}")
            return
        batch.state.release()
        batch.results.extend(ctx.emitted)

    def forget(self, batch: KeyedBatch, key_bytes: bytes, expired_at: int) -> None:
        """Drop the key's processor state. No event-time timer is pending then (each keeps
        its key alive a TTL past it); a processing-time timer stays and fires on no state."""
        batch.state.delete_prefix(lay.user_prefix(key_bytes))

    def read(self, store: QueueStateStore, key: Any, window: Window | None) -> Any:
        """The key's state by name: a value, a list, or a map ``{key: value}``; None if none."""
        found: dict[str, Any] = {}
        for raw, packed in store.items(lay.user_prefix(encode_key(key))):
            _kb, name, item = lay.parse_user_key(raw)
            if item:
                found.setdefault(name, {})[map_key(item)] = unpack(packed)
            else:
                found[name] = unpack(packed)
        return found or None


class _Access:
    """One state of one key, as a :class:`~stream_assets.operators.processor.StateAccess`."""

    def __init__(self, state: BatchState, prefix: bytes) -> None:
        self._state = state
        self._prefix = prefix

    def get(self, item: bytes) -> Any:
        return self._state.get(self._prefix + item)

    def put(self, item: bytes, value: Any) -> None:
        self._state.put(self._prefix + item, value)

    def items(self, start: bytes, stop: bytes | None) -> Iterator[tuple[bytes, Any]]:
        below = lay.upper_bound(self._prefix) if stop is None else self._prefix + stop
        cut = len(self._prefix)
        for raw, value in self._state.items(self._prefix, below):
            if raw[cut:] >= start:
                yield raw[cut:], value


class _Context(TimerContext):
    """The context of one ``process`` or ``on_timer`` call."""

    def __init__(
        self,
        batch: KeyedBatch,
        key: Any,
        key_bytes: bytes,
        ts: int,
        origin: tuple[str, ...],
    ) -> None:
        self.key = key
        self.timestamp = ts
        self.watermark = batch.watermark
        self.processing_time = batch.now_ms
        self.timer = ""
        self.emitted: list[Result] = []
        self._batch = batch
        self._key_bytes = key_bytes
        self._origin = origin

    def _access(self, name: str) -> _Access:
        if not isinstance(name, str) or not name or "\x00" in name:
            raise ValueError(f"a state name is a non-empty string without NUL, got {name!r}")
        return _Access(self._batch.state, lay.user_prefix(self._key_bytes, name))

    def value(self, name: str) -> ValueState:
        return ValueState(self._access(name))

    def list(self, name: str) -> ListState:
        return ListState(self._access(name))

    def map(self, name: str) -> MapState:
        return MapState(self._access(name))

    def set_event_timer(self, at_ms: int) -> None:
        _set_timer(self._batch.state, lay.EVENT_TIMERS, int(at_ms), self._key_bytes)
        self._batch.keep_alive(self._key_bytes, int(at_ms))

    def delete_event_timer(self, at_ms: int) -> None:
        _delete_timer(self._batch.state, lay.EVENT_TIMERS, int(at_ms), self._key_bytes)

    def set_processing_timer(self, at_ms: int) -> None:
        _set_timer(self._batch.state, lay.PROCESSING_TIMERS, int(at_ms), self._key_bytes)

    def delete_processing_timer(self, at_ms: int) -> None:
        _delete_timer(self._batch.state, lay.PROCESSING_TIMERS, int(at_ms), self._key_bytes)

    def emit(self, value: Any, timestamp: int | None = None) -> None:
        # Origin: the input record's (or the timer's) and the emit's position, the
        # same when a batch is replayed, so sink message keys tell copies apart.
        origin = (*self._origin, str(len(self.emitted)))
        ts = self.timestamp if timestamp is None else int(timestamp)
        self.emitted.append((origin, value, ts, self.key))


def _set_timer(state: BatchState, kind: bytes, at: int, key_bytes: bytes) -> None:
    state.put(lay.timer_key(kind, at, key_bytes), True)
    if kind == lay.EVENT_TIMERS:
        timers = state.get(lay.KEY_TIMERS + key_bytes) or []
        if at not in timers:
            state.put(lay.KEY_TIMERS + key_bytes, sorted([*timers, at]))


def _delete_timer(state: BatchState, kind: bytes, at: int, key_bytes: bytes) -> None:
    raw = lay.timer_key(kind, at, key_bytes)
    if state.get(raw) is not None:
        state.put(raw, None)
    if kind == lay.EVENT_TIMERS:
        timers = state.get(lay.KEY_TIMERS + key_bytes) or []
        if at in timers:
            rest = [t for t in timers if t != at]
            state.put(lay.KEY_TIMERS + key_bytes, rest or None)
