"""Event-time watermarks that survive the shuffle (DESIGN.md section 3).

A stateful queue reads records that came from several source queues
("origins"), each read at its own pace. Taking the plain max event time would
let one fast origin make a slow origin's on-time records late, so the tracker
keeps the max event time per origin and uses the minimum over origins, minus
the allowed lateness. An origin not seen for longer than the idle timeout
drops out of the minimum, so a quiet queue cannot stall every window. The
watermark never goes backwards, and ``to_dict``/``from_dict`` persist it with
the task's state.

Example: a fast and a slow origin; the slow one holds the watermark back
until it has been idle past the timeout::

    >>> tracker = WatermarkTracker(allowed_lateness_ms=0, idle_timeout_ms=1_000)
    >>> tracker.observe(origin=0, event_time=50_000, now=0)  # fast queue
    >>> tracker.observe(origin=1, event_time=10_000, now=0)  # slow queue
    >>> tracker.watermark(now=500)
    10000
    >>> tracker.observe(origin=0, event_time=52_000, now=1_400)
    >>> tracker.watermark(now=1_600)  # origin 1 silent for 1.6 s > 1 s
    52000
    >>> window_closed(Window(10_000, 20_000), tracker.watermark(now=1_600))
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stream_assets.windows.assigners import Window

_FORMAT_VERSION = 1


def _closed(window_end: int, watermark: int | None) -> bool:
    return watermark is not None and window_end <= watermark


def window_closed(window: Window, watermark: int | None) -> bool:
    """Whether ``window`` has fired, so records for it are late.

    A window fires once the watermark reaches its end; with no watermark yet
    nothing has fired.

    >>> (window_closed(Window(0, 10), 9), window_closed(Window(0, 10), 10))
    (False, True)
    """
    return _closed(window.end, watermark)


@dataclass(slots=True)
class _Origin:
    max_event_time: int | None  # None: expected but nothing seen yet
    last_seen: int


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"watermark state: {what} must be an int, got {value!r}")
    return value


def _non_negative(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"WatermarkTracker {what} must be an int of ms, got {value!r}")
    if value < 0:
        raise ValueError(f"WatermarkTracker {what} must be >= 0 ms, got {value} ms")
    return value


class WatermarkTracker:
    """Per-origin event-time progress of one stateful queue.

    ``now`` is processing time in ms (wall clock of the task); it only decides
    which origins are idle.

    >>> t = WatermarkTracker(allowed_lateness_ms=5_000, idle_timeout_ms=60_000)
    >>> t.watermark(now=0) is None
    True
    >>> t.observe(origin=3, event_time=20_000, now=0)
    >>> (t.watermark(now=0), t.is_late(window_end=15_000, now=0))
    (15000, True)
    """

    __slots__ = ("_allowed_lateness_ms", "_idle_timeout_ms", "_last_watermark", "_origins")

    def __init__(self, allowed_lateness_ms: int, idle_timeout_ms: int) -> None:
        self._allowed_lateness_ms = _non_negative(allowed_lateness_ms, "allowed_lateness_ms")
        self._idle_timeout_ms = _non_negative(idle_timeout_ms, "idle_timeout_ms")
        self._origins: dict[int, _Origin] = {}
        self._last_watermark: int | None = None

    @property
    def allowed_lateness_ms(self) -> int:
        """How far behind the slowest origin's max event time the watermark trails."""
        return self._allowed_lateness_ms

    @property
    def idle_timeout_ms(self) -> int:
        """Processing time after which a silent origin stops holding the watermark."""
        return self._idle_timeout_ms

    @property
    def last_watermark(self) -> int | None:
        """The highest watermark returned so far (the floor), or None."""
        return self._last_watermark

    def expect(self, origin: int, now: int) -> None:
        """Declare a source queue that may send records but has sent none yet.

        Until it sends or stays silent past the idle timeout (counted from
        ``now``), it holds the watermark back: otherwise a fast queue alone
        would advance it and make the slow queue's on-time records late.
        """
        if origin not in self._origins:
            self._origins[origin] = _Origin(None, now)

    def observe(self, origin: int, event_time: int, now: int) -> None:
        """Record that a record from source queue ``origin`` with ``event_time`` arrived."""
        seen = self._origins.get(origin)
        if seen is None:
            self._origins[origin] = _Origin(event_time, now)
            return
        seen.max_event_time = (
            event_time if seen.max_event_time is None else max(seen.max_event_time, event_time)
        )
        # A clock step back must not make a live origin look idle sooner.
        seen.last_seen = max(seen.last_seen, now)

    def watermark(self, now: int) -> int | None:
        """The current watermark at processing time ``now``; None before any record.

        Minimum max event time over non-idle origins, minus the allowed
        lateness; if every origin is idle, the maximum over all of them, so
        windows still fire when input stops. Never lower than a value it
        returned before.
        """
        active = [o for o in self._origins.values() if now - o.last_seen <= self._idle_timeout_ms]
        if any(o.max_event_time is None for o in active):
            return self._last_watermark  # an expected origin has not spoken yet
        seen = [o.max_event_time for o in self._origins.values() if o.max_event_time is not None]
        if not seen:
            return self._last_watermark
        if active:
            event_time = min(o.max_event_time for o in active if o.max_event_time is not None)
        else:
            event_time = max(seen)
        computed = event_time - self._allowed_lateness_ms
        if self._last_watermark is None or computed > self._last_watermark:
            self._last_watermark = computed
        return self._last_watermark

    def is_late(self, window_end: int, now: int) -> bool:
        """Whether the window ending at ``window_end`` has already closed at ``now``."""
        return _closed(window_end, self.watermark(now))

    def to_dict(self) -> dict[str, object]:
        """Plain JSON/msgpack-friendly state (str keys, int values).

        >>> t = WatermarkTracker(allowed_lateness_ms=0, idle_timeout_ms=10)
        >>> t.observe(origin=1, event_time=7, now=100)
        >>> WatermarkTracker.from_dict(t.to_dict()).watermark(now=100)
        7
        """
        d: dict[str, object] = {
            "version": _FORMAT_VERSION,
            "allowed_lateness_ms": self._allowed_lateness_ms,
            "idle_timeout_ms": self._idle_timeout_ms,
            "origins": {
                str(origin): (
                    {"last_seen": o.last_seen}
                    if o.max_event_time is None
                    else {"max_event_time": o.max_event_time, "last_seen": o.last_seen}
                )
                for origin, o in sorted(self._origins.items())
            },
        }
        # Omitted rather than None so the state holds nothing but ints.
        if self._last_watermark is not None:
            d["last_watermark"] = self._last_watermark
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> WatermarkTracker:
        """The tracker ``to_dict`` described, floor included."""
        version = d.get("version")
        if version != _FORMAT_VERSION:
            raise ValueError(f"watermark state: unsupported version {version!r}")
        tracker = cls(
            _int(d.get("allowed_lateness_ms"), "allowed_lateness_ms"),
            _int(d.get("idle_timeout_ms"), "idle_timeout_ms"),
        )
        origins = d.get("origins")
        if not isinstance(origins, Mapping):
            raise ValueError(f"watermark state: origins must be a mapping, got {origins!r}")
        for key, value in origins.items():
            try:
                origin = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"watermark state: bad origin id {key!r}") from None
            if not isinstance(value, Mapping):
                raise ValueError(f"watermark state: origin {key!r} must be a mapping")
            tracker._origins[origin] = _Origin(
                None
                if "max_event_time" not in value
                else _int(value.get("max_event_time"), f"origin {key} max_event_time"),
                _int(value.get("last_seen"), f"origin {key} last_seen"),
            )
        if "last_watermark" in d:
            tracker._last_watermark = _int(d["last_watermark"], "last_watermark")
        return tracker
