"""Dagster operations against a real Dagster instance, daemon, broker and Spark.

A temporary DAGSTER_HOME, the project's instance config, and a real
``dagster-daemon`` running the supervisor sensor over the real code location
(``stream_assets.definitions``, with a WordCount registered under a fresh name
through ``STREAM_ASSETS_TOPOLOGIES``). Instance runs are real runs launched by
the default run launcher, each with its own SparkSession. The scale job runs
in this process against the same instance.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest

from stream_assets.control.desired_state import DesiredStateStore
from stream_assets.settings import RocketMQSettings
from tests.integration._dagster_env import dagster_deployment

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dagster_env(
    client_settings: RocketMQSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """DAGSTER_HOME, env for the code location, a running dagster-daemon."""
    home = tmp_path_factory.mktemp("dagster_home")
    with dagster_deployment(
        home, client_settings.namesrv_addr, STREAM_ASSETS_SUPERVISOR_INTERVAL_S="3"
    ) as deployment:
        yield {"home": home, "name": deployment.name, "instance": deployment.instance}


def _scale(
    instance: dg.DagsterInstance,
    target: int,
    topology: str,
    resources: dict[str, Any] | None = None,
) -> dg.ExecuteInProcessResult:
    from stream_assets.definitions import defs

    config: dict[str, Any] = {"topology": topology, "target_instances": target}
    run_config: dict[str, Any] = {"ops": {"scale": {"config": config}}}
    if resources:
        run_config["resources"] = resources
    return defs.get_job_def("scale_job").execute_in_process(
        run_config=run_config, instance=instance, raise_on_error=False
    )


def test_bad_scale_requests_fail_clearly_and_change_nothing(
    dagster_env: dict[str, Any],
) -> None:
    name, instance = dagster_env["name"], dagster_env["instance"]
    store = DesiredStateStore(instance)
    before = store.get(name)
    unreachable = {"rocketmq": {"config": {"namesrv_addr": "127.0.0.1:1", "request_timeout_s": 1}}}
    cases = [
        (_scale(instance, 2, "no-such-topology"), "unknown topology 'no-such-topology'"),
        (_scale(instance, -1, name), "target_instances must be 0 (stop) or more"),
        (
            _scale(instance, 1, name, resources=unreachable),
            "cannot reach RocketMQ name server at 127.0.0.1:1",
        ),
    ]
    for result, message in cases:
        assert not result.success
        failure = next(e for e in result.all_events if e.is_step_failure)
        assert message in str(failure.step_failure_data.error), failure.step_failure_data.error
    assert store.get(name) == before
