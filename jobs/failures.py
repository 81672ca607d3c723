"""How the operational jobs begin and fail: the topology they act on, and a Dagster Failure
whose description says what to do."""

import dagster as dg

from stream_assets.control.registry import REGISTRY, TOPOLOGY_TAG, TopologyRegistration


def failure(message: str) -> dg.Failure:
    """A job failure with ``message`` as the description the UI shows."""
    return dg.Failure(description=message)


def registered(name: str) -> TopologyRegistration:
    """The registration of topology ``name``, or a failure listing the registered ones."""
    if name not in REGISTRY:
        raise failure(
            f"unknown topology {name!r}; registered: {sorted(REGISTRY)}. Nothing was changed."
        )
    return REGISTRY[name]


def acting_on(context: dg.OpExecutionContext, name: str) -> TopologyRegistration:
    """:func:`registered`, and tag this run with the topology it acts on.

    A scale, stop, start or reset launched from the Launchpad has the topology
    only in its config; the tag shows it in the Runs list and filters by it,
    like the instance runs (and scheduled scale runs) it changes.

    Example::

        >>> reg = acting_on(context, "wordcount")  # doctest: +SKIP
        >>> context.run.tags["stream_assets/topology"]  # doctest: +SKIP
        'wordcount'
    """
    reg = registered(name)
    if context.run.tags.get(TOPOLOGY_TAG) != name:
        context.instance.add_run_tags(context.run_id, {TOPOLOGY_TAG: name})
    return reg
