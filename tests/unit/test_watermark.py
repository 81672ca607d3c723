"""Unit tests of the per-origin watermark.

The reference recomputes the watermark directly from the whole recorded log
(every ``expect`` and ``observe`` call so far) plus the idle set given at the
query, and from the values it has returned before, instead of trusting the
tracker's incremental state. Idleness is an input (judged by the caller from
broker offsets): nothing else, processing time included, may change a result.
"""

from __future__ import annotations

import doctest
import json
import random
import time
from collections.abc import Collection
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
    """Recomputes the watermark from the whole log and the idle set at every query."""

    lateness: int
    expected: set[int] = field(default_factory=set)
    log: list[tuple[int, int]] = field(default_factory=list)  # (origin, event_time)
    returned: list[int] = field(default_factory=list)

    def expect(self, origin: int) -> None:
        self.expected.add(origin)

    def observe(self, origin: int, event_time: int) -> None:
        self.log.append((origin, event_time))

    def floor(self) -> int | None:
        return max(self.returned) if self.returned else None

    def watermark(self, idle: Collection[int]) -> int | None:
        observed = {o for o, _ in self.log}
        if not observed:
            return self.floor()
        max_event = {o: max(e for oo, e in self.log if oo == o) for o in observed}
        non_idle = (observed | self.expected) - set(idle)
        if non_idle - observed:
            return self.floor()  # an expected origin that is not idle has not spoken yet
        # Minimum over the origins not idle; with every origin idle, the maximum.
        candidates = [max_event[o] for o in non_idle] or [max(max_event.values())]
        event_time = min(candidates)
        value = max([event_time - self.lateness, *self.returned])
        self.returned.append(value)
        return value


def test_nothing_observed() -> None:
    t = WatermarkTracker(allowed_lateness_ms=0)
    assert t.watermark() is None
    assert t.watermark(idle={0, 1}) is None
    assert t.last_watermark is None
    assert t.origins() == ()
    assert t.max_event_time(0) is None
    assert not t.is_late(window_end=-(10**15))


def test_single_origin_subtracts_lateness() -> None:
    t = WatermarkTracker(allowed_lateness_ms=5_000)
    t.observe(origin=0, event_time=20_000)
    t.observe(origin=0, event_time=12_000)  # out of order: max stays
    assert t.max_event_time(0) == 20_000
    assert t.watermark() == 20_000 - 5_000
    t.observe(origin=0, event_time=-100)
    assert t.watermark() == 20_000 - 5_000


def test_slow_origin_holds_watermark_until_the_caller_says_it_is_idle() -> None:
    t = WatermarkTracker(allowed_lateness_ms=1_000)
    t.observe(origin=0, event_time=100_000)  # fast queue, far ahead
    t.observe(origin=1, event_time=20_000)  # slow queue
    assert t.watermark() == 20_000 - 1_000
    t.observe(origin=0, event_time=150_000)
    # However long the caller waits, only the idle set drops origin 1.
    assert t.watermark() == 20_000 - 1_000
    assert t.watermark(idle={0}) == 20_000 - 1_000  # the fast one idle changes nothing
    assert t.watermark(idle={1}) == 150_000 - 1_000
    # Idle origins that are not known to the tracker are harmless.
    assert t.watermark(idle={1, 42}) == 150_000 - 1_000


def test_fast_origin_does_not_make_slow_origin_late() -> None:
    """The DESIGN.md case: a plain max would call origin 1's record late."""
    windows = TumblingWindow.of(Time.seconds(10))
    t = WatermarkTracker(allowed_lateness_ms=0)
    t.observe(origin=0, event_time=95_000)
    t.observe(origin=1, event_time=11_000)
    (w,) = windows.assign(12_000)
    assert not t.is_late(w.end)
    assert not window_closed(w, t.watermark())
    # A window origin 1 has moved past has fired.
    (old,) = windows.assign(5_000)
    assert t.is_late(old.end)


