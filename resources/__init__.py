"""Dagster resources of stream-assets (ConfigurableResources over the engine's clients)."""

from resources.rocketmq import RocketMQResource

__all__ = ["RocketMQResource"]
