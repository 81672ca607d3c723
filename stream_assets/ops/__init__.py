"""The control plane Dagster drives: allocation, desired state, registry, lineage.

- :mod:`~stream_assets.ops.allocation`: :func:`allocate` queues to instances
  (RocketMQ's average strategy, or sticky), :func:`moves` between allocations.
- :mod:`~stream_assets.ops.desired_state`: :class:`DesiredStateStore` and run
  heartbeats, kept in the Dagster instance's storage.
- :mod:`~stream_assets.ops.registry`: :data:`REGISTRY` of deployed topologies,
  their scale schedules, and the run tag keys.
- :mod:`~stream_assets.ops.lineage`: topics and topologies as asset specs.

Example::

    >>> reg = REGISTRY["wordcount"]
    >>> queues = topology_queues(reg.topology(), source_queues=4, shuffle_queues=8)
    >>> allocate(queues, 3).for_instance(2)
    {'sourceTopic': [3], 'wordcount__shuffle__key_by-2': [6, 7]}
"""

from stream_assets.ops.allocation import (
    Allocation,
    Move,
    Strategy,
    allocate,
    average_share,
    changed_instances,
    moves,
    topology_queues,
)
from stream_assets.ops.desired_state import (
    DesiredState,
    DesiredStateStore,
    Heartbeat,
    heartbeats,
    record_heartbeat,
)
from stream_assets.ops.lineage import (
    lineage_asset_specs,
    topic_asset_key,
    topology_asset_key,
    topology_asset_specs,
)
from stream_assets.ops.registry import (
    GENERATION_TAG,
    INSTANCE_INDEX_TAG,
    REGISTRY,
    TARGET_INSTANCES_TAG,
    TOPOLOGY_TAG,
    ScaleSchedule,
    TopologyRegistration,
    registration,
)

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
    "ScaleSchedule",
    "Strategy",
    "TopologyRegistration",
    "allocate",
    "average_share",
    "changed_instances",
    "heartbeats",
    "lineage_asset_specs",
    "moves",
    "record_heartbeat",
    "registration",
    "topic_asset_key",
    "topology_asset_key",
    "topology_asset_specs",
    "topology_queues",
]
