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
>>> pending.add([("the", None, None, 3, 1_000, 3)], "0/7", None)
>>> pending.add([("the", None, None, 2, 1_500, 2)], "1/4", None)
>>> step = pending.drain()
>>> [(key, merged, ts, n) for key, merged, ts, n, _slot in step]
[('the', 5, 1500, 5)]
>>> [part[:4] for part in step.parts("the")]
[(3, 1000, 3, '0/7'), (2, 1500, 2, '1/4')]
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
#: time, records, slot key: what :meth:`DrainedStep.parts` finds the parts by).
MergedSlot = tuple[Any, Any, int, int, Any]


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
    """Per key, the merge of the partials a step has read so far; and the messages they
    came in, where a key whose merged fold fails finds its parts again."""

    accumulator: Accumulator
    #: slot key (a ``str`` key as itself, any other key by its packed bytes) -> [key,
    #: merged, latest event time, records]; a str equals another only with the same bytes.
    _by_key: dict[Any, list[Any]] = field(default_factory=dict)
    #: The step's messages: (pre-combined entries, where, the message).
    _messages: list[tuple[list[Any], str, Record | None]] = field(default_factory=list)

    def add(self, entries: list[Any], where: str, record: Record | None) -> None:
        """Merge one message's pre-combined ``entries`` (key, window start, window end,
        partial, latest event time, records), each key into its slot.

        One loop a message and no part kept per entry (a call, a tuple and a list
        each, for a key that nearly never needs them): parts are found again only
        for a key whose merged fold fails (:meth:`DrainedStep.parts`).
        """
        self._messages.append((entries, where, record))
        by_key, merge = self._by_key, self.accumulator.merge
        for key, _ws, _we, partial, ts, count in entries:
            slot_key = key if type(key) is str else encode_key(key)
            slot = by_key.get(slot_key)
            if slot is None:
                by_key[slot_key] = [key, partial, ts, count]
                continue
            if slot[1] is not FAILED:
                try:
                    slot[1] = merge(slot[1], partial)
                except Exception:  # folded one by one instead, where each can fail alone
                    slot[1] = FAILED
            if ts > slot[2]:
                slot[2] = ts
            slot[3] += count

    def drain(self) -> DrainedStep:
        """The step's merged partials, one per key in the order keys arrived; empties
        the step's partials."""
        step = DrainedStep(self._by_key, self._messages)
        self._by_key, self._messages = {}, []
        return step

    def __bool__(self) -> bool:
        return bool(self._by_key)


@dataclass
class DrainedStep:
    """One step's merged partials (:meth:`Partials.drain`)."""

    _by_key: dict[Any, list[Any]]
    _messages: list[tuple[list[Any], str, Record | None]]

    def __iter__(self) -> Iterator[MergedSlot]:
        """(key, merged partial or :data:`FAILED`, latest event time, records, slot key)."""
        return (
            (key, merged, ts, n, slot_key)
            for slot_key, (key, merged, ts, n) in self._by_key.items()
        )

    def parts(self, slot_key: Any) -> list[Part]:
        """The partials of one key as they came, for folding one by one."""
        return [
            (partial, ts, count, where, record)
            for entries, where, record in self._messages
            for key, _ws, _we, partial, ts, count in entries
            if (key if type(key) is str else encode_key(key)) == slot_key
        ]


class _Failed:
    """The merge of two partials raised: fold the parts one by one."""

    def __repr__(self) -> str:
        return "FAILED"


#: What a drained step gives for a key whose partials could not be merged.
FAILED: Any = _Failed()
