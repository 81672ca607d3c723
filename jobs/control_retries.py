"""A stop, start or scale that never started is launched again until one does.

Why a sensor of ours: on a loaded machine the code server can take minutes to
start, and Dagster then fails a queued run once its launch retries run out
(``run_queue: max_user_code_failure_retries``) or once it has sat in STARTING
past ``run_monitoring: start_timeout_seconds``. For an instance run the
supervisor launches another; an operator's stop or start would just be gone,
shown as "Failed to start". Dagster's own run retries do not cover it: the
daemon tries the retry at once, while the code server is still down, and gives
up on the first error. A sensor runs only once the code server answers, which is
exactly when a new launch can work.

What is retried: runs of the stop, start and scale jobs that ended FAILURE
without ever starting (no start time: no op of theirs ran, so nothing was
half done), within the last ``RETRY_WINDOW_S``, unless a later run of one of
those jobs for the same topology supersedes them (a retried stop must not undo
a newer start). Each failed run is retried once (its run key); a retry that
also fails to start is retried in turn. The sensor's log and the new run's
``stream_assets/retry_of`` tag say which run it replaces and why.

Example::

    >>> from stream_assets.jobs.control_retries import control_run_retries
    >>> control_run_retries.name
    'control_run_retries'
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime

import dagster as dg
from dagster._core.storage.dagster_run import RunRecord

from stream_assets.jobs.lifecycle import START_JOB, STOP_JOB, start_topology_job, stop_topology_job
from stream_assets.jobs.scale import SCALE_JOB, scale_job
from stream_assets.jobs.supervisor import failure_message, launch_failure

#: The op of each retried job whose config names the topology.
RETRIED_JOBS = {STOP_JOB: "stop_topology", START_JOB: "start_topology", SCALE_JOB: "scale"}
#: A run that failed to start longer ago than this is history, not a pending command.
RETRY_WINDOW_S = 6 * 3600.0
#: On the retry: the run it replaces.
RETRY_OF_TAG = "stream_assets/retry_of"
#: How often it looks: a lost command waits at most this long once the code server answers.
SENSOR_INTERVAL_S = 15


def topology_of(run: dg.DagsterRun) -> str | None:
    """The topology a stop, start or scale run acts on (from its run config)."""
    op = RETRIED_JOBS.get(run.job_name)
    try:
        name = run.run_config["ops"][op]["config"]["topology"]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def unstarted_failures(instance: dg.DagsterInstance, now: float) -> Iterator[RunRecord]:
    """Stop, start and scale runs that failed before they started and nothing superseded.

    Oldest first, one per topology at most (the newest command wins).
    """
    records = [
        record
        for job in RETRIED_JOBS
        for record in instance.get_run_records(
            filters=dg.RunsFilter(
                job_name=job,
                created_after=datetime.fromtimestamp(now - RETRY_WINDOW_S, UTC),
            )
        )
    ]
    newest: dict[str, RunRecord] = {}
    for record in records:
        name = topology_of(record.dagster_run)
        if name is not None and (name not in newest or record.storage_id > newest[name].storage_id):
            newest[name] = record
    for record in sorted(newest.values(), key=lambda r: r.storage_id):
        if record.dagster_run.status == dg.DagsterRunStatus.FAILURE and record.start_time is None:
            yield record


@dg.sensor(
    jobs=[stop_topology_job, start_topology_job, scale_job],
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches again a stop, start or scale run that failed before it started "
    "(a code server too slow to answer): the operator's command is not lost.",
)
def control_run_retries(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    """One pass: a retry for each stop/start/scale that never started and stands."""
    requests = []
    for record in unstarted_failures(context.instance, time.time()):
        run = record.dagster_run
        why = launch_failure(context.instance, record) or failure_message(
            context.instance, run.run_id, limit=200
        )
        context.log.warning(
            f"{run.job_name} run {run.run_id} for {topology_of(run)} failed before it started "
            f"({why}): launching it again"
        )
        requests.append(
            dg.RunRequest(
                run_key=f"retry-of:{run.run_id}",
                job_name=run.job_name,
                run_config=run.run_config,
                tags={**_user_tags(run), RETRY_OF_TAG: run.run_id},
            )
        )
    return dg.SensorResult(
        run_requests=requests, skip_reason=None if requests else "every command started"
    )


def _user_tags(run: dg.DagsterRun) -> dict[str, str]:
    """The run's own tags, without Dagster's (``dagster/...``: its launch bookkeeping)."""
    return {k: v for k, v in run.tags.items() if not k.startswith(("dagster/", ".dagster"))}
