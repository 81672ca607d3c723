"""Durations, as whole milliseconds, in the RocketMQ-Streams ``Time`` style.

The engine keeps every time as an int of milliseconds, so ``Time`` is only a
readable way to write one. Zero is a valid ``Time`` (no allowed lateness);
whether zero makes sense for a window size is for the window spec to decide.

Example::

    >>> Time.seconds(10).ms
    10000
    >>> Time.minutes(1) == Time.milliseconds(60_000)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

_MS_PER_SECOND = 1_000
_MS_PER_MINUTE = 60 * _MS_PER_SECOND
_MS_PER_HOUR = 60 * _MS_PER_MINUTE


def _checked(n: int, unit: str) -> int:
    # bool is an int subclass; Time.seconds(True) is a bug, not one second.
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"Time.{unit}() needs an int, got {n!r} ({type(n).__name__})")
    if n < 0:
        raise ValueError(f"Time.{unit}() needs a non-negative amount, got {n}")
    return n


@dataclass(frozen=True, slots=True, order=True)
class Time:
    """A non-negative duration of ``ms`` milliseconds.

    Example::

        >>> Time.hours(2).ms
        7200000
        >>> Time.seconds(-1)
        Traceback (most recent call last):
        ...
        ValueError: Time.seconds() needs a non-negative amount, got -1
    """

    ms: int

    def __post_init__(self) -> None:
        _checked(self.ms, "milliseconds")

    @classmethod
    def milliseconds(cls, n: int) -> Time:
        """``n`` milliseconds.

        >>> Time.milliseconds(250).ms
        250
        """
        return cls(_checked(n, "milliseconds"))

    @classmethod
    def seconds(cls, n: int) -> Time:
        """``n`` seconds.

        >>> Time.seconds(0).ms
        0
        """
        return cls(_checked(n, "seconds") * _MS_PER_SECOND)

    @classmethod
    def minutes(cls, n: int) -> Time:
        """``n`` minutes.

        >>> Time.minutes(5).ms
        300000
        """
        return cls(_checked(n, "minutes") * _MS_PER_MINUTE)

    @classmethod
    def hours(cls, n: int) -> Time:
        """``n`` hours.

        >>> Time.hours(1).ms
        3600000
        """
        return cls(_checked(n, "hours") * _MS_PER_HOUR)
