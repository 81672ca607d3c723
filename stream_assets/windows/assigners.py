"""Windows and the specs that assign an event time to them.

A ``Window`` is the half-open interval ``[start, end)`` of event times in ms.
Tumbling and sliding windows are aligned to the epoch (start is a multiple of
the size or slide), so every task assigns the same windows without talking to
the others. Session windows start as ``[ts, ts + gap)`` per record and are
merged afterwards with ``merge_sessions``.

Specs serialize to small dicts (``to_dict``/``window_spec_from_dict``) so a
plan can carry them.

Example::

    >>> TumblingWindow.of(Time.seconds(10)).assign(12_345)
    [Window(start=10000, end=20000)]
    >>> spec = SlidingWindow.of(Time.seconds(10), Time.seconds(5))
    >>> window_spec_from_dict(spec.to_dict()) == spec
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeAlias, TypeGuard

from stream_assets.windows.time import Time


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, order=True)
class Window:
    """The event-time interval ``[start, end)``, in ms.

    Example::

        >>> w = Window(0, 10)
        >>> (w.max_timestamp, w.contains(9), w.contains(10))
        (9, True, False)
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (_is_int(self.start) and _is_int(self.end)):
            raise TypeError(f"Window bounds must be ints, got {self.start!r}, {self.end!r}")
        if self.end <= self.start:
            raise ValueError(f"Window end must be > start, got [{self.start}, {self.end})")

    @property
    def max_timestamp(self) -> int:
        """The last event time inside the window, ``end - 1``."""
        return self.end - 1

    def contains(self, ts: int) -> bool:
        """Whether event time ``ts`` falls in ``[start, end)``."""
        return self.start <= ts < self.end


def _duration_ms(t: Time, window: str, what: str) -> int:
    if not isinstance(t, Time):
        raise TypeError(f"{window} {what} must be a Time, got {t!r}")
    return t.ms


def _positive(window: str, what: str, value: object) -> None:
    if not _is_int(value):
        raise TypeError(f"{window} {what} must be an int of ms, got {value!r}")
    if value <= 0:
        raise ValueError(f"{window} {what} must be > 0 ms, got {value} ms")


