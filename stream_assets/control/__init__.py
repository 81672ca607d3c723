"""The control plane Dagster drives: allocation, desired state, registry, lineage, resets.

- :mod:`~stream_assets.control.allocation`: :func:`allocate` queues to instances
  (RocketMQ's average strategy, or sticky), :func:`moves` between allocations.
- :mod:`~stream_assets.control.desired_state`: :class:`DesiredStateStore` and run
  heartbeats, kept in the Dagster instance's storage.
- :mod:`~stream_assets.control.registry`: :data:`REGISTRY` of deployed topologies,
  their scale schedules, and the run tag keys.
- :mod:`~stream_assets.control.lineage`: topics and topologies as asset specs.

Nothing the engine (:mod:`stream_assets.runtime`) runs lives here: a
topology's topics are provisioned by :mod:`stream_assets.rocketmq.provision`,
and the stores of queues an instance gains are warmed by
:mod:`stream_assets.runtime.drive.warm_up`. The package re-exports nothing:
``desired_state``, ``lineage`` and ``registry`` load Dagster, which a module
imported on its own need not. Import from the module that holds the name.

Example::

    >>> from stream_assets.control.allocation import allocate, topology_queues
    >>> from stream_assets.control.registry import REGISTRY
    >>> reg = REGISTRY["wordcount"]
    >>> queues = topology_queues(reg.topology(), source_queues=4, shuffle_queues=8)
    >>> allocate(queues, 3).for_instance(2)
    {'sourceTopic': [3], 'wordcount__shuffle__aggregate': [6, 7]}
"""
