"""How the operational jobs fail: a Dagster Failure whose description says what to do."""

import dagster as dg

from stream_assets.control.registry import REGISTRY, TopologyRegistration


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
