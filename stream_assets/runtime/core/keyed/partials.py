"""A step's pre-combined partials of an unwindowed aggregate, merged per key before
they touch the state.

Stage 0 pre-combines per source queue and step, so a keyed step meets each
key once per source queue that read it (eight partials of ``"the"`` from
eight source queues); folding each into the state cost a state read, a
merge and a packed write apiece, most of a real-time WordCount step. Here
the partials of one key are merged first (``merge`` is associative and
commutative: :class:`~stream_assets.operators.aggregates.Accumulator`), and
the state sees one fold per key and step.

Only where nothing else depends on the order of the folds: an aggregate
with no window (no lateness to judge per origin) and no TTL (no expiry
between two of a key's records). A merged fold that fails (a sum the state
cannot hold) is undone and its parts are folded one by one, so what reaches
the state and what becomes a dead letter are what folding each partial
would have made.

>>> from stream_assets.operators.aggregates import Count
>>> pending = Partials(Count())
>>> pending.add("the", 3, 1_000, 3, "0/7", None)
>>> pending.add("the", 2, 1_500, 2, "1/4", None)
>>> [(key, merged, ts, n) for key, merged, ts, n, _parts in pending.drain()]
[('the', 5, 1500, 5)]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from stream_assets.operators.aggregates import Accumulator, is_decomposable
from stream_assets.plan import nodes as n
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.shuffle_codec import encode_key

#: One partial as it came: (partial, its latest event time, records, where, message).
Part = tuple[Any, int, int, str, Record | None]
#: One key's partials of a step: (key, merged partial or :data:`FAILED`, latest event
#: time, records, parts).
MergedSlot = tuple[Any, Any, int, int, list[Part]]


def partials_for(head: n.Stateful) -> Partials | None:
    """The step's partials if ``head`` may merge a key's partials before folding them,
    else None (they are folded as they come)."""
    if (
        isinstance(head, n.Aggregate)
        and not isinstance(head, n.Join)
        and head.window is None
        and head.ttl_ms is None
        and is_decomposable(head.accumulator)
    ):
        return Partials(head.accumulator)
    return None


@dataclass
class Partials:
    """Per key, the merge of the partials a step has read so far, and the parts."""

    accumulator: Accumulator
    #: key (a ``str`` as itself, any other key by its packed bytes) -> [key, merged,
    #: latest event time, records, parts]; a str equals another only with the same bytes.
    _by_key: dict[Any, list[Any]] = field(default_factory=dict)

    def add(
        self, key: Any, partial: Any, ts: int, count: int, where: str, record: Record | None
    ) -> None:
        """Merge one partial of ``key`` (``count`` records, latest at ``ts``)."""
        slot_key = key if type(key) is str else encode_key(key)
        slot = self._by_key.get(slot_key)
        part = (partial, ts, count, where, record)
        if slot is None:
            self._by_key[slot_key] = [key, partial, ts, count, [part]]
            return
        slot[4].append(part)
        if slot[1] is not FAILED:
            try:
                slot[1] = self.accumulator.merge(slot[1], partial)
            except Exception:  # folded one by one instead, where each can fail alone
                slot[1] = FAILED
        slot[2] = max(slot[2], ts)
        slot[3] += count

    def drain(self) -> Iterator[MergedSlot]:
        """(key, merged partial or :data:`FAILED`, latest event time, records, parts) per
        key in the order keys arrived; empties the step's partials."""
        slots, self._by_key = self._by_key, {}
        return ((key, merged, ts, n, parts) for key, merged, ts, n, parts in slots.values())

    def __bool__(self) -> bool:
        return bool(self._by_key)


class _Failed:
    """The merge of two partials raised: fold the parts one by one."""

    def __repr__(self) -> str:
        return "FAILED"


#: What :meth:`Partials.drain` gives for a key whose partials could not be merged.
FAILED: Any = _Failed()
