"""Unit tests of ``Time``, ``Window`` and the window specs.

References are computed here without the code under test: window membership
by enumerating every candidate window over a range and checking
``start <= ts < end``, large timestamps through exact ``Fraction`` floors, and
session merging through a union-find over pairwise overlap/touch written in
this file.
"""

from __future__ import annotations

import dataclasses
import doctest
import itertools
import json
import math
import random
from fractions import Fraction
from typing import Any

import pytest

from stream_assets.windows import assigners
from stream_assets.windows import time as time_module
from stream_assets.windows.assigners import (
    SessionWindow,
    SlidingWindow,
    TumblingWindow,
    Window,
    WindowSpec,
    merge_sessions,
    window_spec_from_dict,
)
from stream_assets.windows.time import Time

RNG_SEED = 20240611


@pytest.mark.parametrize("module", [time_module, assigners])
def test_doctests(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0


# --- Time -------------------------------------------------------------------


def test_time_units() -> None:
    assert Time.milliseconds(7).ms == 7
    assert Time.seconds(3).ms == 3_000
    assert Time.minutes(2).ms == 120_000
    assert Time.hours(1).ms == 3_600_000
    assert Time.seconds(60) == Time.minutes(1)
    assert Time.seconds(1) < Time.seconds(2)


@pytest.mark.parametrize("make", [Time.milliseconds, Time.seconds, Time.minutes, Time.hours])
def test_time_zero_allowed(make: Any) -> None:
    assert make(0).ms == 0


@pytest.mark.parametrize(
    ("make", "unit"),
    [
        (Time.milliseconds, "milliseconds"),
        (Time.seconds, "seconds"),
        (Time.minutes, "minutes"),
        (Time.hours, "hours"),
    ],
)
def test_time_negative_rejected(make: Any, unit: str) -> None:
    with pytest.raises(ValueError, match=rf"Time\.{unit}\(\) needs a non-negative amount, got -1"):
        make(-1)


@pytest.mark.parametrize("bad", [1.5, "3", True, None])
def test_time_non_int_rejected(bad: Any) -> None:
    with pytest.raises(TypeError, match="needs an int"):
        Time.seconds(bad)


def test_time_direct_construction_validated_and_frozen() -> None:
    with pytest.raises(ValueError, match="got -5"):
        Time(-5)
    t = Time(5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.ms = 6  # type: ignore[misc]


# --- Window -----------------------------------------------------------------


def test_window_half_open() -> None:
    w = Window(-10, 10)
    assert w.max_timestamp == 9
    assert w.contains(-10)
    assert w.contains(9)
    assert not w.contains(10)
    assert not w.contains(-11)


@pytest.mark.parametrize(("start", "end"), [(5, 5), (5, 4)])
def test_window_empty_rejected(start: int, end: int) -> None:
    with pytest.raises(ValueError, match=rf"Window end must be > start, got \[{start}, {end}\)"):
        Window(start, end)


def test_window_non_int_rejected() -> None:
    with pytest.raises(TypeError, match="must be ints"):
        Window(0, 1.5)  # type: ignore[arg-type]


# --- Tumbling ---------------------------------------------------------------


def brute_force_windows(ts: int, size: int, step: int, lo: int, hi: int) -> list[Window]:
    """Every window [k*step, k*step+size) for k in [lo, hi) that holds ts."""
    candidates = [(k * step, k * step + size) for k in range(lo, hi)]
    return [Window(s, e) for s, e in candidates if s <= ts < e]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 10, 1000])
def test_tumbling_matches_brute_force_around_zero(size: int) -> None:
    spec = TumblingWindow.of(Time.milliseconds(size))
    for ts in range(-4 * size - 3, 4 * size + 3):
        expected = brute_force_windows(ts, size, size, -10, 10)
        assert len(expected) == 1
        assert spec.assign(ts) == expected, ts


def test_tumbling_random_large_timestamps() -> None:
    rng = random.Random(RNG_SEED)
    for _ in range(2000):
        size = rng.choice([1, 3, 1000, 10_000, 60_000, rng.randint(1, 10**7)])
        ts = rng.randint(-(10**13), 10**13)
        start = math.floor(Fraction(ts, size)) * size
        assert TumblingWindow(size).assign(ts) == [Window(start, start + size)]


