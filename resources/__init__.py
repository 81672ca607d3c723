"""Dagster resources of stream-assets (ConfigurableResources over the engine's clients)."""

from resources.rocketmq import RocketMQResource
from resources.spark import SparkResource
from resources.state_store import QueueStateStats, RocksDBStateStoreResource

__all__ = ["QueueStateStats", "RocketMQResource", "RocksDBStateStoreResource", "SparkResource"]
