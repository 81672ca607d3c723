"""Stage 0's count path gives what the general path gives, on random chains and batches.

:mod:`stream_assets.runtime.core.stage0.count_path` takes the records of a straight chain
of maps, flat_maps and filters into ``key_by(...).count()`` that it can prove
the general path would take whole. Here random chains (functions that raise,
values that are not strings, non-ASCII text, lone surrogates, values too large
for a shuffle message, many distinct keys so that some shuffle queues' batches
go per record) run with the count path and without it (``CountPath.of``
answering None), over random batch splits: outputs, dead letters (body,
operator, reason) and the shuffle's entries must be the same, and the counts
must equal a reference computed here from the input alone.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.runtime.core.stage0 import count_path
from stream_assets.serde import text_deserializer
from tests.unit._count_runs import HUGE, run_lines

VOCAB = [
    *(f"w{i}" for i in range(30)),
    *(f"rare{i}" for i in range(2000)),  # many keys: some combined messages get too big
    "café",
    "日本語",
    "queue",
    "Quiet",
    "boom",  # a map raises on it
    "poison",  # the key function raises on it
    "sur",  # a map makes it a lone surrogate: msgpack cannot carry it
    "huge",  # a map makes it too large for a shuffle entry
    "num",  # a map makes it an int: not the count path's, still counted
]


#: Calls of the user functions that count them: each runs once per value either way.
CALLS: collections.Counter[str] = collections.Counter()


class Bad(Exception):
    """Raised by a test function on purpose."""


def _boom(w: Any) -> Any:
    if isinstance(w, str) and w.lower() == "boom":
        raise Bad("boom")
    return w


def _mangle(w: Any) -> Any:
    CALLS["mangle"] += 1
    low = w.lower() if isinstance(w, str) else ""
    if low == "sur":
        return "\ud800" + w
    if low == "huge":
        return "h" * HUGE
    if low == "num":
        return 7
    return w


#: name -> (builder step, the same on one value in plain Python: a list of values).
STEPS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], list[Any]]]] = {
    "upper": (
        lambda s: s.map(lambda w: w.upper() if isinstance(w, str) else w),
        lambda w: [w.upper() if isinstance(w, str) else w],
    ),
    "bang": (
        lambda s: s.map(lambda w: w + "!" if isinstance(w, str) else w),
        lambda w: [w + "!" if isinstance(w, str) else w],
    ),
    "no_q": (
        lambda s: s.filter(lambda w: not (isinstance(w, str) and w.lower().startswith("q"))),
        lambda w: [] if isinstance(w, str) and w.lower().startswith("q") else [w],
    ),
    "boom": (lambda s: s.map(_boom), lambda w: [_boom(w)]),
    "mangle": (lambda s: s.map(_mangle), lambda w: [_mangle(w)]),
    "twice": (lambda s: s.flat_map(lambda w: [w, w]), lambda w: [w, w]),
}


def _key(w: Any) -> Any:
    CALLS["key"] += 1
    if isinstance(w, str) and w.lower().startswith("poison"):
        raise Bad("poison")
    return w if isinstance(w, str) else f"n{w}"


def _short_key(w: Any) -> Any:
    return _key(w)[:3] if isinstance(w, str) else _key(w)


def _topology(steps: list[str], key: Callable[[Any], Any] | None, two_counts: bool) -> Topology:
    b = StreamBuilder("countpath")
    stream = b.source("in", text_deserializer).flat_map(str.split)
    for name in steps:
        stream = STEPS[name][0](stream)
    agg = stream.key_by(key).count("n")
    if two_counts:
        agg = agg.count("m")
    agg.to_rstream().sink("out")
    return b.build()


def _reference(
    lines: list[str], steps: list[str], key: Callable[[Any], Any] | None
) -> dict[Any, int]:
    """Counts per key of the lines no function fails on and the shuffle can carry (no
    key function: the value is its key)."""
    counts: collections.Counter[Any] = collections.Counter()
    for line in lines:
        values: list[Any] = line.split()
        try:
            for name in steps:
                values = [out for v in values for out in STEPS[name][1](v)]
            keys = values if key is None else [key(v) for v in values]
        except Bad:
            continue
        carried = all(
            not (isinstance(x, str) and ("\ud800" in x or len(x) >= HUGE)) for x in (*keys, *values)
        )
        if carried:
            counts.update(keys)
    return dict(counts)


def _run(
    topology: Topology,
    lines: list[str],
    batch: int | None,
    *,
    counting: bool,
    mp: pytest.MonkeyPatch,
) -> tuple[dict[str, Any], int]:
    taken = 0
    real_take = count_path.CountPath.take

    def take(self: count_path.CountPath, value: Any, ts: int, offset: int) -> list[Any] | None:
        nonlocal taken
        left = real_take(self, value, ts, offset)
        taken += left is None
        return left

    CALLS.clear()
    with mp.context() as m:
        m.setattr(count_path.CountPath, "take", take)
        if not counting:
            m.setattr(count_path.CountPath, "of", classmethod(lambda cls, stage, shuffle: None))
        result = run_lines(topology, lines, batch)
    # Mapped once per value on either path; the key function runs again for a record the
    # count path hands on, and for the records of a batch sent one by one.
    result["mangle calls"] = CALLS["mangle"]
    return result, taken


@pytest.mark.parametrize("seed", range(12))
def test_the_count_path_equals_the_general_path_and_the_reference(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rnd = random.Random(seed)
    steps = rnd.sample(sorted(STEPS), rnd.randint(0, 4))
    key = rnd.choice([_key, _short_key, None])  # None: key_by(), by the value itself
    topology = _topology(steps, key, two_counts=seed % 3 == 0)
    lines = [
        " ".join(rnd.choice(VOCAB) for _ in range(rnd.choice([0, 1, 3, 8, 20, 40]))) or " "
        for _ in range(rnd.randint(80, 240))
    ]
    batch = rnd.choice([None, 1, 5, 33])
    fast, taken = _run(topology, lines, batch, counting=True, mp=monkeypatch)
    general, none_taken = _run(topology, lines, batch, counting=False, mp=monkeypatch)
    assert none_taken == 0
    assert taken > 0, "the count path took no record: the test proves nothing"
    assert fast == general, steps
    assert fast["outputs"] == _reference(lines, steps, key), steps


def test_a_windowed_count_and_a_chain_with_a_sink_keep_the_general_path() -> None:
    from stream_assets.runtime.core.context import StageContext, TaskStats
    from stream_assets.runtime.core.stage0.shuffle_out import ShuffleOut
    from stream_assets.windows import Time, TumblingWindow

    def shapes() -> list[Topology]:
        windowed = StreamBuilder("w")
        (
            windowed.source("in", text_deserializer)
            .flat_map(str.split)
            .key_by(_key)
            .window(TumblingWindow.of(Time.seconds(1)))
            .count()
            .to_rstream()
            .sink("out")
        )
        sinking = StreamBuilder("s")
        words = sinking.source("in", text_deserializer).flat_map(str.split)
        words.sink("echo")
        words.key_by(_key).count().to_rstream().sink("out")
        return [windowed.build(), sinking.build()]

    for topology in shapes():
        ctx = StageContext.of(topology, 0, shuffle_queues=2, source_queues=(0,))
        shuffle = ShuffleOut(ctx, sender=None, stats=TaskStats(), src=0, combine=True)
        assert count_path.CountPath.of(ctx.stage, shuffle) is None


def test_a_batch_too_big_to_combine_goes_per_record_from_the_counted_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Too many distinct keys for one combined message: the records the count path took
    are keyed again and sent one by one, as the general path sends them."""
    rnd = random.Random(77)
    lines = [" ".join(rnd.choice(VOCAB) for _ in range(40)) for _ in range(150)]
    fast, taken = _run(
        _topology(["twice"], _key, False), lines, None, counting=True, mp=monkeypatch
    )
    general, _ = _run(
        _topology(["twice"], _key, False), lines, None, counting=False, mp=monkeypatch
    )
    assert taken > 0 and any("'recs'" in text for _, text in fast["shuffle"])
    assert fast == general
    assert fast["outputs"] == _reference(lines, ["twice"], _key)
