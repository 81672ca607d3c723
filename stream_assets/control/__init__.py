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
- :mod:`~stream_assets.control.restore`: :func:`warm_queues`, the state of
  queues an instance gains brought up to date before the handover.

The package re-exports nothing: the engine imports ``topics`` and ``restore``
and must not load Dagster, which ``desired_state``, ``lineage`` and
``registry`` import. Import from the module that holds the name.

Example::

    >>> from stream_assets.control.allocation import allocate, topology_queues
    >>> from stream_assets.control.registry import REGISTRY
    >>> reg = REGISTRY["wordcount"]
    >>> queues = topology_queues(reg.topology(), source_queues=4, shuffle_queues=8)
    >>> allocate(queues, 3).for_instance(2)
    {'sourceTopic': [3], 'wordcount__shuffle__key_by-2': [6, 7]}
"""
