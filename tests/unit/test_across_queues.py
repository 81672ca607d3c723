"""Stage 0 pre-combining a step's source queues into one message per shuffle queue
(stage0/across_queues.py): counts stay exact, replays of any shape are skipped.

References are computed from the input lines with ``collections.Counter``.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import wordcount
from stream_assets.operators.batches import lower_words
from stream_assets.plan.topology import Topology
from stream_assets.runtime.core.send_buffer import SendBuffer
from stream_assets.runtime.core.shuffle_codec import ShuffleProtocolError, decode, encode_across
from stream_assets.runtime.core.stage0.shuffle_out import WHOLE_OFFSET
from stream_assets.runtime.core.stage0.stateless import run_source_batch
from stream_assets.serde import text_deserializer
from stream_assets.testing import TopologyTestDriver
from stream_assets.windows import Time, TumblingWindow

SOURCE, SINK, SHUFFLE = "in", "out", "wc__shuffle__aggregate"


def _lines(seed: int, count: int, words: int = 40) -> list[str]:
    rnd = random.Random(seed)
    vocab = [f"w{i}" for i in range(words)]
    return [" ".join(rnd.choices(vocab, k=rnd.randint(1, 6))) for _ in range(count)]


def _counts(driver: TopologyTestDriver) -> dict[str, int]:
    """Each word's latest count in the sink."""
    return {o["key"]: o["count"] for o in driver.outputs(SINK)}


def _driver(topology: Topology | None = None, **kw: Any) -> TopologyTestDriver:
    kw = {"source_queues": 4, "shuffle_queues": 3, "across_queues": True, **kw}
    return TopologyTestDriver(topology or wordcount.build("wc", SOURCE, SINK), **kw)


def _stage0_entries(driver: TopologyTestDriver) -> int:
    return sum(s.shuffle_records for s in driver.stats if s.stage == 0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_counts_match_a_counter_with_fewer_entries_than_per_queue(seed: int) -> None:
    lines = _lines(seed, 300)
    reference = collections.Counter(w for line in lines for w in line.split())
    entries = {}
    for across in (True, False):
        with _driver(max_records_per_batch=random.Random(seed).randint(5, 40)) as driver:
            driver.across_queues = across
            for line in lines:
                driver.pipe(line)
            driver.advance()
            assert _counts(driver) == dict(reference), f"across={across}"
            entries[across] = _stage0_entries(driver)
    assert entries[True] < entries[False], "a word of several queues went once per step"


def test_a_message_read_again_and_the_same_ranges_sent_again_count_once() -> None:
    lines = _lines(4, 200)
    reference = collections.Counter(w for line in lines for w in line.split())
    with _driver() as driver:
        for line in lines:
            driver.pipe(line)
        driver.advance()
        sent = [decode(r.body) for q in range(3) for r in driver.broker.topic(SHUFFLE).read(q, 0)]
        assert sent and all("srcs" in body for body in sent), "the step went across its queues"
        # A step found a group down after some sends: its queues go again one by one,
        # pre-combined (the same ends). Then the keyed stage reads everything again.
        ctx = driver.contexts[0]
        source = driver.broker.topic(SOURCE)
        for q in range(4):
            records = source.read(q, 0)
            run_source_batch(ctx, q, 0, source.end(q), records, SendBuffer(driver.broker))
        driver.rewind(SHUFFLE, 0)
        stats = driver.advance()
        assert _counts(driver) == dict(reference)
        assert sum(s.skipped_duplicates for s in stats) > 0
        # A crash before the offsets were committed: replayed per record.
        driver.rewind(SOURCE, 0)
        driver.advance()
        assert _counts(driver) == dict(reference)


def test_an_across_message_partly_applied_before_fails_the_step_and_changes_nothing() -> None:
    with _driver(shuffle_queues=1) as driver:
        driver.pipe("a b", queue=0)
        driver.pipe("b c", queue=1)
        driver.advance()
        before = _counts(driver)
        # Origin 0 (queue 0) ended at offset 0 and is applied; origin 1 goes further.
        body = encode_across(
            [(0, (0, WHOLE_OFFSET), None), (1, (5, WHOLE_OFFSET), None)],
            [["a", None, None, [1], 0, 1]],
            records=1,
        )
        driver.broker.send(SHUFFLE, body, queue_id=0)
        driver.broker.flush()
        with pytest.raises(ShuffleProtocolError, match="some were applied"):
            driver.advance()
        assert _counts(driver) == before == {"a": 1, "b": 2, "c": 1}


def _summing() -> Topology:
    builder = StreamBuilder("sums")
    (
        builder.source(SOURCE, text_deserializer)
        .flat_map(str.split)
        .key_by(lambda w: w[:2])
        .sum(len, "total")
        .to_rstream()
        .sink(SINK)
    )
    return builder.build()


def _windowed() -> Topology:
    builder = StreamBuilder("windowed")
    (
        builder.source(SOURCE, text_deserializer)
        .flat_map(str.split)
        .key_by(lambda w: w)
        .window(TumblingWindow.of(Time.seconds(10)))
        .count()
        .to_rstream()
        .sink(SINK)
    )
    return builder.build()


@pytest.mark.parametrize("build", [_summing, _windowed])
def test_only_unwindowed_counts_go_across(build: Any) -> None:
    lines = _lines(5, 60)
    with _driver(build()) as driver:
        for i, line in enumerate(lines):
            driver.pipe(line, event_time=i * 1000)
        driver.advance()
        bodies = [
            decode(r.body)
            for q in range(3)
            for r in driver.broker.topic(driver.topology.stages[1].input_topic).read(q, 0)
        ]
        assert bodies and not any("srcs" in body for body in bodies)


def _vectorised() -> Topology:
    builder = StreamBuilder("vec")
    (
        builder.source(SOURCE, text_deserializer)
        .flat_map_batches(lower_words)
        .key_by(str)
        .count()
        .to_rstream()
        .sink(SINK)
    )
    return builder.build()


def _mixed_keys() -> Topology:
    """Words keyed by themselves, numbers by their int: the count path takes str keys
    only, so a batch holds partials of both paths."""
    builder = StreamBuilder("mixed")
    (
        builder.source(SOURCE, text_deserializer)
        .flat_map(str.split)
        .key_by(lambda w: int(w) if w.isdigit() else w)
        .count()
        .to_rstream()
        .sink(SINK)
    )
    return builder.build()


@pytest.mark.parametrize("build", [_vectorised, _mixed_keys])
def test_partials_of_other_paths_merge_across_too(build: Any) -> None:
    rnd = random.Random(6)
    lines = [
        " ".join(rnd.choice(["To", "be", "or", "NOT", "7", "42"]) for _ in range(4))
        for _ in range(120)
    ]
    with _driver(build()) as driver:
        for line in lines:
            driver.pipe(line)
        driver.advance()
        shuffle = driver.topology.stages[1].input_topic
        bodies = [decode(r.body) for q in range(3) for r in driver.broker.topic(shuffle).read(q, 0)]
        assert bodies and all("srcs" in body for body in bodies)
        got = {str(o["key"]): o["count"] for o in driver.outputs(SINK)}
    if build is _vectorised:
        reference = collections.Counter(w for line in lines for w in line.lower().split())
    else:
        reference = collections.Counter(w for line in lines for w in line.split())
    assert got == dict(reference)
