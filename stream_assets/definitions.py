"""The Dagster code location of stream-assets (loaded by workspace.yaml).

Per registered topology (``stream_assets.control.registry.REGISTRY``): its topics
as assets with lineage source -> topology -> shuffle/state/sinks, the instance
job the supervisor launches, the scale, reset, stop, start and upgrade jobs, the
supervisor and alert sensors, and the topology's scale schedules. Observability:
the topology checks (lag, dead letters, output freshness) with the sensor and
job that evaluate them, and the metrics sensor that observes the topology, sink
and source assets with topology totals (docs/operating.md, "Metrics and checks").
"""

import warnings

import dagster as dg

from stream_assets.control.lineage import lineage_asset_specs
from stream_assets.control.registry import REGISTRY
from stream_assets.jobs import all_scale_schedules, roundtrip_job
from stream_assets.jobs.alerts import instance_failure_alerts
from stream_assets.jobs.checks import TOPOLOGY_CHECKS, topology_checks_job, topology_checks_sensor
from stream_assets.jobs.control_retries import control_run_retries
from stream_assets.jobs.demo import wordcount_demo_job
from stream_assets.jobs.instance_job import instance_job
from stream_assets.jobs.lifecycle import start_topology_job, stop_topology_job
from stream_assets.jobs.metrics import topology_metrics_sensor
from stream_assets.jobs.reset import reset_job
from stream_assets.jobs.scale import scale_job
from stream_assets.jobs.state_query import state_query_job
from stream_assets.jobs.supervisor import supervisor_sensor
from stream_assets.jobs.upgrade import upgrade_job
from stream_assets.resources import RocketMQResource, RocksDBStateStoreResource, SparkResource

# Dagster 1.13 rebuilds every sensor whose job still needs this location's resources
# (SensorDefinition.with_attributes) and passes the sensor's owners on as [] instead of
# None; its beta check takes that for "owners given" and warns in every process that
# loads the location. No sensor here sets owners, so the warning says nothing about us.
warnings.filterwarnings(
    "ignore",
    message=r"Parameter `owners` of initializer `SensorDefinition\.__init__`",
    category=dg.BetaWarning,
)

defs = dg.Definitions(
    assets=lineage_asset_specs(reg.topology() for reg in REGISTRY.values()),
    asset_checks=TOPOLOGY_CHECKS,
    jobs=[
        roundtrip_job,
        wordcount_demo_job,
        instance_job,
        scale_job,
        state_query_job,
        reset_job,
        stop_topology_job,
        start_topology_job,
        upgrade_job,
        topology_checks_job,
    ],
    schedules=all_scale_schedules(REGISTRY.values(), scale_job),
    sensors=[
        supervisor_sensor,
        control_run_retries,
        instance_failure_alerts,
        topology_metrics_sensor,
        topology_checks_sensor,
    ],
    resources={
        "rocketmq": RocketMQResource(),
        "spark": SparkResource(),
        "state_store": RocksDBStateStoreResource(),
    },
)