def test_all_idle_uses_max() -> None:
    t = WatermarkTracker(allowed_lateness_ms=500)
    t.observe(origin=0, event_time=5_000)
    t.observe(origin=1, event_time=9_000)
    t.observe(origin=2, event_time=7_000)
    assert t.watermark() == 5_000 - 500
    assert t.watermark(idle={0}) == 7_000 - 500  # only origin 0 idle
    assert t.watermark(idle={0, 1, 2}) == 9_000 - 500  # all idle: max over all


def test_never_decreases() -> None:
    t = WatermarkTracker(allowed_lateness_ms=0)
    t.observe(origin=0, event_time=1_000)
    t.observe(origin=1, event_time=50_000)
    assert t.watermark() == 1_000
    assert t.watermark(idle={0, 1}) == 50_000  # everything idle
    # Origin 0 is no longer idle, with old event times: the floor wins.
    t.observe(origin=0, event_time=1_001)
    assert t.watermark() == 50_000
    assert t.last_watermark == 50_000
    assert t.is_late(window_end=2_000)
    # A brand-new origin far behind cannot pull it back either.
    t.observe(origin=7, event_time=-(10**9))
    assert t.watermark() == 50_000


def test_is_late_passes_the_idle_set_on() -> None:
    t = WatermarkTracker(allowed_lateness_ms=0)
    t.observe(origin=0, event_time=100)
    t.observe(origin=1, event_time=10)
    assert not t.is_late(window_end=50)
    assert t.is_late(window_end=50, idle=[1])
    # And that query raised the floor for good.
    assert t.is_late(window_end=50)
    assert t.last_watermark == 100


def test_window_closed_boundaries() -> None:
    w = Window(-10_000, 0)
    assert not window_closed(w, None)
    assert not window_closed(w, -1)
    assert window_closed(w, 0)  # watermark reached the end: fired
    assert window_closed(w, 1)


def test_is_late_matches_window_closed() -> None:
    t = WatermarkTracker(allowed_lateness_ms=3)
    t.observe(origin=0, event_time=103)
    wm = t.watermark()
    assert wm == 103 - 3
    for end in range(90, 111):
        assert t.is_late(end) == window_closed(Window(end - 5, end), wm) == (end <= 100)


def test_expected_origin_holds_the_watermark_until_it_speaks_or_is_idle() -> None:
    t = WatermarkTracker(allowed_lateness_ms=1_000)
    t.expect(origin=1)
    t.observe(origin=0, event_time=50_000)
    assert t.origins() == (0, 1)
    assert t.max_event_time(1) is None
    # Queue 1 has not sent anything: the fast queue 0 alone must not move it.
    assert t.watermark() is None
    # Once the caller finds queue 1 idle, queue 0 alone decides.
    assert t.watermark(idle={1}) == 50_000 - 1_000
    t.observe(origin=1, event_time=20_000)
    assert t.watermark() == 50_000 - 1_000  # floor: the computed 19_000 is lower
    restored = WatermarkTracker.from_dict(t.to_dict())
    assert restored.watermark() == 50_000 - 1_000


def test_expected_silent_origin_keeps_the_previous_floor() -> None:
    t = WatermarkTracker(allowed_lateness_ms=0)
    t.observe(origin=0, event_time=30_000)
    assert t.watermark() == 30_000
    t.expect(origin=5)  # a queue added later
    t.observe(origin=0, event_time=90_000)
    assert t.watermark() == 30_000  # held at the previous floor, not reset to None
    assert t.watermark(idle={5}) == 90_000
    # Expecting an origin that already spoke changes nothing.
    t.expect(origin=0)
    assert t.max_event_time(0) == 90_000


