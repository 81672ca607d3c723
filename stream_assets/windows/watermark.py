"""Event-time watermarks that survive the shuffle (DESIGN.md section 3).

A stateful queue reads records that came from several source queues
("origins"), each read at its own pace. Taking the plain max event time would
let one fast origin make a slow origin's on-time records late, so the tracker
keeps the max event time per origin and uses the minimum over origins, minus
the allowed lateness. An origin that is *idle* drops out of the minimum, so a
quiet queue cannot stall every window.

Idleness is not the tracker's to guess: the caller says which origins are
idle, judged by the broker's offsets (the source queue's end offset has not
moved for the idle timeout and everything in it was processed), never by the
processing-time gap between batches, so a slow batch cannot fire a window.
The watermark never goes backwards, and ``to_dict``/``from_dict`` persist it
with the task's state.

Example: a fast and a slow origin; the slow one holds the watermark back
until its source queue is idle::

    >>> tracker = WatermarkTracker(allowed_lateness_ms=0)
    >>> tracker.observe(origin=0, event_time=50_000)  # fast queue
    >>> tracker.observe(origin=1, event_time=10_000)  # slow queue
    >>> tracker.watermark()
    10000
    >>> tracker.watermark(idle={1})  # queue 1 stopped growing for the idle timeout
    50000
    >>> window_closed(Window(10_000, 20_000), tracker.watermark())
    True
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from stream_assets.windows.assigners import Window

_FORMAT_VERSION = 2
#: Version 1 also kept per-origin processing times for idleness; they are ignored.
_READABLE = (1, 2)


def _closed(window_end: int, watermark: int | None) -> bool:
    return watermark is not None and window_end <= watermark


def later(a: int | None, b: int | None) -> int | None:
    """The later of two event times, either of which may not be known yet (None).

    >>> later(None, 5), later(7, 5), later(None, None)
    (5, 7, None)
    """
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def window_closed(window: Window, watermark: int | None) -> bool:
    """Whether ``window`` has fired, so records for it are late.

    A window fires once the watermark reaches its end; with no watermark yet
    nothing has fired.

    >>> (window_closed(Window(0, 10), 9), window_closed(Window(0, 10), 10))
    (False, True)
    """
    return _closed(window.end, watermark)


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

    >>> t = WatermarkTracker(allowed_lateness_ms=5_000)
    >>> t.watermark() is None
    True
    >>> t.observe(origin=3, event_time=20_000)
    >>> (t.watermark(), t.is_late(window_end=15_000))
    (15000, True)
    """

    __slots__ = ("_allowed_lateness_ms", "_last_watermark", "_origins")

    def __init__(self, allowed_lateness_ms: int) -> None:
        self._allowed_lateness_ms = _non_negative(allowed_lateness_ms, "allowed_lateness_ms")
        #: origin -> max event time seen (None: expected, nothing seen yet).
        self._origins: dict[int, int | None] = {}
        self._last_watermark: int | None = None

    @property
    def allowed_lateness_ms(self) -> int:
        """How far behind the slowest origin's max event time the watermark trails."""
        return self._allowed_lateness_ms

    @property
    def last_watermark(self) -> int | None:
        """The highest watermark returned so far (the floor), or None."""
        return self._last_watermark

    def expect(self, origin: int) -> None:
        """Declare a source queue that may send records but has sent none yet.

        Until it sends or is idle, it holds the watermark back: otherwise a
        fast queue alone would advance it and make the slow queue's on-time
        records late.
        """
        self._origins.setdefault(origin, None)

    def retain(self, origins: Collection[int]) -> None:
        """Forget origins not in ``origins``: an upstream an upgraded topology no longer has
        (or numbers otherwise) must not hold the watermark back for ever.

        >>> t = WatermarkTracker(allowed_lateness_ms=0)
        >>> t.observe(origin=1, event_time=5); t.observe(origin=2, event_time=9)
        >>> t.retain([2]); t.origins()
        (2,)
        """
        for origin in [o for o in self._origins if o not in origins]:
            del self._origins[origin]

    def observe(self, origin: int, event_time: int) -> None:
        """Record that a record from source queue ``origin`` with ``event_time`` arrived."""
        seen = self._origins.get(origin)
        self._origins[origin] = event_time if seen is None else max(seen, event_time)

    def origins(self) -> tuple[int, ...]:
        """Every origin expected or seen, in id order."""
        return tuple(sorted(self._origins))

    def max_event_time(self, origin: int) -> int | None:
        """The highest event time seen from ``origin`` (None: nothing yet)."""
        return self._origins.get(origin)

    def watermark(self, idle: Collection[int] = ()) -> int | None:
        """The current watermark, origins in ``idle`` left out; None before any record.

        Minimum max event time over origins that are not idle, minus the
        allowed lateness; if every origin is idle, the maximum over all of
        them, so windows still fire when input stops. Never lower than a
        value it returned before.
        """
        active = [t for o, t in self._origins.items() if o not in idle]
        if any(t is None for t in active):
            return self._last_watermark  # an expected origin has not spoken yet
        seen = [t for t in self._origins.values() if t is not None]
        if not seen:
            return self._last_watermark
        event_time = min(t for t in active if t is not None) if active else max(seen)
        computed = event_time - self._allowed_lateness_ms
        if self._last_watermark is None or computed > self._last_watermark:
            self._last_watermark = computed
        return self._last_watermark

    def is_late(self, window_end: int, idle: Collection[int] = ()) -> bool:
        """Whether the window ending at ``window_end`` has already closed."""
        return _closed(window_end, self.watermark(idle))

    def to_dict(self) -> dict[str, object]:
        """Plain JSON/msgpack-friendly state (str keys, int values).

        >>> t = WatermarkTracker(allowed_lateness_ms=0)
        >>> t.observe(origin=1, event_time=7)
        >>> WatermarkTracker.from_dict(t.to_dict()).watermark()
        7
        """
        d: dict[str, object] = {
            "version": _FORMAT_VERSION,
            "allowed_lateness_ms": self._allowed_lateness_ms,
            "origins": {
                str(origin): {} if t is None else {"max_event_time": t}
                for origin, t in sorted(self._origins.items())
            },
        }
        # Omitted rather than None so the state holds nothing but ints.
        if self._last_watermark is not None:
            d["last_watermark"] = self._last_watermark
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> WatermarkTracker:
        """The tracker ``to_dict`` described, floor included (version 1's idle data ignored)."""
        version = d.get("version")
        if version not in _READABLE:
            raise ValueError(f"watermark state: unsupported version {version!r}")
        tracker = cls(_int(d.get("allowed_lateness_ms"), "allowed_lateness_ms"))
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
            tracker._origins[origin] = (
                None
                if "max_event_time" not in value
                else _int(value.get("max_event_time"), f"origin {key} max_event_time")
            )
        if "last_watermark" in d:
            tracker._last_watermark = _int(d["last_watermark"], "last_watermark")
        return tracker
