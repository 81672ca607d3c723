"""The Dagster code location of stream-assets (loaded by workspace.yaml).

Per registered topology (``stream_assets.control.registry.REGISTRY``): its topics
as assets with lineage source -> topology -> shuffle/state/sinks, the instance
job the supervisor launches, the scale and reset jobs, and the topology's scale
schedules.
"""

import dagster as dg

from jobs import all_scale_schedules, roundtrip_job
from jobs.demo import wordcount_demo_job
from jobs.instance_job import instance_job
from jobs.reset import reset_job
from jobs.scale import scale_job
from jobs.state_query import state_query_job
from jobs.supervisor import supervisor_sensor
from resources import RocketMQResource, RocksDBStateStoreResource, SparkResource
from stream_assets.control.lineage import lineage_asset_specs
from stream_assets.control.registry import REGISTRY

defs = dg.Definitions(
    assets=lineage_asset_specs(reg.topology() for reg in REGISTRY.values()),
    jobs=[roundtrip_job, wordcount_demo_job, instance_job, scale_job, state_query_job, reset_job],
    schedules=all_scale_schedules(REGISTRY.values(), scale_job),
    sensors=[supervisor_sensor],
    resources={
        "rocketmq": RocketMQResource(),
        "spark": SparkResource(),
        "state_store": RocksDBStateStoreResource(),
    },
)
