"""Dagster resources of stream-assets (ConfigurableResources over the engine's clients)."""

from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.resources.spark import SparkResource
from stream_assets.resources.state_store import QueueStateStats, RocksDBStateStoreResource

__all__ = ["QueueStateStats", "RocketMQResource", "RocksDBStateStoreResource", "SparkResource"]
