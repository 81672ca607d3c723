"""What a topology prints reaches the instance's stdout, in order per queue.

Where ``print()`` in a task goes by itself: not to the instance. A Spark task's
Python code runs in a worker process forked by Spark's Python daemon, and
Spark's ``PythonWorkerFactory`` copies both the stdout and the stderr of that
daemon and its workers to its JVM's ``System.err`` (``redirectStreamsToStderr``;
checked on Spark 4.3, whose daemon writes its port on stdout and leaves it
attached). In local mode that JVM is the instance's driver JVM, which inherited
the instance's stderr: a ``Print`` line or a user's ``print()`` arrived on the
instance's *stderr*, among Spark's log lines. On a cluster it is the
executor's stderr, a file on the worker machine (``work/<app>/<executor>/stderr``),
never the instance's.

What the instance does instead: each queue's batch runs with ``sys.stdout``
captured (:func:`run_printing`), and the text travels back in a Spark
accumulator (:func:`stdout_accumulator`). Spark merges a task's accumulator
updates on the driver, in the instance process (PySpark's accumulator server),
when the task succeeds and before the batch's job returns. The driver's side
of this accumulator writes the text to the instance's ``sys.stdout`` instead of
keeping it: the terminal, or for an instance run under Dagster the run's
captured stdout.

Order: a queue's batch is one task, written in one piece in the order it was
printed, and a stage plans its next batch only after this one's job returned,
so each queue's lines arrive in order. Pieces of different queues and stages
interleave.

Not captured, so still on the worker's stderr (the instance's stderr in local
mode, the executor's log on a cluster): ``print(..., file=sys.stderr)``, writes
below ``sys.stdout`` (a C library or a subprocess writing to file descriptor 1),
and the text of an attempt that failed (written there when it fails). A batch
that runs again after a failure prints again: ``Print`` is at-least-once, like
the sinks. A task's text is held in memory until the queue's batch ends, so
``Print`` is for watching a topology, not a sink for volume.

Example::

    >>> class Collected(list[str]):  # stands in for the accumulator
    ...     def add(self, term: list[str]) -> None:
    ...         self.extend(term)
    >>> lines = Collected()
    >>> run_printing(lambda: print("hello") or 42, lines), lines
    (42, ['hello\\n'])
"""

from __future__ import annotations

import sys
import threading
import weakref

from pyspark import SparkContext
from pyspark.accumulators import Accumulator, AccumulatorParam

from stream_assets.runtime.drive.printing import Lines, run_printing

__all__ = ["Lines", "run_printing", "stdout_accumulator"]


class TaskLines(AccumulatorParam[list[str]]):
    """An accumulator's text pieces, in the order added (the task's side)."""

    def zero(self, value: list[str]) -> list[str]:
        """No pieces."""
        return []

    def addInPlace(self, value1: list[str], value2: list[str]) -> list[str]:
        """``value1`` followed by ``value2``."""
        value1.extend(value2)
        return value1


#: Pieces from different queues' tasks are written whole, never interleaved.
_WRITE_LOCK = threading.Lock()


class EchoToStdout(TaskLines):
    """The driver's side: each task's pieces are written to ``sys.stdout`` as they arrive.

    Nothing is kept (the accumulator's value stays empty). Pickled into a
    task, it becomes a plain :class:`TaskLines`, so a task only collects.
    """

    def addInPlace(self, value1: list[str], value2: list[str]) -> list[str]:
        """Write ``value2``'s pieces to this process's stdout; ``value1`` unchanged."""
        with _WRITE_LOCK:
            try:
                for piece in value2:
                    sys.stdout.write(piece)
                sys.stdout.flush()
            except (OSError, ValueError):
                # stdout closed or gone (a pipe whose reader left): the text is lost,
                # but raising here would fail the job in PySpark's accumulator server.
                pass
        return value1

    def __reduce__(self) -> tuple[type[TaskLines], tuple[()]]:
        return (TaskLines, ())


#: One accumulator per SparkContext: registering one per batch would grow the
#: driver's accumulator registry for the instance's whole life.
_ACCUMULATORS: weakref.WeakKeyDictionary[SparkContext, Accumulator[list[str]]] = (
    weakref.WeakKeyDictionary()
)
_ACCUMULATORS_LOCK = threading.Lock()


def stdout_accumulator(spark_context: SparkContext) -> Accumulator[list[str]]:
    """The accumulator whose pieces ``spark_context``'s driver writes to its stdout.

    Call it on the driver, and let the task's function capture the result.
    """
    with _ACCUMULATORS_LOCK:
        accumulator = _ACCUMULATORS.get(spark_context)
        if accumulator is None:
            accumulator = spark_context.accumulator([], EchoToStdout())
            _ACCUMULATORS[spark_context] = accumulator
        return accumulator


def active_stdout_accumulator() -> Accumulator[list[str]] | None:
    """:func:`stdout_accumulator` of this process's running SparkContext; None without one."""
    # PySpark has no public "the running context, if any": getOrCreate() would start one.
    spark_context = SparkContext._active_spark_context
    return None if spark_context is None else stdout_accumulator(spark_context)
