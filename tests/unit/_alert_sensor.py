"""One tick of the run-failure alert sensor, as the daemon makes it, for unit tests."""

from __future__ import annotations

import dagster as dg

from stream_assets.jobs.alerts import instance_failure_alerts


def alert_sensor_tick(instance: dg.DagsterInstance, run: dg.DagsterRun) -> None:
    """Evaluate ``instance_failure_alerts`` on ``run``'s RUN_FAILURE event."""
    failure = next(
        e.dagster_event
        for e in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
    )
    assert failure is not None
    context = dg.build_run_status_sensor_context(
        sensor_name="instance_failure_alerts",
        dagster_event=failure,
        dagster_instance=instance,
        dagster_run=run,
    ).for_run_failure()
    instance_failure_alerts(context)
