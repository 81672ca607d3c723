"""The scale job's phases wait on progress, not on a fixed time (real Dagster instance).

A phase gives up only after ``start_timeout_s`` in which no instance it waits for
answered or moved on (began a step, went round its loop): a cold start that takes
several timeouts on a busy machine still finishes, a run hung in one step does not
hold the scale forever.
"""

import threading
import time
import uuid
from collections.abc import Iterator

import dagster as dg
import pytest

from stream_assets.control.desired_state import record_heartbeat
from stream_assets.control.registry import GENERATION_TAG, INSTANCE_INDEX_TAG, TOPOLOGY_TAG
from stream_assets.jobs.instance_job import INSTANCE_JOB
from stream_assets.jobs.scale import ScaleConfig, _await

TIMEOUT_S = 2.0


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def _run(instance: dg.DagsterInstance, index: int) -> str:
    run_id = uuid.uuid4().hex
    instance.add_run(
        dg.DagsterRun(
            job_name=INSTANCE_JOB,
            run_id=run_id,
            status=dg.DagsterRunStatus.STARTED,
            tags={TOPOLOGY_TAG: "wc", GENERATION_TAG: "2", INSTANCE_INDEX_TAG: str(index)},
        )
    )
    return run_id


def _warm_up(
    instance: dg.DagsterInstance, run_id: str, steps: int, answer: bool, stop: threading.Event
) -> None:
    """Heartbeat as a slow cold start does: ``steps`` steps of a quarter of the timeout
    each (a margin for a busy machine), then (``answer``) warmed up for generation 2;
    without new steps it keeps beating in the last."""
    for step in range(steps):
        record_heartbeat(instance, "wc", 1, 0, run_id, busy=f"step {step}", busy_since=time.time())
        if stop.wait(TIMEOUT_S / 4):
            return
    since = time.time()
    while not stop.is_set():
        warmed = 2 if answer else -1
        record_heartbeat(
            instance, "wc", 1, 0, run_id, busy="last step", busy_since=since, warmed=warmed
        )
        stop.wait(0.05)


def _phase(instance: dg.DagsterInstance, steps: int, answer: bool) -> tuple[float, str]:
    """Wait for phase warm of instance 0; (seconds waited, the failure's text or "")."""
    run_id = _run(instance, 0)
    stop = threading.Event()
    feeder = threading.Thread(target=_warm_up, args=(instance, run_id, steps, answer, stop))
    feeder.start()
    context = dg.build_op_context(instance=instance)
    config = ScaleConfig(topology="wc", target_instances=1, start_timeout_s=TIMEOUT_S)
    began = time.monotonic()
    try:
        _await(context, config, "warm", [0], generation=2)
        outcome = ""
    except dg.Failure as exc:
        outcome = exc.description or ""
    finally:
        stop.set()
        feeder.join()
    return time.monotonic() - began, outcome


def test_a_phase_waits_as_long_as_its_instance_moves_on(instance: dg.DagsterInstance) -> None:
    # Ten steps of a quarter of the timeout: 2.5 timeouts in all, never one without progress.
    waited, outcome = _phase(instance, steps=10, answer=True)
    assert outcome == ""
    assert waited > 2 * TIMEOUT_S


def test_a_phase_gives_up_on_an_instance_stuck_in_one_step(instance: dg.DagsterInstance) -> None:
    # It goes on beating (its heartbeat thread runs) but never begins another step.
    waited, outcome = _phase(instance, steps=2, answer=False)
    assert "phase 'warm' not reached" in outcome and "moved on" in outcome, outcome
    assert "start_timeout_s" in outcome
    assert waited >= TIMEOUT_S
