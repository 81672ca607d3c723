"""The control-run retry sensor on a real (temporary) Dagster instance: which stop, start and
scale runs it launches again, and which it leaves alone."""

from __future__ import annotations

from collections.abc import Iterator

import dagster as dg
import pytest

from stream_assets.jobs.control_retries import RETRIED_JOBS, RETRY_OF_TAG, control_run_retries
from stream_assets.jobs.lifecycle import start_topology_job, stop_topology_job
from stream_assets.jobs.scale import scale_job
from tests.unit.test_supervisor import _event


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def _run(instance: dg.DagsterInstance, job: dg.JobDefinition, topology: str) -> dg.DagsterRun:
    op = RETRIED_JOBS[job.name]
    config: dict[str, object] = {"topology": topology}
    if job is scale_job:
        config["target_instances"] = 2
    return instance.create_run_for_job(
        job, run_config={"ops": {op: {"config": config}}}, tags={"owner": "ops"}
    )


def _failed_unstarted(instance: dg.DagsterInstance, run: dg.DagsterRun) -> None:
    """As Dagster's queue fails a run whose launches never reached the code server."""
    _event(instance, run, dg.DagsterEventType.RUN_STARTING)
    instance.report_run_failed(run)


def _failed_started(instance: dg.DagsterInstance, run: dg.DagsterRun) -> None:
    _event(instance, run, dg.DagsterEventType.RUN_STARTING)
    _event(instance, run, dg.DagsterEventType.RUN_START)
    instance.report_run_failed(run)


def _tick(instance: dg.DagsterInstance) -> list[dg.RunRequest]:
    result = control_run_retries(dg.build_sensor_context(instance=instance))
    assert isinstance(result, dg.SensorResult)
    return list(result.run_requests or [])


def test_a_stop_that_never_started_is_launched_again_with_its_config(
    instance: dg.DagsterInstance,
) -> None:
    stop = _run(instance, stop_topology_job, "wc")
    _failed_unstarted(instance, stop)
    [retry] = _tick(instance)
    assert retry.job_name == "stop_topology_job"
    assert retry.run_config == stop.run_config
    assert retry.tags == {"owner": "ops", RETRY_OF_TAG: stop.run_id}
    # One retry per failed run: the run key makes a second tick's request a no-op.
    [again] = _tick(instance)
    assert again.run_key == retry.run_key


def test_a_retry_that_fails_to_start_is_retried_in_turn(instance: dg.DagsterInstance) -> None:
    first = _run(instance, scale_job, "wc")
    _failed_unstarted(instance, first)
    retry = _run(instance, scale_job, "wc")
    _failed_unstarted(instance, retry)
    assert [r.tags[RETRY_OF_TAG] for r in _tick(instance)] == [retry.run_id]


def test_a_later_command_supersedes_and_a_started_run_is_not_retried(
    instance: dg.DagsterInstance,
) -> None:
    stop = _run(instance, stop_topology_job, "wc")
    _failed_unstarted(instance, stop)
    _run(instance, start_topology_job, "wc")  # queued: the operator's newer word
    # Another topology's start ran its op, then failed: a real failure, not a lost command.
    _failed_started(instance, _run(instance, start_topology_job, "other"))
    assert _tick(instance) == []
