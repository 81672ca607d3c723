"""Stage 0's batch count path gives what the general path gives, on random chains and batches.

:mod:`stream_assets.runtime.core.stage0.batch_count_path` counts a whole batch of a chain
of batch operators (``map_batches``, ``flat_map_batches``, ``filter_batches``)
into ``key_by(...).count()`` at once, or hands the whole batch to the general
path, which runs each batch operator on one value at a time. Here random
chains (a batch function that raises on one value, one that turns strings
into integers, a key function that raises, values too large for a shuffle
message, many distinct keys so that some shuffle queues' batches go per
record) run with the batch path and without it, over random batch splits:
outputs, dead letters and the shuffle's messages must be the same, and the
counts must equal a reference computed here in plain Python from the input.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.operators.batches import lower_words, split_words
from stream_assets.plan.nodes import MapBatches
from stream_assets.plan.topology import Topology
from stream_assets.runtime.core.stage0 import batch_count_path
from stream_assets.serde import text_deserializer
from stream_assets.testing import TopologyTestDriver
from tests.unit._count_runs import HUGE, final_counts, run_lines

VOCAB = [
    *(f"w{i}" for i in range(30)),
    *(f"Rare{i}" for i in range(2000)),  # many keys: some combined messages get too big
    "café",
    "日本語",
    "queue",
    "Quiet",
    "boom",  # a batch function raises on it
    "poison",  # the key function raises on it
    "huge",  # a batch function makes it too large for a shuffle entry
]


class Bad(Exception):
    """Raised by a test function on purpose."""


def _boom(values: pa.Array) -> pa.Array:
    if pc.any(pc.equal(pc.utf8_lower(values), "boom")).as_py():
        raise Bad("boom")
    return values


def _twice(values: pa.Array) -> pa.Array:
    offsets = pa.array(np.arange(0, 2 * len(values) + 1, 2, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, values.take(np.repeat(np.arange(len(values)), 2)))


def _inflate(values: pa.Array) -> pa.Array:
    return pc.if_else(pc.equal(values, "huge"), "h" * HUGE, values)


def _no_q(values: pa.Array) -> pa.Array:
    return pc.invert(pc.starts_with(pc.utf8_lower(values), "q"))


def _bang(values: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise(values, "!", "")


#: name -> (builder step, the same on one value in plain Python: a list of values).
STEPS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], list[Any]]]] = {
    "upper": (lambda s: s.map_batches(pc.utf8_upper), lambda w: [w.upper()]),
    "bang": (lambda s: s.map_batches(_bang), lambda w: [w + "!"]),
    "no_q": (
        lambda s: s.filter_batches(_no_q),
        lambda w: [] if w.lower().startswith("q") else [w],
    ),
    "boom": (lambda s: s.map_batches(_boom), lambda w: _raise() if w.lower() == "boom" else [w]),
    "huge": (lambda s: s.map_batches(_inflate), lambda w: ["h" * HUGE if w == "huge" else w]),
    "twice": (lambda s: s.flat_map_batches(_twice), lambda w: [w, w]),
}


def _raise() -> list[Any]:
    raise Bad("boom")


def _key(w: Any) -> Any:
    if isinstance(w, str) and w.lower().startswith("poison"):
        raise Bad("poison")
    return w if isinstance(w, str) else f"n{w}"


def _short_key(w: Any) -> Any:
    return _key(w)[:3] if isinstance(w, str) else _key(w)


def _topology(
    split: Callable[[Any], Any], steps: list[str], key: Callable[[Any], Any], lengths: bool
) -> Topology:
    b = StreamBuilder("batchpath")
    stream = b.source("in", text_deserializer).flat_map_batches(split)
    for name in steps:
        stream = STEPS[name][0](stream)
    if lengths:  # integers: never the batch path's
        stream = stream.map_batches(pc.utf8_length)
    stream.key_by(key).count("n").to_rstream().sink("out")
    return b.build()


def _reference(
    lines: list[str], lower: bool, steps: list[str], key: Callable[[Any], Any], lengths: bool
) -> dict[Any, int]:
    """Counts per key of the lines no function fails on and the shuffle can carry."""
    counts: collections.Counter[Any] = collections.Counter()
    for line in lines:
        values: list[Any] = (line.lower() if lower else line).split()
        try:
            for name in steps:
                values = [out for v in values for out in STEPS[name][1](v)]
            if lengths:
                values = [len(v) for v in values]
            keys = [key(v) for v in values]
        except Bad:
            continue
        if all(not (isinstance(x, str) and len(x) >= HUGE) for x in (*keys, *values)):
            counts.update(keys)
    return dict(counts)


def _run(
    topology: Topology, lines: list[str], batch: int | None, *, whole: bool, mp: pytest.MonkeyPatch
) -> tuple[dict[str, Any], int]:
    counted = 0
    real_count = batch_count_path.BatchCountPath.count

    def count(self: batch_count_path.BatchCountPath, records: list[Any]) -> bool:
        nonlocal counted
        took = real_count(self, records)
        counted += took and bool(records)
        return took

    with mp.context() as m:
        m.setattr(batch_count_path.BatchCountPath, "count", count)
        if not whole:
            m.setattr(
                batch_count_path.BatchCountPath, "of", classmethod(lambda cls, stage, out: None)
            )
        result = run_lines(topology, lines, batch)
    return result, counted


def _lines(rnd: random.Random, count: int, rare: float = 0.03) -> list[str]:
    """Lines of words, a few (``rare``) with one that makes its batch go the general way
    (boom, poison, huge): most batches of a few records go the batch way."""
    common, special = VOCAB[:30] + VOCAB[-7:-3], VOCAB[-3:]
    out = []
    for _ in range(count):
        words = [rnd.choice(common) for _ in range(rnd.choice([0, 1, 3, 8, 20]))]
        if words and rnd.random() < rare:
            words[rnd.randrange(len(words))] = rnd.choice(special)
        out.append("  ".join(words) if words else rnd.choice([" ", "  \t"]))
    return out


@pytest.mark.parametrize("seed", range(14))
def test_the_batch_path_equals_the_general_path_and_the_reference(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rnd = random.Random(seed)
    steps = rnd.sample(sorted(STEPS), rnd.randint(0, 3))
    key = rnd.choice([_key, _short_key])
    lower = rnd.random() < 0.5
    lengths = seed == 7
    topology = _topology(lower_words if lower else split_words, steps, key, lengths)
    lines = _lines(rnd, rnd.randint(60, 200))
    batch = rnd.choice([None, 1, 5, 33])
    fast, counted = _run(topology, lines, batch, whole=True, mp=monkeypatch)
    general, none = _run(topology, lines, batch, whole=False, mp=monkeypatch)
    assert none == 0
    if lengths:  # integers are not the batch path's
        assert counted == 0
    elif batch is not None:  # small batches: most have no word that stops the batch path
        assert counted > 0, "the batch path took no batch: the test proves nothing"
    assert fast == general, steps
    assert fast["outputs"] == _reference(lines, lower, steps, key, lengths), steps


def test_a_failing_value_fails_its_record_alone_whatever_its_batch() -> None:
    """A batch function that raises on one value: only that value's record is a dead letter,
    named after the operator, in a batch of one or of all."""
    b = StreamBuilder("boom")
    (
        b.source("in", text_deserializer)
        .flat_map_batches(split_words)
        .map_batches(_boom)
        .key_by(_key)
        .count("n")
        .to_rstream()
        .sink("out")
    )
    topology = b.build()
    lines = ["a b", "c boom", "a"]
    for batch in (None, 1):
        with TopologyTestDriver(topology, max_records_per_batch=batch) as driver:
            for line in lines:
                driver.pipe(line, event_time=1_000)
            driver.advance()
            dead = [(body, props["operator"]) for body, props in driver.dead_letters()]
            [op_id] = [k for k, x in topology.stages[0].nodes.items() if isinstance(x, MapBatches)]
            assert dead == [(b"c boom", op_id)]
            assert final_counts(driver.outputs()) == {"a": 2, "b": 1}


def test_a_batch_too_big_to_combine_goes_per_record_from_the_counted_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Too many distinct keys for one combined message: the records of a counted batch are
    keyed one by one and sent as the general path sends them."""
    rnd = random.Random(77)
    lines = [" ".join(rnd.choice(VOCAB[30:2030]) for _ in range(40)) for _ in range(150)]
    topology = _topology(split_words, ["twice"], _key, False)
    fast, counted = _run(topology, lines, None, whole=True, mp=monkeypatch)
    general, _ = _run(topology, lines, None, whole=False, mp=monkeypatch)
    assert counted > 0 and any("'recs'" in text for _, text in fast["shuffle"])
    assert fast == general
    assert fast["outputs"] == _reference(lines, False, ["twice"], _key, False)


def test_a_batch_answer_of_the_wrong_shape_goes_value_by_value_and_is_named() -> None:
    """An answer of the wrong length makes the batch go one value at a time (where this
    one is right); one of the wrong type fails each record, naming what was wrong."""
    b = StreamBuilder("shape")
    b.source("in", text_deserializer).map_batches(lambda v: v[:1]).key_by(_key).count(
        "n"
    ).to_rstream().sink("out")
    with TopologyTestDriver(b.build()) as driver:
        driver.pipe("a", event_time=1)
        driver.pipe("b", event_time=2)
        driver.advance()
        assert driver.dead_letters() == []
        assert final_counts(driver.outputs()) == {"a": 1, "b": 1}
    b = StreamBuilder("shape2")
    b.source("in", text_deserializer).flat_map_batches(pc.utf8_upper).key_by(_key).count(
        "n"
    ).to_rstream().sink("out")
    with TopologyTestDriver(b.build()) as driver:
        driver.pipe("a", event_time=1)
        driver.advance()
        [(body, props)] = driver.dead_letters()
        assert body == b"a"
        assert "must return a list array" in props["reason"]
