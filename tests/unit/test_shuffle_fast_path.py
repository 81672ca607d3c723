"""Stage 0's fast path for counting aggregates gives what the general path gives.

``ShuffleOut`` folds an aggregate that only counts into plain counts, with
no undo log, and unpacks a combined batch's records only for the shuffle
queues whose batch goes per record. Forcing the general path
(``_counter_of`` answering None: every element through ``Composite.add``
with its undo log) must give the same shuffle messages byte for byte, the
same outputs, dead letters and late verdicts, for any batch split, with
pre-combining on or off; and both must match counts computed here from the
input alone.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.runtime.core.stage0 import shuffle_out
from stream_assets.serde import text_deserializer
from stream_assets.testing import TopologyTestDriver
from stream_assets.windows import SlidingWindow, Time, TumblingWindow

VOCAB = [f"w{i}" for i in range(40)]
POISON = "boom"  # the key function refuses it: its whole line is a dead letter
MAX_MESSAGE = 4096
HUGE = "h" * 2100  # key and value over any shuffle message: its line is a dead letter
LATENESS_MS = 500
WINDOW_MS = 1000


def _key(word: str) -> str:
    if word == POISON:
        raise ValueError("poison word")
    return word


def _topology(window: Any = None, *, two_counts: bool = False) -> Topology:
    b = StreamBuilder("fast")
    grouped = b.source("in", text_deserializer).flat_map(str.split).key_by(_key)
    if window is not None:
        grouped = grouped.window(window)
    agg = grouped.count("n")
    if two_counts:
        agg = agg.count("m")
    if window is not None:
        agg = agg.water_mark(LATENESS_MS / 1000)
    agg.to_rstream().sink("out")
    return b.build()


def _lines(rnd: random.Random, count: int, *, poison: bool) -> list[str]:
    """Lines of 0..6 words; some of one word; with ``poison``, a few bad lines where
    the bad word is neither first nor last when the line has room."""
    lines = []
    for _ in range(count):
        words = [rnd.choice(VOCAB) for _ in range(rnd.choice([0, 1, 1, 2, 3, 6]))]
        if poison and rnd.random() < 0.08:
            words.insert(len(words) // 2, rnd.choice([POISON, HUGE]))
        lines.append(" ".join(words) or " ")  # a body may not be empty
    return lines


def _run(
    topology: Topology,
    lines: list[str],
    times: list[int],
    *,
    pre_combine: bool,
    batch: int | None,
    fast: bool,
    mp: pytest.MonkeyPatch,
) -> dict[str, Any]:
    with mp.context() as m:
        if not fast:
            m.setattr(shuffle_out, "_counter_of", lambda acc: None)
        with TopologyTestDriver(
            topology,
            source_queues=2,
            shuffle_queues=3,
            pre_combine=pre_combine,
            max_records_per_batch=batch,
            max_message_size=MAX_MESSAGE,
        ) as driver:
            for i, (line, ts) in enumerate(zip(lines, times, strict=True)):
                driver.pipe(line, event_time=ts, queue=i % 2)
            driver.advance()
            driver.advance_idle()
            shuffle_topic = topology.stages[1].input_topic
            return {
                "shuffle": [(r.queue_id, r.body) for r in driver.output_records(shuffle_topic)],
                "outputs": driver.outputs(),
                "dead": sorted(
                    (body[:200], props["operator"], props["reason"])
                    for body, props in driver.dead_letters()
                ),
            }


def _final(outputs: list[dict[str, Any]]) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """The last result per key (and window)."""
    last = {}
    for out in outputs:
        last[(out["key"], out.get("window_start"))] = (out["n"], out.get("m", out["n"]))
    return last


def _counted(lines: list[str]) -> collections.Counter[str]:
    words: collections.Counter[str] = collections.Counter()
    for line in lines:
        if POISON not in line.split() and HUGE not in line.split():
            words.update(line.split())
    return words


@pytest.mark.parametrize("seed", range(4))
def test_unwindowed_counts_match_counter_and_the_general_path(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rnd = random.Random(seed)
    lines = _lines(rnd, 300, poison=True)
    times = [1_000 + i for i in range(len(lines))]
    topology = _topology(two_counts=seed % 2 == 1)
    expected = {(w, None): (c, c) for w, c in _counted(lines).items()}
    bad = sorted(line.encode()[:200] for line in lines if line not in _good(lines))
    results = []
    for pre_combine in (True, False):
        batch = rnd.choice([None, 1, 7, 50])
        fast, slow = (
            _run(
                topology, lines, times, pre_combine=pre_combine, batch=batch, fast=f, mp=monkeypatch
            )
            for f in (True, False)
        )
        assert fast == slow  # shuffle bytes, outputs and dead letters
        assert _final(fast["outputs"]) == expected
        assert [body for body, _op, _reason in fast["dead"]] == bad
        results.append(fast)
    # Dead letters do not depend on pre-combining or batch boundaries.
    assert results[0]["dead"] == results[1]["dead"]


def _good(lines: list[str]) -> set[str]:
    return {line for line in lines if POISON not in line.split() and HUGE not in line.split()}


def _late_reference(lines: list[str], times: list[int]) -> dict[tuple[Any, ...], tuple[int, int]]:
    """Tumbling-window counts of the lines not late by their own queue's progress
    (one source queue: the highest event time of the good lines before it)."""
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    progress: int | None = None
    good = _good(lines)
    for line, ts in zip(lines, times, strict=True):
        if line not in good:
            continue
        end = ts - ts % WINDOW_MS + WINDOW_MS
        words = line.split()
        if progress is None or end > progress - LATENESS_MS:
            counts.update((w, end - WINDOW_MS) for w in words)
        if words:
            progress = ts if progress is None else max(progress, ts)
    return {k: (c, c) for k, c in counts.items()}


def _times(rnd: random.Random, count: int) -> list[int]:
    """Mostly forward in event time, now and then seconds behind (late)."""
    times, now = [], 10_000
    for _ in range(count):
        now += rnd.randint(0, 120)
        times.append(now - (rnd.randint(1_000, 4_000) if rnd.random() < 0.1 else 0))
    return times


@pytest.mark.parametrize("seed", range(4))
def test_windowed_counts_with_late_lines_match_the_general_path(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rnd = random.Random(100 + seed)
    lines = _lines(rnd, 300, poison=True)
    times = _times(rnd, len(lines))
    sliding = seed % 2 == 1
    window = (
        SlidingWindow.of(Time.seconds(2), Time.seconds(1))
        if sliding
        else TumblingWindow.of(Time.seconds(1))
    )
    topology = _topology(window, two_counts=seed >= 2)
    finals = []
    for pre_combine in (True, False):
        batch = rnd.choice([None, 3, 40])
        fast, slow = (
            _run(
                topology, lines, times, pre_combine=pre_combine, batch=batch, fast=f, mp=monkeypatch
            )
            for f in (True, False)
        )
        assert fast == slow
        finals.append((_final(fast["outputs"]), fast["dead"]))
    assert finals[0] == finals[1]


@pytest.mark.parametrize("seed", range(3))
def test_tumbling_late_verdicts_match_a_reference(seed: int) -> None:
    rnd = random.Random(200 + seed)
    lines = _lines(rnd, 250, poison=True)
    times = _times(rnd, len(lines))
    topology = _topology(TumblingWindow.of(Time.seconds(1)))
    expected = _late_reference(lines, times)
    good = _good(lines)
    # Some lines are late.
    assert sum(c for c, _ in expected.values()) < sum(len(x.split()) for x in lines if x in good)
    # One source queue: a line's progress is that of the lines before it.
    for pre_combine in (True, False):
        with TopologyTestDriver(
            topology,
            source_queues=1,
            shuffle_queues=3,
            pre_combine=pre_combine,
            max_records_per_batch=rnd.choice([5, 60]),
        ) as driver:
            for line, ts in zip(lines, times, strict=True):
                if line in _good(lines):
                    driver.pipe(line, event_time=ts)
            driver.advance()
            driver.advance_idle()
            assert _final(driver.outputs()) == expected


def test_a_rejected_value_mid_record_leaves_the_partials_as_before_it() -> None:
    """The general path (a sum, not only counts): a record whose second element
    the sum cannot take is a dead letter whole, and the combined partials of
    its first element's key are as before it, whatever the batch split."""
    b = StreamBuilder("mixed")
    (
        b.source("in", text_deserializer)
        .flat_map(lambda line: [w.split("=") for w in line.split()])
        .key_by(lambda kv: kv[0])
        .count("n")
        .sum(lambda kv: int(kv[1]), "s")
        .to_rstream()
        .sink("out")
    )
    topology = b.build()
    rnd = random.Random(7)
    lines = []
    for _ in range(200):
        pairs = [f"{rnd.choice('abcde')}={rnd.randint(0, 9)}" for _ in range(rnd.randint(1, 4))]
        if rnd.random() < 0.1:
            pairs.insert(1, f"{rnd.choice('abcde')}=x")  # int("x") fails
        lines.append(" ".join(pairs))
    good = [line for line in lines if "=x" not in line]
    expected_n: collections.Counter[str] = collections.Counter()
    expected_s: collections.Counter[str] = collections.Counter()
    for line in good:
        for pair in line.split():
            k, v = pair.split("=")
            expected_n[k] += 1
            expected_s[k] += int(v)
    for pre_combine in (True, False):
        for batch in (None, 1, 9):
            with TopologyTestDriver(
                topology, source_queues=2, pre_combine=pre_combine, max_records_per_batch=batch
            ) as driver:
                for i, line in enumerate(lines):
                    driver.pipe(line, queue=i % 2)
                driver.advance()
                last = {o["key"]: (o["n"], o["s"]) for o in driver.outputs()}
                dead = sorted(body.decode() for body, _ in driver.dead_letters())
            assert last == {k: (expected_n[k], expected_s[k]) for k in expected_n}
            assert dead == sorted(line for line in lines if line not in good)


def test_counter_of_only_counts_exact_count_parts() -> None:
    from stream_assets.operators.aggregates import Composite, Count, Sum

    class MyCount(Count):
        def add(self, acc: int, value: Any) -> int:
            return acc + 2

    assert shuffle_out._counter_of(Count()) is not None
    both = shuffle_out._counter_of(Composite([("a", Count()), ("b", Count())]))
    assert both is not None and both(3) == [3, 3]
    assert shuffle_out._counter_of(Composite([("a", Count()), ("s", Sum(int))])) is None
    assert shuffle_out._counter_of(Composite([("a", MyCount())])) is None
    assert shuffle_out._counter_of(Composite([])) is None
