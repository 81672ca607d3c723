"""The Spark adapter's task: the ``mapInArrow`` function of a micro-batch.

Each row of a micro-batch is one queue's range; the task runs each with
:func:`~stream_assets.runtime.drive.queues.run_range` and returns its stats row.
What is Spark's here: the Arrow rows in and out, and what a task prints
travelling back in an accumulator (:mod:`~stream_assets.runtime.spark.task_stdout`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import pyarrow as pa

from stream_assets.runtime.drive.planning import QueueRange
from stream_assets.runtime.drive.queues import TaskContext, run_range
from stream_assets.runtime.spark.task_stdout import Lines, active_stdout_accumulator


def task_fn(
    stages: Mapping[int, TaskContext], stdout: Lines | None = None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function of a query: one stats row per (stage, queue, range) row.

    ``stages`` holds the context of every stage the query reads. Called on the
    driver. What a queue's batch prints goes to ``stdout``, by default the
    running SparkContext's accumulator that the driver writes to its own
    stdout (:mod:`~stream_assets.runtime.spark.task_stdout`); without a
    SparkContext, prints are left alone.
    """
    lines = stdout if stdout is not None else active_stdout_accumulator()

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for row in batch.to_pylist():
                stage = int(row["stage"])
                r = QueueRange(
                    int(row["queue_id"]),
                    int(row["start"]),
                    int(row["end"]),
                    tuple(row["idle"] or ()),
                    stage,
                )
                yield run_range(stages[stage], r, lines).to_batch()

    return task
