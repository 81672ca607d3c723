"""Stage 0's vectorised path: a whole batch through batch operators into a count.

For a stage of the shape ``source -> map_batches/flat_map_batches/filter_batches
... -> key_by -> count()``: the batch's bodies become one Arrow array, each
batch operator runs once over all of it (in C for Arrow compute functions),
the values are grouped in C (a count and the latest event time per distinct
value), and the key function runs once per distinct value, not per value.

All or nothing: the batch is counted here only if every record would go the
same way through the general path (every value a string, every key a
``str``, each small enough for a shuffle entry). If anything stands in the
way -- a body that is not UTF-8, a batch function or key function that
raises, a value or key of another type -- nothing is counted and the batch
goes the general way, where each batch operator runs on one value at a time
(:func:`~stream_assets.runtime.core.stage0.batch_functions.run_on_value`): the record that
fails becomes a dead letter on its own, whatever batch it came in.

Example::

    >>> from stream_assets.dsl.builder import StreamBuilder
    >>> from stream_assets.operators.batches import lower_words
    >>> from stream_assets.rocketmq.records import Record
    >>> from stream_assets.runtime.core.context import StageContext, TaskStats
    >>> from stream_assets.runtime.core.stage0.shuffle_out import ShuffleOut
    >>> from stream_assets.serde import text_deserializer
    >>> b = StreamBuilder("wc")
    >>> (b.source("in", text_deserializer).flat_map_batches(lower_words)
    ...   .key_by(str).count().to_rstream().sink("out"))
    >>> ctx = StageContext.of(b.build(), 0, shuffle_queues=2, source_queues=(0,))
    >>> shuffle = ShuffleOut(ctx, sender=None, stats=TaskStats(), src=0, combine=True)
    >>> path = BatchCountPath.of(ctx.stage, shuffle)
    >>> path.count([Record("in", 0, 0, b"To be or NOT to be", born_timestamp=7)])
    True
    >>> sorted(slot[0] for slots in shuffle.combined.values() for slot in slots.values())
    ['be', 'not', 'or', 'to']
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stream_assets.plan import nodes as n
from stream_assets.plan.topology import Stage
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.stage0.batch_functions import run_batch_step
from stream_assets.runtime.core.stage0.count_path import (
    ENTRY_ROOM,
    counted_chain,
    merge_counts,
    utf8_width,
)
from stream_assets.runtime.core.stage0.shuffle_out import ShuffleOut
from stream_assets.serde import bytes_deserializer, text_deserializer

_STRINGS = (pa.string(), pa.large_string())


class BatchCountPath:
    """Counts a whole batch of a stage of batch operators into a count (:meth:`count`)."""

    def __init__(
        self,
        deserializer: Callable[[bytes], Any],
        steps: list[n.BatchFunction],
        key_fn: Callable[[Any], Any],
        shuffle: ShuffleOut,
    ) -> None:
        self._deserializer = deserializer
        self._steps = steps
        self._key_fn = key_fn
        self._shuffle = shuffle
        self._room = shuffle.entry_limit - ENTRY_ROOM

    @classmethod
    def of(cls, stage: Stage, shuffle: ShuffleOut) -> BatchCountPath | None:
        """The path for ``stage``'s batch, or None where the stage or batch has another shape
        (see :func:`.count_path.counted_chain`; every operator of the chain a batch
        operator)."""
        found = counted_chain(stage, shuffle)
        if found is None or stage.source is None:
            return None
        key_by, nodes = found
        steps = [x for x in nodes if isinstance(x, n.BatchFunction)]
        if not steps or len(steps) != len(nodes):
            return None
        return cls(stage.source.deserializer, steps, key_by.fn, shuffle)

    def count(self, records: list[Record]) -> bool:
        """Count every record of the batch into the shuffle's combined slots: True. False,
        having changed nothing, where the batch must go the general way."""
        try:
            values, parents = self._run(records)
            grouped = self._grouped(values, parents, records)
        except Exception:  # the general path runs it again, one record at a time
            return False
        if grouped is None:
            return False
        counts, latest, top = grouped
        if counts:
            merge_counts(self._shuffle, counts, latest)
            self._shuffle.took_all(top, lambda: _per_record(values, parents, records))
        return True

    def _run(self, records: list[Record]) -> tuple[pa.Array, np.ndarray]:
        """The values that reach the exit, and the index of the record of each."""
        values = _deserialized(self._deserializer, [r.body for r in records])
        parents: np.ndarray = np.arange(len(records))
        for step in self._steps:
            values, picked = run_batch_step(step, values)
            if picked is not None:
                parents = parents[picked.to_numpy()]
        return values, parents

    def _grouped(
        self, values: pa.Array, parents: np.ndarray, records: list[Record]
    ) -> tuple[Counter[str], dict[str, int], int] | None:
        """Per key: occurrences and latest event time; and the latest event time of all.
        None if a value or key is not what the general path would surely carry."""
        if not len(values):
            return Counter(), {}, 0
        if values.type not in _STRINGS or values.null_count:
            return None
        times = np.fromiter((r.born_timestamp for r in records), np.int64, len(records))
        table = pa.table({"v": values, "ts": times[parents]})
        groups = table.group_by("v").aggregate([("ts", "count"), ("ts", "max")])
        distinct = groups["v"].to_pylist()
        keys = list(map(self._key_fn, distinct))
        width, _chars = utf8_width(keys)
        longest_value = pc.max(pc.binary_length(values)).as_py()
        if not width or max(map(len, keys)) * width + longest_value > self._room:
            return None
        counts: Counter[str] = Counter()
        latest: dict[str, int] = {}
        for key, c, ts in zip(
            keys, groups["ts_count"].to_pylist(), groups["ts_max"].to_pylist(), strict=True
        ):
            counts[key] += c
            if ts > latest.get(key, ts - 1):
                latest[key] = ts
        return counts, latest, max(latest.values())


def _deserialized(deserializer: Callable[[bytes], Any], bodies: list[bytes]) -> pa.Array:
    """The bodies as an array of values; a text body that is not UTF-8 raises, as there."""
    if deserializer is text_deserializer:
        return pa.array(bodies, pa.binary()).cast(pa.string())
    if deserializer is bytes_deserializer:
        return pa.array(bodies, pa.binary())
    return pa.array([deserializer(body) for body in bodies])


def _per_record(
    values: pa.Array, parents: np.ndarray, records: list[Record]
) -> Iterator[tuple[list[Any], int, int]]:
    """Each counted record's ``(values, ts, offset)``, in order, for the shuffle to key
    one by one if its batch cannot go combined."""
    items = values.to_pylist()
    bounds = np.flatnonzero(np.diff(parents)) + 1
    for start, end in zip([0, *bounds.tolist()], [*bounds.tolist(), len(items)], strict=True):
        record = records[int(parents[start])]
        yield items[start:end], record.born_timestamp, record.queue_offset