def test_tumbling_boundaries() -> None:
    spec = TumblingWindow.of(Time.seconds(10))
    assert spec.assign(0) == [Window(0, 10_000)]
    assert spec.assign(9_999) == [Window(0, 10_000)]
    assert spec.assign(10_000) == [Window(10_000, 20_000)]  # ts == end is excluded
    assert spec.assign(-1) == [Window(-10_000, 0)]
    assert spec.assign(-10_000) == [Window(-10_000, 0)]
    assert spec.assign(-10_001) == [Window(-20_000, -10_000)]


# --- Sliding ----------------------------------------------------------------


SLIDING_CASES = [(10, 5), (10, 3), (7, 7), (5, 1), (10, 4), (9, 2), (1, 1), (100, 33)]


@pytest.mark.parametrize(("size", "slide"), SLIDING_CASES)
def test_sliding_matches_brute_force_around_zero(size: int, slide: int) -> None:
    spec = SlidingWindow.of(Time.milliseconds(size), Time.milliseconds(slide))
    span = 3 * size + 5
    k_range = span // slide + size // slide + 5
    for ts in range(-span, span):
        expected = brute_force_windows(ts, size, slide, -k_range, k_range)
        assert spec.assign(ts) == expected, ts


def test_sliding_random_large_timestamps() -> None:
    rng = random.Random(RNG_SEED + 1)
    for _ in range(2000):
        slide = rng.randint(1, 50_000)
        size = slide * rng.randint(1, 6) + rng.choice([0, 0, rng.randint(0, slide - 1)])
        ts = rng.randint(-(10**13), 10**13)
        first_k = math.ceil(Fraction(ts - size + 1, slide))
        last_k = math.floor(Fraction(ts, slide))
        expected = [Window(k * slide, k * slide + size) for k in range(first_k, last_k + 1)]
        got = SlidingWindow(size, slide).assign(ts)
        assert got == expected
        assert all(w.contains(ts) for w in got)
        if size % slide == 0:
            assert len(got) == size // slide


def test_sliding_boundaries() -> None:
    spec = SlidingWindow.of(Time.seconds(10), Time.seconds(5))
    assert spec.assign(5_000) == [Window(0, 10_000), Window(5_000, 15_000)]
    assert spec.assign(4_999) == [Window(-5_000, 5_000), Window(0, 10_000)]
    assert spec.assign(-1) == [Window(-10_000, 0), Window(-5_000, 5_000)]


# --- Session ----------------------------------------------------------------


def test_session_assign() -> None:
    spec = SessionWindow.with_gap(Time.seconds(30))
    assert spec.assign(1_000) == [Window(1_000, 31_000)]
    assert spec.assign(-5) == [Window(-5, 29_995)]


def reference_merge(windows: list[Window]) -> list[tuple[Window, list[int]]]:
    """Union-find over every pair that overlaps or touches (closed intervals meet)."""
    parent = list(range(len(windows)))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, a in enumerate(windows):
        for j, b in enumerate(windows):
            if a.start <= b.end and b.start <= a.end:
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(windows)):
        groups.setdefault(find(i), []).append(i)
    result = [
        (Window(min(windows[i].start for i in g), max(windows[i].end for i in g)), sorted(g))
        for g in groups.values()
    ]
    return sorted(result, key=lambda r: r[0].start)


def test_merge_sessions_matches_union_find() -> None:
    rng = random.Random(RNG_SEED + 2)
    for _ in range(500):
        n = rng.randint(0, 25)
        gap = rng.randint(1, 20)
        spread = rng.choice([10, 100, 1000])
        windows = [SessionWindow(gap).assign(rng.randint(-spread, spread))[0] for _ in range(n)]
        # Mix in some longer, already-merged sessions like the ones held in state.
        windows += [
            Window(s, s + rng.randint(1, 3 * gap))
            for s in (rng.randint(-spread, spread) for _ in range(rng.randint(0, 4)))
        ]
        rng.shuffle(windows)
        got = merge_sessions(windows)
        assert got == reference_merge(windows)
        assert sorted(i for _, members in got for i in members) == list(range(len(windows)))
        for (a, _), (b, _) in itertools.pairwise(got):
            assert a.end < b.start  # merged sessions neither overlap nor touch


