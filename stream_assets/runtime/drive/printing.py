"""What the core prints while it runs one queue's step, captured as one piece.

A driver hands the pieces to wherever the instance's stdout is: the Spark
adapter through an accumulator (:mod:`stream_assets.runtime.spark.task_stdout`),
a real-time task through its channel to the driver
(:mod:`stream_assets.runtime.drive.channel`).

Example::

    >>> class Collected(list[str]):
    ...     def add(self, term: list[str]) -> None:
    ...         self.extend(term)
    >>> lines = Collected()
    >>> run_printing(lambda: print("hello") or 42, lines), lines
    (42, ['hello\\n'])
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Lines(Protocol):
    """Where a task adds what it printed (a Spark accumulator of text pieces)."""

    def add(self, term: list[str]) -> None:
        """Append the pieces ``term``."""


def run_printing(step: Callable[[], T], lines: Lines | None) -> T:
    """``step()`` with what it prints to ``sys.stdout`` added to ``lines`` as one piece.

    When ``step`` raises, the text goes to the stdout it would have reached
    without capture (a Spark worker's: the executor's stderr), and the error
    propagates. ``lines=None``: ``step()`` as it is.
    """
    if lines is None:
        return step()
    own_stdout = sys.stdout
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            result = step()
    except BaseException:
        with contextlib.suppress(OSError, ValueError):  # the step's error matters more
            own_stdout.write(buffer.getvalue())
            own_stdout.flush()
        raise
    text = buffer.getvalue()
    if text:
        lines.add([text])
    return result