def _field(d: Mapping[str, object], kind: str, name: str) -> int:
    if d.get("kind") != kind:
        raise ValueError(f"expected a {kind!r} window spec, got kind {d.get('kind')!r}")
    value = d.get(name)
    if not _is_int(value):
        raise ValueError(f"{kind} window spec needs an int {name!r}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class TumblingWindow:
    """Back-to-back windows of ``size_ms``, aligned to the epoch.

    Example::

        >>> spec = TumblingWindow.of(Time.seconds(10))
        >>> spec.assign(-1)
        [Window(start=-10000, end=0)]
        >>> spec.to_dict()
        {'kind': 'tumbling', 'size_ms': 10000}
    """

    size_ms: int
    kind: ClassVar[str] = "tumbling"

    def __post_init__(self) -> None:
        _positive("TumblingWindow", "size", self.size_ms)

    @classmethod
    def of(cls, size: Time) -> TumblingWindow:
        """Tumbling windows of length ``size``."""
        return cls(_duration_ms(size, "TumblingWindow", "size"))

    @property
    def is_merging(self) -> bool:
        """False: a record's window never changes after assignment."""
        return False

    def assign(self, ts: int) -> list[Window]:
        """The one window holding event time ``ts``."""
        # Python's % floors, so negative ts land in the window below zero.
        start = ts - ts % self.size_ms
        return [Window(start, start + self.size_ms)]

    def to_dict(self) -> dict[str, object]:
        """A plain-dict form for plans; see ``window_spec_from_dict``."""
        return {"kind": self.kind, "size_ms": self.size_ms}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> TumblingWindow:
        """The inverse of ``to_dict``."""
        return cls(_field(d, cls.kind, "size_ms"))


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """Windows of ``size_ms`` starting at every multiple of ``slide_ms``.

    The size need not be a multiple of the slide, so a record may fall in a
    different number of windows depending on where it lands.

    Example::

        >>> spec = SlidingWindow.of(Time.seconds(10), Time.seconds(5))
        >>> spec.assign(12_000)
        [Window(start=5000, end=15000), Window(start=10000, end=20000)]
    """

    size_ms: int
    slide_ms: int
    kind: ClassVar[str] = "sliding"

    def __post_init__(self) -> None:
        _positive("SlidingWindow", "size", self.size_ms)
        _positive("SlidingWindow", "slide", self.slide_ms)
        if self.slide_ms > self.size_ms:
            # A slide above the size would leave gaps that no window covers.
            raise ValueError(
                f"SlidingWindow slide must be <= size ({self.size_ms} ms), got {self.slide_ms} ms"
            )

    @classmethod
    def of(cls, size: Time, slide: Time) -> SlidingWindow:
        """Windows of length ``size`` starting every ``slide``."""
        return cls(
            _duration_ms(size, "SlidingWindow", "size"),
            _duration_ms(slide, "SlidingWindow", "slide"),
        )

    @property
    def is_merging(self) -> bool:
        """False: a record's windows never change after assignment."""
        return False

    def assign(self, ts: int) -> list[Window]:
        """Every window holding event time ``ts``, ordered by start."""
        last_start = ts - ts % self.slide_ms
        # Starts run down from last_start while the window still reaches ts.
        starts = range(last_start, ts - self.size_ms, -self.slide_ms)
        return [Window(s, s + self.size_ms) for s in reversed(starts)]

    def to_dict(self) -> dict[str, object]:
        """A plain-dict form for plans; see ``window_spec_from_dict``."""
        return {"kind": self.kind, "size_ms": self.size_ms, "slide_ms": self.slide_ms}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SlidingWindow:
        """The inverse of ``to_dict``."""
        return cls(_field(d, cls.kind, "size_ms"), _field(d, cls.kind, "slide_ms"))


@dataclass(frozen=True, slots=True)
class SessionWindow:
    """Per-key sessions that close after ``gap_ms`` without records.

    Each record gets ``[ts, ts + gap)``; the engine merges a key's windows
    with ``merge_sessions``.

    Example::

        >>> spec = SessionWindow.with_gap(Time.seconds(30))
        >>> (spec.assign(1_000), spec.is_merging)
        ([Window(start=1000, end=31000)], True)
    """

    gap_ms: int
    kind: ClassVar[str] = "session"

    def __post_init__(self) -> None:
        _positive("SessionWindow", "gap", self.gap_ms)

    @classmethod
    def with_gap(cls, gap: Time) -> SessionWindow:
        """Sessions that end ``gap`` after their last record."""
        return cls(_duration_ms(gap, "SessionWindow", "gap"))

    @property
    def is_merging(self) -> bool:
        """True: windows must be merged with ``merge_sessions``."""
        return True

    def assign(self, ts: int) -> list[Window]:
        """The single-record session ``[ts, ts + gap)``."""
        return [Window(ts, ts + self.gap_ms)]

    def to_dict(self) -> dict[str, object]:
        """A plain-dict form for plans; see ``window_spec_from_dict``."""
        return {"kind": self.kind, "gap_ms": self.gap_ms}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SessionWindow:
        """The inverse of ``to_dict``."""
        return cls(_field(d, cls.kind, "gap_ms"))


WindowSpec: TypeAlias = TumblingWindow | SlidingWindow | SessionWindow

_SPECS: dict[str, type[TumblingWindow] | type[SlidingWindow] | type[SessionWindow]] = {
    TumblingWindow.kind: TumblingWindow,
    SlidingWindow.kind: SlidingWindow,
    SessionWindow.kind: SessionWindow,
}


def window_spec_from_dict(d: Mapping[str, object]) -> WindowSpec:
    """The spec a ``to_dict`` result describes, whatever its kind.

    >>> window_spec_from_dict({"kind": "session", "gap_ms": 500})
    SessionWindow(gap_ms=500)
    """
    kind = d.get("kind")
    spec = _SPECS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise ValueError(f"unknown window kind {kind!r}; expected one of {sorted(_SPECS)}")
    return spec.from_dict(d)


def merge_sessions(windows: Sequence[Window]) -> list[tuple[Window, list[int]]]:
    """Merge session windows that overlap or touch, as Flink does.

    Returns each merged window, ordered by start, with the indices (ascending)
    of the input windows it absorbed, so the caller can merge their state.
    Windows that only touch (``a.end == b.start``) merge: records exactly one
    gap apart belong to one session, as in Flink's ``TimeWindow.intersects``.

    >>> merge_sessions([Window(5, 9), Window(20, 25), Window(0, 5)])
    [(Window(start=0, end=9), [0, 2]), (Window(start=20, end=25), [1])]
    """
    order = sorted(range(len(windows)), key=lambda i: (windows[i].start, windows[i].end))
    merged: list[tuple[Window, list[int]]] = []
    for i in order:
        w = windows[i]
        if merged and w.start <= merged[-1][0].end:
            current, members = merged[-1]
            members.append(i)
            merged[-1] = (Window(current.start, max(current.end, w.end)), members)
        else:
            merged.append((w, [i]))
    return [(w, sorted(members)) for w, members in merged]
