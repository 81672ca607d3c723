"""Aggregates: count, sum, min, max, avg and user accumulators.

Every aggregate is an :class:`Accumulator` with an associative ``merge``, which
is what lets stage 0 pre-combine per micro-batch before the shuffle (DESIGN
section 2) and session windows merge, without changing results. Accumulator
values must be msgpack-friendly (numbers, strings, lists, dicts, None) because
they travel through the shuffle topic and live in RocksDB.

Example::

    >>> acc = Avg(lambda v: v)
    >>> a = acc.add(acc.add(acc.zero(), 2), 4)
    >>> acc.result(acc.merge(a, acc.add(acc.zero(), 6)))
    4.0
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Extractor = Callable[[Any], Any]


def whole_value(value: Any) -> Any:
    """The extractor of no field: the value itself (``key_by()``, ``sum()``).

    One named function, not a lambda per use, so the engine can tell it apart: a
    count keyed by the value skips a call per element
    (:mod:`~stream_assets.runtime.core.stage0.count_path`).

    >>> whole_value("word")
    'word'
    """
    return value


def field_or_fn(selector: str | Extractor | None, operator: str) -> Extractor:
    """Turn a field name (for dict records) or a callable into an extractor; None: the
    value itself (:func:`whole_value`)."""
    if selector is None:
        return whole_value
    if isinstance(selector, str):
        name = selector

        def by_field(value: Any) -> Any:
            try:
                return value[name]
            except (KeyError, TypeError, IndexError) as exc:
                raise KeyError(f"{operator}: record has no field {name!r}: {value!r}") from exc

        return by_field
    if not callable(selector):
        raise TypeError(
            f"{operator}: expected a field name or a callable, got {type(selector).__name__}"
        )
    return selector


class Accumulator(ABC):
    """zero / add / merge / result; ``merge`` must be associative and commutative."""

    #: name used as the output alias when the user gives none
    kind: str = "aggregate"

    @abstractmethod
    def zero(self) -> Any:
        """The empty accumulator."""

    @abstractmethod
    def add(self, acc: Any, value: Any) -> Any:
        """Fold one record into ``acc``."""

    @abstractmethod
    def merge(self, a: Any, b: Any) -> Any:
        """Combine two partial accumulators."""

    def result(self, acc: Any) -> Any:
        """The output value of ``acc``."""
        return acc


@dataclass
class Count(Accumulator):
    """Number of records."""

    kind = "count"

    def zero(self) -> int:
        return 0

    def add(self, acc: int, value: Any) -> int:
        return acc + 1

    def merge(self, a: int, b: int) -> int:
        return a + b


@dataclass
class Sum(Accumulator):
    """Sum of a numeric field or function."""

    extract: Extractor
    kind = "sum"

    def zero(self) -> int:
        return 0

    def add(self, acc: Any, value: Any) -> Any:
        return acc + self.extract(value)

    def merge(self, a: Any, b: Any) -> Any:
        return a + b


@dataclass
class _Extreme(Accumulator):
    """Min or max: the accumulator is the best value so far (None when empty)."""

    extract: Extractor

    def zero(self) -> Any:
        return None

    def add(self, acc: Any, value: Any) -> Any:
        return self.merge(acc, self.extract(value))

    def merge(self, a: Any, b: Any) -> Any:
        if a is None:
            return b
        if b is None:
            return a
        return b if self._better(b, a) else a

    def _better(self, x: Any, y: Any) -> bool:
        raise NotImplementedError


@dataclass
class Min(_Extreme):
    """Smallest value (None when empty)."""

    kind = "min"

    def _better(self, x: Any, y: Any) -> bool:
        return bool(x < y)


@dataclass
class Max(_Extreme):
    """Largest value (None when empty)."""

    kind = "max"

    def _better(self, x: Any, y: Any) -> bool:
        return bool(x > y)


@dataclass
class Avg(Accumulator):
    """Mean, kept as [sum, count] so partial averages merge exactly."""

    extract: Extractor
    kind = "avg"

    def zero(self) -> list[Any]:
        return [0, 0]

    def add(self, acc: list[Any], value: Any) -> list[Any]:
        return [acc[0] + self.extract(value), acc[1] + 1]

    def merge(self, a: list[Any], b: list[Any]) -> list[Any]:
        return [a[0] + b[0], a[1] + b[1]]

    def result(self, acc: list[Any]) -> float | None:
        return acc[0] / acc[1] if acc[1] else None


@dataclass
class Composite(Accumulator):
    """Several named aggregates over the same group, e.g. ``.sum("f", "s").count("n")``.

    The accumulator is a list (one entry per part); the result a dict by alias.
    """

    parts: list[tuple[str, Accumulator]]
    kind = "composite"

    def zero(self) -> list[Any]:
        return [acc.zero() for _, acc in self.parts]

    def add(self, acc: list[Any], value: Any) -> list[Any]:
        if len(acc) == 1:  # the common ``.count()``: no zip, no comprehension
            return [self.parts[0][1].add(acc[0], value)]
        return [part.add(a, value) for (_, part), a in zip(self.parts, acc, strict=True)]

    def merge(self, a: list[Any], b: list[Any]) -> list[Any]:
        if len(a) == 1 == len(b):  # a keyed step merges each key's partials: as in add
            return [self.parts[0][1].merge(a[0], b[0])]
        return [part.merge(x, y) for (_, part), x, y in zip(self.parts, a, b, strict=True)]

    def result(self, acc: list[Any]) -> dict[str, Any]:
        if len(acc) == 1 == len(self.parts):  # one result per changed key: as in add
            alias, part = self.parts[0]
            return {alias: part.result(acc[0])}
        return {alias: part.result(a) for (alias, part), a in zip(self.parts, acc, strict=True)}


_BUILT_INS: tuple[type[Accumulator], ...] = (Count, Sum, Min, Max, Avg)


def is_decomposable(acc: Accumulator) -> bool:
    """Whether stage 0 may pre-combine ``acc`` before the shuffle.

    Only the built-ins are trusted to have an exact ``merge``; a user
    accumulator is applied record by record after the shuffle.
    """
    if isinstance(acc, Composite):
        return all(is_decomposable(part) for _, part in acc.parts)
    return isinstance(acc, _BUILT_INS)
