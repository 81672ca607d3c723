"""Dagster jobs, ops, sensors and schedules of stream-assets."""

from jobs.roundtrip import roundtrip_job

__all__ = ["roundtrip_job"]
