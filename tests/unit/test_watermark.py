"""Unit tests of the per-origin watermark.

The reference recomputes the watermark directly from the recorded event log
(every ``observe`` call so far) and the values it has returned before, instead
of trusting the tracker's incremental state.
"""

from __future__ import annotations

import doctest
import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from stream_assets.windows import watermark as watermark_module
from stream_assets.windows.assigners import TumblingWindow, Window
from stream_assets.windows.time import Time
from stream_assets.windows.watermark import WatermarkTracker, window_closed

RNG_SEED = 987_654


def test_doctests() -> None:
    result = doctest.testmod(watermark_module)
    assert result.attempted > 0
    assert result.failed == 0


@dataclass
class ReferenceWatermark:
    """Recomputes the watermark from the whole log at every query."""

    lateness: int
    idle_timeout: int
    log: list[tuple[int, int, int]] = field(default_factory=list)  # (origin, event_time, now)
    returned: list[int] = field(default_factory=list)

    def observe(self, origin: int, event_time: int, now: int) -> None:
        self.log.append((origin, event_time, now))

    def watermark(self, now: int) -> int | None:
        origins = {o for o, _, _ in self.log}
        if not origins:
            return max(self.returned) if self.returned else None
        max_event = {o: max(e for oo, e, _ in self.log if oo == o) for o in origins}
        last_seen = {o: max(n for oo, _, n in self.log if oo == o) for o in origins}
        active = [max_event[o] for o in origins if now - last_seen[o] <= self.idle_timeout]
        computed = (min(active) if active else max(max_event.values())) - self.lateness
        value = max([computed, *self.returned])
        self.returned.append(value)
        return value


def test_nothing_observed() -> None:
    t = WatermarkTracker(allowed_lateness_ms=0, idle_timeout_ms=0)
    assert t.watermark(now=123) is None
    assert t.last_watermark is None
    assert not t.is_late(window_end=-(10**15), now=123)


def test_single_origin_subtracts_lateness() -> None:
    t = WatermarkTracker(allowed_lateness_ms=5_000, idle_timeout_ms=60_000)
    t.observe(origin=0, event_time=20_000, now=0)
    t.observe(origin=0, event_time=12_000, now=1)  # out of order: max stays
    assert t.watermark(now=2) == 15_000
    t.observe(origin=0, event_time=-100, now=3)
    assert t.watermark(now=3) == 15_000


def test_slow_origin_holds_watermark_until_idle() -> None:
    t = WatermarkTracker(allowed_lateness_ms=1_000, idle_timeout_ms=10_000)
    t.observe(origin=0, event_time=100_000, now=0)  # fast queue, far ahead
    t.observe(origin=1, event_time=20_000, now=0)  # slow queue
    assert t.watermark(now=0) == 19_000
    t.observe(origin=0, event_time=150_000, now=9_000)
    # Exactly at the timeout the slow origin still counts ...
    assert t.watermark(now=10_000) == 19_000
    # ... one ms later it is idle and drops out of the minimum.
    assert t.watermark(now=10_001) == 149_000


def test_fast_origin_does_not_make_slow_origin_late() -> None:
    """The DESIGN.md case: a plain max would call origin 1's record late."""
    windows = TumblingWindow.of(Time.seconds(10))
    t = WatermarkTracker(allowed_lateness_ms=0, idle_timeout_ms=60_000)
    t.observe(origin=0, event_time=95_000, now=0)
    t.observe(origin=1, event_time=11_000, now=0)
    (w,) = windows.assign(12_000)
    assert not t.is_late(w.end, now=1)
    assert not window_closed(w, t.watermark(now=1))
    # A window origin 1 has moved past has fired.
    (old,) = windows.assign(5_000)
    assert t.is_late(old.end, now=1)


def test_all_idle_uses_max() -> None:
    t = WatermarkTracker(allowed_lateness_ms=500, idle_timeout_ms=1_000)
    t.observe(origin=0, event_time=5_000, now=0)
    t.observe(origin=1, event_time=9_000, now=100)
    t.observe(origin=2, event_time=7_000, now=200)
    assert t.watermark(now=1_000) == 4_500
    assert t.watermark(now=1_200) == 6_500  # only origin 0 idle
    assert t.watermark(now=1_201) == 8_500  # all idle: max over all