def test_merge_sessions_touching_and_gaps() -> None:
    assert merge_sessions([]) == []
    assert merge_sessions([Window(5, 10), Window(0, 5)]) == [(Window(0, 10), [0, 1])]
    assert merge_sessions([Window(0, 5), Window(6, 10)]) == [
        (Window(0, 5), [0]),
        (Window(6, 10), [1]),
    ]
    # A window inside another must not shrink the merged end.
    assert merge_sessions([Window(0, 100), Window(10, 20), Window(100, 101)]) == [
        (Window(0, 101), [0, 1, 2])
    ]
    assert merge_sessions([Window(3, 4), Window(3, 4)]) == [(Window(3, 4), [0, 1])]


# --- kind, is_merging, serialization -----------------------------------------


SPECS: list[WindowSpec] = [
    TumblingWindow.of(Time.seconds(10)),
    SlidingWindow.of(Time.minutes(1), Time.seconds(7)),
    SessionWindow.with_gap(Time.milliseconds(1)),
]


def test_kind_and_is_merging() -> None:
    assert [(s.kind, s.is_merging) for s in SPECS] == [
        ("tumbling", False),
        ("sliding", False),
        ("session", True),
    ]


def test_to_dict_shapes() -> None:
    assert [s.to_dict() for s in SPECS] == [
        {"kind": "tumbling", "size_ms": 10_000},
        {"kind": "sliding", "size_ms": 60_000, "slide_ms": 7_000},
        {"kind": "session", "gap_ms": 1},
    ]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_round_trip_through_json(spec: Any) -> None:
    d = json.loads(json.dumps(spec.to_dict()))
    assert window_spec_from_dict(d) == spec
    assert type(spec).from_dict(d) == spec


def test_from_dict_errors() -> None:
    with pytest.raises(ValueError, match="unknown window kind 'hopping'"):
        window_spec_from_dict({"kind": "hopping", "size_ms": 1})
    with pytest.raises(ValueError, match="unknown window kind None"):
        window_spec_from_dict({"size_ms": 1})
    with pytest.raises(ValueError, match="expected a 'tumbling' window spec, got kind 'session'"):
        TumblingWindow.from_dict({"kind": "session", "gap_ms": 1})
    with pytest.raises(ValueError, match="sliding window spec needs an int 'slide_ms', got None"):
        window_spec_from_dict({"kind": "sliding", "size_ms": 10})
    with pytest.raises(ValueError, match="needs an int 'gap_ms', got True"):
        window_spec_from_dict({"kind": "session", "gap_ms": True})
    with pytest.raises(ValueError, match="TumblingWindow size must be > 0 ms, got 0 ms"):
        window_spec_from_dict({"kind": "tumbling", "size_ms": 0})


# --- validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: TumblingWindow.of(Time.seconds(0)),
            "TumblingWindow size must be > 0 ms, got 0 ms",
        ),
        (lambda: TumblingWindow(-3), "TumblingWindow size must be > 0 ms, got -3 ms"),
        (
            lambda: SlidingWindow.of(Time.seconds(0), Time.seconds(1)),
            "SlidingWindow size must be > 0 ms, got 0 ms",
        ),
        (
            lambda: SlidingWindow.of(Time.seconds(10), Time.seconds(0)),
            "SlidingWindow slide must be > 0 ms, got 0 ms",
        ),
        (
            lambda: SlidingWindow.of(Time.seconds(10), Time.seconds(20)),
            r"SlidingWindow slide must be <= size \(10000 ms\), got 20000 ms",
        ),
        (
            lambda: SessionWindow.with_gap(Time.seconds(0)),
            "SessionWindow gap must be > 0 ms, got 0 ms",
        ),
    ],
)
def test_validation_messages(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_of_requires_time() -> None:
    with pytest.raises(TypeError, match="TumblingWindow size must be a Time, got 10"):
        TumblingWindow.of(10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SlidingWindow size must be an int of ms"):
        SlidingWindow(1.5, 1)  # type: ignore[arg-type]
