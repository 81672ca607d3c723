"""What a task prints reaches the driver's stdout, whole, in order per queue.

Spark is not started: the accumulator is unpickled as a worker would (its
registry without the driver's copy) and its value merged as PySpark's
accumulator server merges a finished task's update. The real path (executors on
other machines) is checked by the user-package test in
tests/integration/test_cluster.py.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from pyspark.accumulators import Accumulator, _accumulatorRegistry

from stream_assets.examples import wordcount
from stream_assets.rocketmq.errors import BrokerUnreachableError
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.drive import queues
from stream_assets.runtime.drive.outage import OutagePolicy
from stream_assets.runtime.spark import task as spark_task
from stream_assets.runtime.spark.task_stdout import EchoToStdout, TaskLines, run_printing
from stream_assets.settings import RocketMQSettings


class Pieces(list[str]):
    """Stands in for the accumulator a task adds its text to."""

    def add(self, term: list[str]) -> None:
        self.extend(term)


@pytest.fixture
def driver_accumulator() -> Iterator[Accumulator[list[str]]]:
    """A driver-side accumulator, as ``SparkContext.accumulator`` registers one."""
    aid = 987_654
    accumulator = Accumulator(aid, [], EchoToStdout())
    try:
        yield accumulator
    finally:
        _accumulatorRegistry.pop(aid, None)


def _on_a_worker(accumulator: Accumulator[list[str]]) -> Accumulator[list[str]]:
    """``accumulator`` unpickled as a Python worker does: its registry lacks the driver's."""
    data = pickle.dumps(accumulator)
    driver_side = _accumulatorRegistry.pop(accumulator.aid)
    try:
        worker: Accumulator[list[str]] = pickle.loads(data)
    finally:
        _accumulatorRegistry[accumulator.aid] = driver_side
    return worker


def test_a_step_prints_into_one_piece_and_returns_its_result(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pieces = Pieces()

    def step() -> int:
        print("value 1")
        print("value", 2)
        return 7

    assert run_printing(step, pieces) == 7
    assert pieces == ["value 1\nvalue 2\n"]
    assert capsys.readouterr().out == ""


def test_a_step_that_prints_nothing_adds_nothing() -> None:
    pieces = Pieces()
    assert run_printing(lambda: 3, pieces) == 3
    assert pieces == []


def test_a_failed_steps_text_goes_where_it_would_have_and_the_error_propagates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pieces = Pieces()

    def step() -> None:
        print("before the failure")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_printing(step, pieces)
    assert pieces == []
    assert capsys.readouterr().out == "before the failure\n"


def test_without_lines_a_step_prints_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_printing(lambda: print("plain") or 1, None) == 1
    assert capsys.readouterr().out == "plain\n"


def test_the_accumulator_collects_on_the_worker_and_echoes_on_the_driver(
    driver_accumulator: Accumulator[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    worker = _on_a_worker(driver_accumulator)
    assert type(worker.accum_param) is TaskLines  # a task only collects
    for batch in range(3):
        run_printing(lambda b=batch: print(f"queue 0 batch {b}"), worker)
    assert capsys.readouterr().out == ""  # nothing printed on the worker
    # What PySpark's accumulator server does with a finished task's update.
    _accumulatorRegistry[driver_accumulator.aid] += worker._value
    captured = capsys.readouterr()
    assert captured.out == "queue 0 batch 0\nqueue 0 batch 1\nqueue 0 batch 2\n"
    assert captured.err == ""
    assert driver_accumulator.value == []  # written, not kept


def test_a_closed_stdout_never_fails_the_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr("sys.stdout", closed)
    assert EchoToStdout().addInPlace([], ["lost\n"]) == []


def _task_context(budget_s: float = 0.0) -> queues.TaskContext:
    stage = StageContext.of(wordcount.build(), 0, shuffle_queues=2, source_queues=(0, 1))
    return queues.TaskContext(
        stage=stage,
        rocketmq=RocketMQSettings(),
        group="g",
        layouts={},
        outage=OutagePolicy(budget_s=budget_s),
    )


def _rows(*queues: int) -> Iterator[pa.RecordBatch]:
    rows = [
        {"stage": 0, "queue_id": q, "start": 10 * q, "end": 10 * q + 3, "idle": None}
        for q in queues
    ]
    yield pa.RecordBatch.from_pylist(rows)


def test_the_spark_task_hands_each_queues_print_to_the_driver_in_order(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run_queue(ctx: Any, queue_id: int, start: int, end: int, _via: Any) -> TaskStats:
        for offset in range(start, end):
            print(f"q{queue_id} offset {offset}")  # a Print operator or a user's print()
        return TaskStats(queue_id=queue_id, end_offset=end)

    monkeypatch.setattr(queues, "run_stateless_queue", run_queue)
    pieces = Pieces()
    out = list(spark_task.task_fn({0: _task_context()}, stdout=pieces)(_rows(0, 1)))
    assert [b.to_pylist()[0]["queue_id"] for b in out] == [0, 1]
    assert pieces == [
        "q0 offset 0\nq0 offset 1\nq0 offset 2\n",
        "q1 offset 10\nq1 offset 11\nq1 offset 12\n",
    ]
    assert capsys.readouterr().out == ""


def test_only_the_attempt_that_succeeded_reaches_the_driver(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    attempts = []

    def run_queue(ctx: Any, queue_id: int, start: int, end: int, _via: Any) -> TaskStats:
        attempts.append(queue_id)
        print(f"attempt {len(attempts)}")
        if len(attempts) == 1:
            raise BrokerUnreachableError("broker", "127.0.0.1:1", "refused")
        return TaskStats(queue_id=queue_id, end_offset=end)

    monkeypatch.setattr(queues, "run_stateless_queue", run_queue)
    pieces = Pieces()
    ctx = _task_context(budget_s=5.0)
    list(spark_task.task_fn({0: ctx}, stdout=pieces)(_rows(0)))
    assert pieces == ["attempt 2\n"]
    assert capsys.readouterr().out == "attempt 1\n"  # the worker's own stdout, as before


def test_without_a_spark_context_the_task_leaves_prints_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run_queue(ctx: Any, queue_id: int, start: int, end: int, _via: Any) -> TaskStats:
        print("plain")
        return TaskStats(queue_id=queue_id, end_offset=end)

    monkeypatch.setattr(queues, "run_stateless_queue", run_queue)
    monkeypatch.setattr("pyspark.SparkContext._active_spark_context", None)
    list(spark_task.task_fn({0: _task_context()})(_rows(0)))
    assert capsys.readouterr().out == "plain\n"
