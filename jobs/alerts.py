"""The alert path: every failed instance run becomes an Alert, in Dagster and to user hooks.

``instance_failure_alerts`` is a run-failure sensor on the instance job. For
each failed instance run (its op raised, its process was killed and the
supervisor marked it failed, or it hung and was terminated) it:

- logs one clear line (``instance 1 of wordcount failed (run 3f2a...): ...``);
- reports the topology's crash check (``<job>__no_recent_crashes``, on its
  asset; :func:`~jobs.checks.crash_alert_outcome`) *failed*, severity ERROR,
  with that line as its description and the instance, run id, failure, crash
  count in the window and alert kind (text where they are labels) as metadata;
- calls every hook in ``STREAM_ASSETS_ALERT_HOOKS`` with the
  :class:`~stream_assets.control.alerts.Alert`.

A run that failed because Dagster could not reach its code server to launch it
(:func:`~jobs.supervisor.launch_failure`) is a ``launch_failed`` alert: a
warning line and the hooks, but not a crash and not the crash check.

Why a failed check and not an observation: the topology asset gets several
metric observations a minute, and an alert among them looked like one more
(its instance index even became a plot). A failed check is drawn as one
everywhere the UI shows the asset: a red check on the asset page and its
graph node, and the Checks tab with the alert's line and history. It stays
failed through the crash window; the checks sensor passes it once no run of
the topology has failed for that long (jobs/checks.py).

When the failure is the one that engages the supervisor's crash-loop backoff
(two or more consecutive failures of the index within ``crash_window_s``), the
alert is a ``crash_loop`` carrying the wait before the next attempt: a crash
loop raises an alert per failure, never one per supervisor tick.

Example (what a hook receives)::

    >>> alert = alert_for(instance, failed_run, time.time(), SupervisorSettings())  # doctest: +SKIP
    >>> alert.kind, alert.crashes, alert.retry_in_s  # doctest: +SKIP
    ('crash_loop', 3, 30.0)
"""

import logging
import time

import dagster as dg

from stream_assets.control.alerts import Alert, notify
from stream_assets.control.desired_state import KEY_PREFIX
from stream_assets.control.registry import TOPOLOGY_TAG
from stream_assets.jobs.checks import crash_alert_outcome
from stream_assets.jobs.instance_job import instance_job
from stream_assets.jobs.supervisor import (
    SENSOR_INTERVAL_S,
    crash_history,
    failure_message,
    launch_failure,
    run_index,
)
from stream_assets.settings import SupervisorSettings


def alert_for(
    instance: dg.DagsterInstance, run: dg.DagsterRun, now: float, settings: SupervisorSettings
) -> Alert:
    """The alert for failed instance run ``run``: a crash, or a crash loop if it engages backoff.

    Example::

        >>> inst = dg.DagsterInstance.ephemeral()
        >>> run = inst.create_run_for_job(instance_job, tags={
        ...     "stream_assets/topology": "wc", "stream_assets/instance": "0"},
        ...     run_config={"ops": {"run_instance": {"config": {"topology": "wc"}}}})
        >>> _ = inst.report_run_failed(run, "boom")
        >>> alert_for(inst, run, time.time(), SupervisorSettings()).describe()
        'instance 0 of wc failed (run ...): boom'
    """
    topology = run.tags.get(TOPOLOGY_TAG, "")
    index = run_index(run)
    record = instance.get_run_record_by_id(run.run_id)
    refused = launch_failure(instance, record) if record is not None else None
    history = crash_history(instance, topology, index, now, settings)
    if refused is not None:
        return Alert(topology, index, run.run_id, refused, history.in_window, "launch_failed")
    # The run just failed: it is in the window even if its end time is a tick old.
    crashes = max(history.in_window, 1)
    backoff = history.backoff_s(settings) if history.last_run_id == run.run_id else 0.0
    return Alert(
        topology=topology,
        instance=index,
        run_id=run.run_id,
        message=failure_message(instance, run.run_id),
        crashes=crashes,
        kind="crash_loop" if backoff > 0 else "crash",
        retry_in_s=max(0.0, history.retry_at(settings) - now) if backoff > 0 else 0.0,
    )


def raise_alert(
    instance: dg.DagsterInstance, alert: Alert, settings: SupervisorSettings, log: logging.Logger
) -> None:
    """Log ``alert``, fail the topology's crash check with it, and call the hooks.

    Example::

        >>> inst, log = dg.DagsterInstance.ephemeral(), logging.getLogger("doctest")
        >>> log.addHandler(logging.NullHandler())
        >>> raise_alert(inst, Alert("wc", 0, "3f2a", "boom", 1), SupervisorSettings(), log)
        >>> from stream_assets.jobs.checks import crash_check_key
        >>> key = crash_check_key("wc")
        >>> record = inst.event_log_storage.get_asset_check_summary_records([key])[key]
        >>> evaluation = record.last_check_execution_record.event.asset_check_evaluation
        >>> evaluation.passed, evaluation.severity.value, evaluation.description
        (False, 'ERROR', 'instance 0 of wc failed (run 3f2a): boom (1 failed run(s) within 10 min)')
    """
    if alert.kind == "launch_failed":
        # Dagster's code server, not the instance: said, passed on, but not a crash.
        log.warning(alert.describe())
    else:
        log.error(alert.describe())
        outcome = crash_alert_outcome(alert, settings.crash_window_s)
        instance.report_runless_asset_event(outcome.evaluation())
    notify(alert, settings.alert_hooks, log.error)


@dg.run_failure_sensor(
    name="instance_failure_alerts",
    monitored_jobs=[instance_job],
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Alerts on every failed instance run (and on crash loops): a log line, the "
    "topology's crash check failed with it, and the STREAM_ASSETS_ALERT_HOOKS callables.",
)
def instance_failure_alerts(context: dg.RunFailureSensorContext) -> None:
    """One alert per failed instance run."""
    run = context.dagster_run
    if TOPOLOGY_TAG not in run.tags:
        return  # an instance run started by hand without tags: no topology to alert about
    if not first_alert(context.instance, run.run_id):
        return  # a second failure event of the same run (see first_alert)
    settings = SupervisorSettings()
    alert = alert_for(context.instance, run, time.time(), settings)
    raise_alert(context.instance, alert, settings, context.log)


def first_alert(instance: dg.DagsterInstance, run_id: str) -> bool:
    """Whether this is the first alert about run ``run_id`` (and remember that it was made).

    A killed run can be reported failed twice: by the supervisor, and by
    Dagster's code server, which notices its run worker died; the sensor sees
    both events. One alert per run is kept in the Dagster instance's key-value
    store, beside the heartbeats.

    Example::

        >>> inst = dg.DagsterInstance.ephemeral()
        >>> first_alert(inst, "3f2a"), first_alert(inst, "3f2a")
        (True, False)
    """
    key = f"{KEY_PREFIX}alerted/{run_id}"
    storage = instance.daemon_cursor_storage
    if storage.get_cursor_values({key}).get(key):
        return False
    storage.set_cursor_values({key: str(time.time())})
    return True