def test_every_origin_idle_and_one_expected_silent_uses_max_of_the_seen() -> None:
    t = WatermarkTracker(allowed_lateness_ms=10)
    t.expect(origin=2)
    t.observe(origin=0, event_time=400)
    t.observe(origin=1, event_time=700)
    assert t.watermark(idle={0, 1}) is None  # origin 2 is neither idle nor heard from
    assert t.watermark(idle={0, 1, 2}) == 700 - 10


def test_random_log_matches_recomputation() -> None:
    rng = random.Random(RNG_SEED)
    queries = 0
    for _ in range(300):
        lateness = rng.choice([0, 1, 50, 1_000])
        tracker = WatermarkTracker(allowed_lateness_ms=lateness)
        reference = ReferenceWatermark(lateness)
        origins = list(range(rng.randint(1, 6)))
        base = {o: rng.randint(-10_000, 10_000) for o in origins}
        previous: int | None = None
        for _ in range(rng.randint(1, 80)):
            roll = rng.random()
            if roll < 0.05:
                origin = rng.randrange(len(origins) + 2)  # sometimes one never observed
                tracker.expect(origin)
                reference.expect(origin)
            elif roll < 0.7:
                origin = rng.choice(origins[: rng.randint(1, len(origins))])
                base[origin] += rng.randint(-30, 60)
                event_time = base[origin] + rng.randint(-200, 20)
                tracker.observe(origin, event_time)
                reference.observe(origin, event_time)
            else:
                idle = {o for o in range(len(origins) + 3) if rng.random() < 0.3}
                if rng.random() < 0.5:
                    got = tracker.watermark(idle)
                else:
                    end = rng.randint(-12_000, 12_000)
                    late = tracker.is_late(end, idle=sorted(idle))
                    got = tracker.last_watermark
                    assert late == (got is not None and end <= got)
                assert got == reference.watermark(idle)
                queries += 1
                if previous is not None:
                    assert got is not None and got >= previous
                previous = got
            assert tracker.origins() == tuple(
                sorted({o for o, _ in reference.log} | reference.expected)
            )
            if rng.random() < 0.1:
                tracker = WatermarkTracker.from_dict(json.loads(json.dumps(tracker.to_dict())))
    assert queries > 1_000