def test_never_decreases() -> None:
    t = WatermarkTracker(allowed_lateness_ms=0, idle_timeout_ms=100)
    t.observe(origin=0, event_time=1_000, now=0)
    t.observe(origin=1, event_time=50_000, now=0)
    assert t.watermark(now=0) == 1_000
    assert t.watermark(now=101) == 50_000  # everything idle
    # Origin 0 wakes up with old event times: min over active is 1_001, floor wins.
    t.observe(origin=0, event_time=1_001, now=200)
    assert t.watermark(now=200) == 50_000
    assert t.last_watermark == 50_000
    assert t.is_late(window_end=2_000, now=200)
    # A brand-new origin far behind cannot pull it back either.
    t.observe(origin=7, event_time=-(10**9), now=201)
    assert t.watermark(now=201) == 50_000


def test_clock_step_back_keeps_origin_active() -> None:
    t = WatermarkTracker(allowed_lateness_ms=0, idle_timeout_ms=100)
    t.observe(origin=0, event_time=10, now=1_000)
    t.observe(origin=1, event_time=99, now=1_000)
    t.observe(origin=0, event_time=20, now=500)  # processing clock stepped back
    assert t.watermark(now=1_100) == 20  # origin 0 last seen at 1_000, not 500


def test_window_closed_boundaries() -> None:
    w = Window(-10_000, 0)
    assert not window_closed(w, None)
    assert not window_closed(w, -1)
    assert window_closed(w, 0)  # watermark reached the end: fired
    assert window_closed(w, 1)


def test_is_late_matches_window_closed() -> None:
    t = WatermarkTracker(allowed_lateness_ms=3, idle_timeout_ms=10)
    t.observe(origin=0, event_time=103, now=0)
    wm = t.watermark(now=0)
    assert wm == 100
    for end in range(90, 111):
        assert t.is_late(end, now=0) == window_closed(Window(end - 5, end), wm) == (end <= 100)


def test_random_log_matches_recomputation() -> None:
    rng = random.Random(RNG_SEED)
    for _ in range(200):
        lateness = rng.choice([0, 1, 50, 1_000])
        idle = rng.choice([0, 10, 100, 1_000])
        tracker = WatermarkTracker(allowed_lateness_ms=lateness, idle_timeout_ms=idle)
        reference = ReferenceWatermark(lateness, idle)
        now = rng.randint(-1_000, 1_000)
        origins = list(range(rng.randint(1, 6)))
        base = {o: rng.randint(-10_000, 10_000) for o in origins}
        previous: int | None = None
        for _ in range(rng.randint(1, 80)):
            # Mostly forward, with occasional pauses long enough to idle origins
            # and rare clock steps back.
            now += rng.choice([0, 1, 5, 20, rng.randint(0, 3 * idle + 5), -rng.randint(0, 50)])
            if rng.random() < 0.7:
                origin = rng.choice(origins[: rng.randint(1, len(origins))])
                base[origin] += rng.randint(-30, 60)
                event_time = base[origin] + rng.randint(-200, 20)
                tracker.observe(origin, event_time, now)
                reference.observe(origin, event_time, now)
            else:
                got = tracker.watermark(now)
                assert got == reference.watermark(now)
                if previous is not None:
                    assert got is not None and got >= previous
                previous = got
            if rng.random() < 0.1:
                tracker = WatermarkTracker.from_dict(json.loads(json.dumps(tracker.to_dict())))


def only_str_keys_and_ints(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and only_str_keys_and_ints(v) for k, v in value.items())
    return isinstance(value, int) and not isinstance(value, bool)


