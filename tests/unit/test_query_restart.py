"""A query that died starting its Python worker is started again; anything else ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from stream_assets.examples import wordcount
from stream_assets.runtime.spark.instance import Instance
from stream_assets.runtime.spark.query_restart import RestartBudget, restartable
from stream_assets.settings import EngineSettings, RocketMQSettings

CONNECT_BACK = "org.apache.spark.SparkException: Python worker failed to connect back.\n\tat ..."


class FakeQuery:
    def __init__(self, name: str, exc: str | None = None) -> None:
        self.name, self._exc, self.stopped = name, exc, False

    def exception(self) -> str | None:
        return self._exc

    def stop(self) -> None:
        self.stopped = True


def _named(stages: Any) -> str:
    return "-".join(str(s.index) for s in stages)


def _instance(
    queries: list[FakeQuery], query_per_stage: bool = True
) -> tuple[Instance, list[str], list[str]]:
    said: list[str] = []
    inst = Instance(
        wordcount.build(),
        rocketmq=RocketMQSettings(),
        engine=EngineSettings(query_per_stage=query_per_stage, mode="micro-batch"),
        progress=said.append,
    )
    started: list[str] = []

    def start_query(stages: Any) -> FakeQuery:
        started.append(_named(stages))
        return FakeQuery(f"restarted-{_named(stages)}")

    inst._start_query = start_query  # type: ignore[method-assign]
    inst._queries = list(queries)
    return inst, started, said


def test_a_worker_that_did_not_connect_back_restarts_that_query_only() -> None:
    failed = FakeQuery("stage-1", CONNECT_BACK)
    inst, started, said = _instance([FakeQuery("stage-0"), failed])
    inst.check_failed()
    assert failed.stopped
    assert started == ["1"]
    assert [q.name for q in inst._queries] == ["stage-0", "restarted-1"]
    assert said[-1].startswith("stage 1: ")
    assert "starting the query again" in said[-1] and "connect back" in said[-1]


def test_by_default_one_query_runs_every_stage_and_restarts_as_one() -> None:
    failed = FakeQuery("stages-0-1", CONNECT_BACK)
    inst, started, said = _instance([failed], query_per_stage=False)
    inst.check_failed()
    assert failed.stopped and started == ["0-1"]
    assert said[-1].startswith("stages 0, 1: ") and "starting the query again" in said[-1]


def test_other_failures_end_the_instance() -> None:
    inst, started, _ = _instance([FakeQuery("stage-0", "fenced: generation 4 took over")])
    with pytest.raises(RuntimeError, match="stage-0 failed: fenced"):
        inst.check_failed()
    assert started == []


def test_restarts_are_bounded_then_the_failure_surfaces() -> None:
    inst, started, _ = _instance([FakeQuery("stage-0", CONNECT_BACK)])
    budget = inst._restarts[0].max_restarts
    for _ in range(budget):
        inst._queries[0] = FakeQuery("stage-0", CONNECT_BACK)
        inst.check_failed()
    inst._queries[0] = FakeQuery("stage-0", CONNECT_BACK)
    with pytest.raises(RuntimeError, match="connect back"):
        inst.check_failed()
    assert started == ["0"] * budget


def test_nothing_is_restarted_while_stopping() -> None:
    inst, started, _ = _instance([FakeQuery("stage-0", CONNECT_BACK)])
    inst._stopping.set()
    inst.check_failed()
    assert started == []


def test_a_start_that_fails_on_the_worker_is_tried_again() -> None:
    inst, _, said = _instance([])
    attempts: list[int] = []

    def start_query(stages: Any) -> FakeQuery:
        attempts.append(stages[0].index)
        if len(attempts) < 3:
            raise RuntimeError(CONNECT_BACK)
        return FakeQuery(f"started-{_named(stages)}")

    inst._start_query = start_query  # type: ignore[method-assign]
    query = inst._start_query_retrying(0)
    assert query.name == "started-0" and attempts == [0, 0, 0]
    assert len(said) == 2


def test_every_start_attempt_is_reported_as_the_step_under_way() -> None:
    """A start blocks the run's loop: its heartbeat says so, attempt by attempt."""
    inst, _, _ = _instance([], query_per_stage=False)
    events: list[str] = []

    @contextlib.contextmanager
    def busy(what: str) -> Iterator[None]:
        events.append(what)
        try:
            yield
        finally:
            events.append("done")

    inst.busy = busy

    def start_query(stages: Any) -> FakeQuery:
        events.append("start")
        if events.count("start") < 3:
            raise RuntimeError(CONNECT_BACK)
        return FakeQuery(f"started-{_named(stages)}")

    inst._start_query = start_query  # type: ignore[method-assign]
    inst._start_query_retrying(0)
    step = "starting the query of stages 0, 1"
    assert events == [
        *(step, "start", "done"),
        *(f"{step} (attempt 2)", "start", "done"),
        *(f"{step} (attempt 3)", "start", "done"),
    ]


def test_a_start_that_fails_otherwise_is_not_retried() -> None:
    inst, _, _ = _instance([])

    def start_query(stages: Any) -> FakeQuery:
        raise ValueError("no such topic")

    inst._start_query = start_query  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="no such topic"):
        inst._start_query_retrying(0)


def test_budget_window_forgets_old_restarts() -> None:
    budget = RestartBudget(max_restarts=1, window_s=10.0)
    assert budget.allow(0.0)
    assert not budget.allow(5.0)
    assert budget.allow(10.5)


def test_restartable_matches_both_spark_messages() -> None:
    assert restartable("Timed out while waiting for the Python worker to connect back")
    assert not restartable(ValueError("cannot encode set"))
