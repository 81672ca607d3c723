"""The Dagster code location of stream-assets (loaded by workspace.yaml)."""

from __future__ import annotations

import dagster as dg

from jobs import roundtrip_job
from resources import RocketMQResource

defs = dg.Definitions(
    jobs=[roundtrip_job],
    resources={"rocketmq": RocketMQResource()},
)