def test_round_trip_preserves_floor_and_origins() -> None:
    t = WatermarkTracker(allowed_lateness_ms=10, idle_timeout_ms=100)
    t.observe(origin=3, event_time=1_000, now=0)
    t.observe(origin=12, event_time=9_000, now=0)
    assert t.watermark(now=500) == 8_990  # all idle
    t.observe(origin=3, event_time=1_500, now=600)
    assert t.watermark(now=600) == 8_990  # floor, not the computed 1_490

    d = t.to_dict()
    assert only_str_keys_and_ints(d)
    assert d == {
        "version": 1,
        "allowed_lateness_ms": 10,
        "idle_timeout_ms": 100,
        "origins": {
            "3": {"max_event_time": 1_500, "last_seen": 600},
            "12": {"max_event_time": 9_000, "last_seen": 0},
        },
        "last_watermark": 8_990,
    }
    restored = WatermarkTracker.from_dict(json.loads(json.dumps(d)))
    assert restored.to_dict() == d
    assert (restored.allowed_lateness_ms, restored.idle_timeout_ms) == (10, 100)
    assert restored.last_watermark == 8_990
    assert restored.watermark(now=600) == 8_990
    # The restored origins keep working: origin 3 alone is active and ahead later.
    restored.observe(origin=3, event_time=20_000, now=700)
    assert restored.watermark(now=700) == 19_990


def test_round_trip_of_empty_tracker() -> None:
    d = WatermarkTracker(allowed_lateness_ms=0, idle_timeout_ms=5).to_dict()
    assert "last_watermark" not in d
    assert only_str_keys_and_ints(d)
    restored = WatermarkTracker.from_dict(d)
    assert restored.watermark(now=0) is None
    assert restored.to_dict() == d


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "unsupported version 2"),
        ({"allowed_lateness_ms": "10"}, "allowed_lateness_ms must be an int, got '10'"),
        ({"idle_timeout_ms": True}, "idle_timeout_ms must be an int, got True"),
        ({"origins": [1, 2]}, r"origins must be a mapping, got \[1, 2\]"),
        ({"origins": {"x": {"max_event_time": 1, "last_seen": 1}}}, "bad origin id 'x'"),
        ({"origins": {"1": 5}}, "origin '1' must be a mapping"),
        ({"origins": {"1": {"max_event_time": 1}}}, "origin 1 last_seen must be an int, got None"),
        ({"last_watermark": None}, "last_watermark must be an int, got None"),
    ],
)
def test_from_dict_rejects_malformed_state(change: dict[str, Any], message: str) -> None:
    d = WatermarkTracker(allowed_lateness_ms=10, idle_timeout_ms=100).to_dict() | change
    with pytest.raises(ValueError, match=message):
        WatermarkTracker.from_dict(d)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"allowed_lateness_ms": -1, "idle_timeout_ms": 0},
            ValueError,
            "allowed_lateness_ms must be >= 0 ms, got -1 ms",
        ),
        (
            {"allowed_lateness_ms": 0, "idle_timeout_ms": -5},
            ValueError,
            "idle_timeout_ms must be >= 0 ms, got -5 ms",
        ),
        (
            {"allowed_lateness_ms": 1.5, "idle_timeout_ms": 0},
            TypeError,
            "allowed_lateness_ms must be an int of ms, got 1.5",
        ),
    ],
)
def test_constructor_validation(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        WatermarkTracker(**kwargs)


def test_expected_origin_holds_the_watermark_until_it_speaks_or_idles() -> None:
    t = WatermarkTracker(allowed_lateness_ms=1_000, idle_timeout_ms=5_000)
    t.expect(origin=1, now=0)
    t.observe(origin=0, event_time=50_000, now=0)
    # Queue 1 has not sent anything: the fast queue 0 alone must not move it.
    assert t.watermark(now=1_000) is None
    t.observe(origin=1, event_time=20_000, now=2_000)
    assert t.watermark(now=2_000) == 19_000
    restored = WatermarkTracker.from_dict(t.to_dict())
    assert restored.watermark(now=2_000) == 19_000


def test_expected_origin_that_stays_silent_drops_out_after_the_idle_timeout() -> None:
    t = WatermarkTracker(allowed_lateness_ms=0, idle_timeout_ms=5_000)
    t.expect(origin=1, now=0)
    t.observe(origin=0, event_time=30_000, now=4_000)
    assert t.watermark(now=5_000) is None
    assert t.watermark(now=5_001) == 30_000
    assert WatermarkTracker.from_dict(t.to_dict()).to_dict() == t.to_dict()
