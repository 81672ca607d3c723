"""Topology checks against the real broker, evaluated by Dagster in this process.

A topology with a backlog and no instance running fails its lag check; an
instance drains it and the check passes. A poison record (an integer beyond 64
bits: the shuffle cannot encode it) fails the dead-letter check (a warning) and
raises one alert to the hooks; the next evaluations, with nothing new, keep the
check failed (the dead letter is younger than a day) and alert nobody again.
Evaluations alternate between the two paths the code location uses: the
checks job (a run, ``execute_in_process``) and the checks sensor (reported
evaluations, as the daemon stores them), both reading the previous evaluation
from the same Dagster instance. No instance run failed: the crash check passes.
"""

import json
import random
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from stream_assets.control.alerts import Alert
from stream_assets.control.desired_state import DesiredState, DesiredStateStore
from stream_assets.control.lineage import lineage_asset_specs
from stream_assets.control.metrics import instance_numbers
from stream_assets.control.registry import TopologyRegistration
from stream_assets.jobs.checks import (
    CRASHES,
    DEAD_LETTERS,
    FRESH,
    LAG,
    build_checks_sensor,
    topology_checks,
)
from stream_assets.resources import RocketMQResource
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.settings import CheckSettings, RocketMQSettings
from tests.integration._engine_util import Message, produce, totals_topology
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

MAX_LAG = 50

#: Alerts the hooks received (STREAM_ASSETS_ALERT_HOOKS=tests.integration.test_checks:record).
ALERTS: list[Alert] = []


def record(alert: Alert) -> None:
    """An alert hook for this test."""
    ALERTS.append(alert)


def _passed(evaluations: Sequence[dg.AssetCheckEvaluation]) -> dict[str, bool]:
    return {e.check_name.split("__", 1)[1]: e.passed for e in evaluations}


def test_lag_and_dead_letter_checks_fail_then_pass(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAM_ASSETS_ALERT_HOOKS", "tests.integration.test_checks:record")
    ALERTS.clear()
    job = f"ck_{uuid.uuid4().hex[:10]}"
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 2)
    registration = TopologyRegistration(job, lambda: totals_topology(job, source, sink))
    topology = registration.topology()
    settings = CheckSettings(max_lag=MAX_LAG, fresh_within_s=600)
    checks = topology_checks(topology, settings)
    rocketmq = RocketMQResource(namesrv_addr=client_settings.namesrv_addr)
    defs = dg.Definitions(
        assets=lineage_asset_specs([topology]),
        asset_checks=[checks],
        jobs=[dg.define_asset_job("ck_checks_job", selection=dg.AssetSelection.checks(checks))],
        resources={"rocketmq": rocketmq},
    )
    sensor = build_checks_sensor({job: registration}, settings, name="ck_checks_sensor")
    instance = dg.DagsterInstance.ephemeral()
    # Deployed (one instance wanted), but nothing runs it: no daemon, no supervisor.
    DesiredStateStore(instance).set(job, DesiredState(1))

    def by_job() -> dict[str, bool]:
        result = defs.resolve_job_def("ck_checks_job").execute_in_process(instance=instance)
        assert result.success
        return _passed(result.get_asset_check_evaluations())

    def by_sensor() -> tuple[dict[str, bool], dict[str, Any]]:
        context = dg.build_sensor_context(instance=instance, resources={"rocketmq": rocketmq})
        result = sensor(context)
        assert isinstance(result, dg.SensorResult)
        evaluations = [e for e in result.asset_events if isinstance(e, dg.AssetCheckEvaluation)]
        for evaluation in evaluations:  # what the daemon does with a sensor's asset events
            instance.report_runless_asset_event(evaluation)
        details = {e.check_name.split("__", 1)[1]: e for e in evaluations}
        return _passed(evaluations), details

    rnd = random.Random(11)
    events = [{"word": rnd.choice("abcde"), "n": rnd.randint(1, 9)} for _ in range(300)]
    bodies = [json.dumps(e).encode() for e in events]
    produce(client_settings, source, [Message(b, queue_id=i % 2) for i, b in enumerate(bodies)])

    # A backlog of 300 with no instance: the lag check fails. The dead-letter
    # check records its baseline; the input is new, so the sink is not overdue.
    assert by_job() == {CRASHES: True, LAG: False, DEAD_LETTERS: True, FRESH: True}

    # One poison record among the backlog, then an instance drains it all.
    produce(client_settings, source, [Message(json.dumps({"word": "a", "n": 2**70}).encode())])
    inst = engine.start(engine.instance(topology, tmp_path / "state"))
    inst.await_caught_up(120)
    # What this instance would report (the numbers _observe logs), from its real metrics.
    numbers = instance_numbers(
        topology,
        {i: dict(m.totals) for i, m in inst.metrics.items()},
        inst.state_size(),
        inst.lag_by_queue(),
    )
    assert (numbers.records_in, numbers.dead_letters, numbers.lag) == (301, 1, 0)
    assert numbers.records_out > 0 and numbers.state_keys > 0
    engine.stop(inst)

    passed, details = by_sensor()
    assert passed == {CRASHES: True, LAG: True, DEAD_LETTERS: False, FRESH: True}
    assert details[DEAD_LETTERS].severity == dg.AssetCheckSeverity.WARN
    assert details[DEAD_LETTERS].metadata["new_dead_letters"].value == 1
    assert details[LAG].metadata["lag"].value == 0
    assert details[FRESH].metadata["output_age_s"].value < 120
    (alert,) = ALERTS  # the batch of one dead letter, alerted once
    assert (alert.kind, alert.topology, alert.dead_letters) == ("dead_letters", job, 1)

    # Nothing new since: both paths agree; the dead letter (minutes old) still fails its
    # check, as a warning, and alerts nobody again.
    assert by_job() == {CRASHES: True, LAG: True, DEAD_LETTERS: False, FRESH: True}
    passed, details = by_sensor()
    assert passed == {CRASHES: True, LAG: True, DEAD_LETTERS: False, FRESH: True}
    assert details[DEAD_LETTERS].metadata["new_dead_letters"].value == 0
    assert len(ALERTS) == 1

    # The evaluations are stored on the assets, as the UI shows them.
    summaries = instance.event_log_storage.get_asset_check_summary_records(list(checks.check_keys))
    assert all(s.last_completed_check_execution_record is not None for s in summaries.values())
