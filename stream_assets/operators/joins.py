"""What a windowed join keeps per key and window, and the pairs it gives when the window fires.

A windowed join is a windowed aggregate over the union of both sides (each
record shuffled as ``[side, value]``) whose accumulator collects the values of
each side; firing turns the collection into pairs. So lateness, watermarks,
the changelog and exactly-once are the aggregate's, unchanged.

Example::

    >>> c = JoinCollect()
    >>> acc = c.add(c.add(c.add(c.zero(), [0, "l1"]), [1, "r1"]), [1, "r2"])
    >>> join_pairs(acc, "inner")
    [('l1', 'r1'), ('l1', 'r2')]
    >>> join_pairs(c.add(c.zero(), [0, "l2"]), "left")
    [('l2', None)]
"""

from __future__ import annotations

from typing import Any

from stream_assets.operators.aggregates import Accumulator

JOIN_KINDS = ("inner", "left")


class JoinCollect(Accumulator):
    """``[left values, right values]`` of one key in one window, in arrival order."""

    kind = "join"

    def zero(self) -> list[list[Any]]:
        return [[], []]

    def add(self, acc: list[list[Any]], value: Any) -> list[list[Any]]:
        side, item = value
        acc[int(side)].append(item)
        return acc

    def merge(self, a: list[list[Any]], b: list[list[Any]]) -> list[list[Any]]:
        return [a[0] + b[0], a[1] + b[1]]

    def result(self, acc: list[list[Any]]) -> Any:
        return acc


def join_pairs(acc: list[list[Any]], kind: str) -> list[tuple[Any, Any]]:
    """Every (left, right) pair of a fired window; a left join pairs a lonely left with None."""
    lefts, rights = acc
    if not rights:
        return [(left, None) for left in lefts] if kind == "left" else []
    return [(left, right) for left in lefts for right in rights]