def test_results_depend_only_on_observations_and_idle_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same log, same idle sets: same watermarks, whatever the clock does.

    The log is replayed on three trackers: one with every clock function
    broken, one with the observations between two queries reordered, one
    persisted and reloaded before every query. All must agree with the plain
    run.
    """
    rng = random.Random(RNG_SEED + 1)
    steps: list[tuple[str, Any]] = []
    for _ in range(400):
        if rng.random() < 0.7:
            steps.append(("observe", (rng.randrange(5), rng.randint(-5_000, 5_000))))
        elif rng.random() < 0.05:
            steps.append(("expect", rng.randrange(7)))
        else:
            steps.append(("query", frozenset(o for o in range(7) if rng.random() < 0.4)))

    def run(tracker: WatermarkTracker, ops: list[tuple[str, Any]], reload: bool) -> list[Any]:
        out: list[Any] = []
        for kind, arg in ops:
            if kind == "observe":
                tracker.observe(*arg)
            elif kind == "expect":
                tracker.expect(arg)
            else:
                if reload:
                    tracker = WatermarkTracker.from_dict(json.loads(json.dumps(tracker.to_dict())))
                out.append(tracker.watermark(idle=arg))
        return out

    def shuffled_between_queries(ops: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        result: list[tuple[str, Any]] = []
        run_of_updates: list[tuple[str, Any]] = []
        for op in ops:
            if op[0] == "query":
                rng.shuffle(run_of_updates)
                result += [*run_of_updates, op]
                run_of_updates = []
            else:
                run_of_updates.append(op)
        return result + run_of_updates

    plain = run(WatermarkTracker(allowed_lateness_ms=25), steps, reload=False)
    reordered = run(
        WatermarkTracker(allowed_lateness_ms=25), shuffled_between_queries(steps), False
    )
    reloaded = run(WatermarkTracker(allowed_lateness_ms=25), steps, reload=True)

    def no_clock(*_args: object) -> float:
        raise AssertionError("the watermark must not read processing time")

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, no_clock)
    clockless = run(WatermarkTracker(allowed_lateness_ms=25), steps, reload=True)
    monkeypatch.undo()

    reference = ReferenceWatermark(25)
    expected: list[int | None] = []
    for kind, arg in steps:
        if kind == "observe":
            reference.observe(*arg)
        elif kind == "expect":
            reference.expect(arg)
        else:
            expected.append(reference.watermark(arg))
    assert plain == reordered == reloaded == clockless == expected
    assert any(v is not None for v in expected)


def only_str_keys_and_ints(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and only_str_keys_and_ints(v) for k, v in value.items())
    return isinstance(value, int) and not isinstance(value, bool)


def test_round_trip_preserves_floor_and_origins() -> None:
    t = WatermarkTracker(allowed_lateness_ms=10)
    t.expect(origin=5)
    t.observe(origin=3, event_time=1_000)
    t.observe(origin=12, event_time=9_000)
    assert t.watermark(idle={3, 5, 12}) == 9_000 - 10  # all idle
    t.observe(origin=3, event_time=1_500)
    assert t.watermark(idle={5}) == 9_000 - 10  # floor, not the computed 1_490

    d = t.to_dict()
    assert only_str_keys_and_ints(d)
    assert d == {
        "version": 2,
        "allowed_lateness_ms": 10,
        "origins": {
            "3": {"max_event_time": 1_500},
            "5": {},
            "12": {"max_event_time": 9_000},
        },
        "last_watermark": 9_000 - 10,
    }
    restored = WatermarkTracker.from_dict(json.loads(json.dumps(d)))
    assert restored.to_dict() == d
    assert restored.allowed_lateness_ms == 10
    assert restored.last_watermark == 9_000 - 10
    assert restored.origins() == (3, 5, 12)
    assert [restored.max_event_time(o) for o in (3, 5, 12)] == [1_500, None, 9_000]
    # Origin 5 is still expected and silent: the restored floor holds.
    assert restored.watermark() == 9_000 - 10
    # The restored origins keep working: origin 3 alone is not idle, and ahead later.
    restored.observe(origin=3, event_time=20_000)
    assert restored.watermark(idle={5, 12}) == 20_000 - 10


def test_round_trip_of_empty_tracker() -> None:
    d = WatermarkTracker(allowed_lateness_ms=0).to_dict()
    assert "last_watermark" not in d
    assert only_str_keys_and_ints(d)
    restored = WatermarkTracker.from_dict(d)
    assert restored.watermark() is None
    assert restored.to_dict() == d


def test_version_1_state_loads_and_its_idle_data_is_ignored() -> None:
    v1 = {
        "version": 1,
        "allowed_lateness_ms": 10,
        "idle_timeout_ms": 100,
        "origins": {
            "3": {"max_event_time": 1_500, "last_seen": 600},
            "7": {"last_seen": 0},  # expected, never spoke
            "12": {"max_event_time": 9_000, "last_seen": 0},
        },
        "last_watermark": 8_990,
    }
    t = WatermarkTracker.from_dict(json.loads(json.dumps(v1)))
    assert t.allowed_lateness_ms == 10
    assert t.last_watermark == 8_990
    assert t.origins() == (3, 7, 12)
    assert [t.max_event_time(o) for o in (3, 7, 12)] == [1_500, None, 9_000]
    # Written back as version 2, without the processing-time fields.
    assert t.to_dict() == {
        "version": 2,
        "allowed_lateness_ms": 10,
        "origins": {"3": {"max_event_time": 1_500}, "7": {}, "12": {"max_event_time": 9_000}},
        "last_watermark": 8_990,
    }
    # last_seen decides nothing: origin 12 "silent since 0" is not idle unless the caller says.
    assert t.watermark(idle={7}) == 8_990  # min is 1_490: the floor holds
    t.observe(origin=3, event_time=30_000)
    assert t.watermark(idle={7}) == 9_000 - 10
    assert t.watermark(idle={7, 12}) == 30_000 - 10


def test_version_1_state_without_last_seen_or_floor_loads() -> None:
    t = WatermarkTracker.from_dict(
        {"version": 1, "allowed_lateness_ms": 0, "origins": {"1": {"max_event_time": 4}}}
    )
    assert t.last_watermark is None
    assert t.watermark() == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 3}, "unsupported version 3"),
        ({"version": 0}, "unsupported version 0"),
        ({"version": "2"}, "unsupported version '2'"),
        ({"version": None}, "unsupported version None"),
        ({"allowed_lateness_ms": "10"}, "allowed_lateness_ms must be an int, got '10'"),
        ({"allowed_lateness_ms": True}, "allowed_lateness_ms must be an int, got True"),
        ({"allowed_lateness_ms": None}, "allowed_lateness_ms must be an int, got None"),
        ({"origins": [1, 2]}, r"origins must be a mapping, got \[1, 2\]"),
        ({"origins": None}, "origins must be a mapping, got None"),
        ({"origins": {"x": {"max_event_time": 1}}}, "bad origin id 'x'"),
        ({"origins": {"1": 5}}, "origin '1' must be a mapping"),
        (
            {"origins": {"1": {"max_event_time": 1.5}}},
            "origin 1 max_event_time must be an int, got 1.5",
        ),
        (
            {"origins": {"1": {"max_event_time": None}}},
            "origin 1 max_event_time must be an int, got None",
        ),
        ({"last_watermark": None}, "last_watermark must be an int, got None"),
        ({"last_watermark": False}, "last_watermark must be an int, got False"),
    ],
)
def test_from_dict_rejects_malformed_state(change: dict[str, Any], message: str) -> None:
    d = WatermarkTracker(allowed_lateness_ms=10).to_dict() | change
    with pytest.raises(ValueError, match=message):
        WatermarkTracker.from_dict(d)


def test_from_dict_rejects_a_negative_lateness() -> None:
    d = WatermarkTracker(allowed_lateness_ms=10).to_dict() | {"allowed_lateness_ms": -1}
    with pytest.raises(ValueError, match="allowed_lateness_ms must be >= 0 ms, got -1 ms"):
        WatermarkTracker.from_dict(d)


def test_from_dict_rejects_a_missing_version() -> None:
    d = WatermarkTracker(allowed_lateness_ms=10).to_dict()
    del d["version"]
    with pytest.raises(ValueError, match="unsupported version None"):
        WatermarkTracker.from_dict(d)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"allowed_lateness_ms": -1}, ValueError, "allowed_lateness_ms must be >= 0 ms, got -1 ms"),
        (
            {"allowed_lateness_ms": 1.5},
            TypeError,
            "allowed_lateness_ms must be an int of ms, got 1.5",
        ),
        (
            {"allowed_lateness_ms": True},
            TypeError,
            "allowed_lateness_ms must be an int of ms, got True",
        ),
        (
            {"allowed_lateness_ms": "5"},
            TypeError,
            "allowed_lateness_ms must be an int of ms, got '5'",
        ),
        # The processing-time idle timeout is gone: idleness is the caller's.
        ({"allowed_lateness_ms": 0, "idle_timeout_ms": 5}, TypeError, "idle_timeout_ms"),
    ],
)
def test_constructor_validation(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        WatermarkTracker(**kwargs)


def test_processing_time_arguments_are_gone() -> None:
    t = WatermarkTracker(allowed_lateness_ms=0)
    with pytest.raises(TypeError):
        t.observe(0, 10, 123)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        t.expect(0, now=0)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        t.watermark(now=0)  # type: ignore[call-arg]
