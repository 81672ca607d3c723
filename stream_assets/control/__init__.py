"""The control plane Dagster drives: allocation, desired state, registry, lineage, topics, restores.

- :mod:`~stream_assets.control.allocation`: :func:`allocate` queues to instances
  (RocketMQ's average strategy, or sticky), :func:`moves` between allocations.
- :mod:`~stream_assets.control.desired_state`: :class:`DesiredStateStore` and run
  heartbeats, kept in the Dagster instance's storage.
- :mod:`~stream_assets.control.registry`: :data:`REGISTRY` of deployed topologies,
  their scale schedules, and the run tag keys.
- :mod:`~stream_assets.control.lineage`: topics and topologies as asset specs.
- :mod:`~stream_assets.control.topics`: :func:`provision_topics`, a topology's
  topics on the broker, provisioned before a scale and before an instance starts.
- :mod:`~stream_assets.control.restore`: :func:`restore_queues`, the state of
  moved queues rebuilt before their new owner starts.

The names below are imported on first use, not with the package: the engine
imports ``topics`` and ``restore``, and must not load Dagster (which
``desired_state``, ``lineage`` and ``registry`` import) for that.

Example::

    >>> from stream_assets.control import REGISTRY, allocate, topology_queues
    >>> reg = REGISTRY["wordcount"]
    >>> queues = topology_queues(reg.topology(), source_queues=4, shuffle_queues=8)
    >>> allocate(queues, 3).for_instance(2)
    {'sourceTopic': [3], 'wordcount__shuffle__key_by-2': [6, 7]}
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stream_assets.control.allocation import (
        Allocation,
        Move,
        Strategy,
        allocate,
        average_share,
        changed_instances,
        moves,
        topology_queues,
    )
    from stream_assets.control.desired_state import (
        DesiredState,
        DesiredStateStore,
        Heartbeat,
        heartbeats,
        record_heartbeat,
    )
    from stream_assets.control.lineage import (
        lineage_asset_specs,
        topic_asset_key,
        topology_asset_key,
        topology_asset_specs,
    )
    from stream_assets.control.registry import (
        GENERATION_TAG,
        INSTANCE_INDEX_TAG,
        REGISTRY,
        TARGET_INSTANCES_TAG,
        TOPOLOGY_TAG,
        ScaleSchedule,
        TopologyRegistration,
        registration,
    )
    from stream_assets.control.restore import RestoredQueue, restore_queues
    from stream_assets.control.topics import (
        ProvisionedTopics,
        SourceTopicNotFoundError,
        provision_topics,
    )

# Searched in this order, the Dagster-free modules first, so that looking up an
# engine-side name never imports Dagster.
_SUBMODULES = ("allocation", "topics", "restore", "desired_state", "lineage", "registry")

__all__ = [
    "GENERATION_TAG",
    "INSTANCE_INDEX_TAG",
    "REGISTRY",
    "TARGET_INSTANCES_TAG",
    "TOPOLOGY_TAG",
    "Allocation",
    "DesiredState",
    "DesiredStateStore",
    "Heartbeat",
    "Move",
    "ProvisionedTopics",
    "RestoredQueue",
    "ScaleSchedule",
    "SourceTopicNotFoundError",
    "Strategy",
    "TopologyRegistration",
    "allocate",
    "average_share",
    "changed_instances",
    "heartbeats",
    "lineage_asset_specs",
    "moves",
    "provision_topics",
    "record_heartbeat",
    "registration",
    "restore_queues",
    "topic_asset_key",
    "topology_asset_key",
    "topology_asset_specs",
    "topology_queues",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        for submodule in _SUBMODULES:
            module = importlib.import_module(f"{__name__}.{submodule}")
            if name in vars(module):
                value = vars(module)[name]
                globals()[name] = value
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
