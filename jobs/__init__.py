"""Dagster jobs, ops, sensors and schedules of stream-assets."""

from stream_assets.jobs.roundtrip import roundtrip_job
from stream_assets.jobs.schedules import all_scale_schedules, scale_run_config, scale_schedules

__all__ = ["all_scale_schedules", "roundtrip_job", "scale_run_config", "scale_schedules"]
