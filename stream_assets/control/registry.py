"""The topologies Dagster operates, with their default size and scale schedules.

A :class:`TopologyRegistration` names a topology (its job id), how to build it,
how many instances it starts with and when to rescale it. :data:`REGISTRY`
holds the example topologies; the Definitions derive assets, schedules and the
supervisor's work list from it. The run tag keys every stream-assets run
carries are here too, so the sensor, the jobs and the schedules agree on them.

Example::

    >>> reg = REGISTRY["wordcount"]
    >>> reg.topology().source_topic, reg.default_instances
    ('sourceTopic', 1)
    >>> [(s.cron, s.target_instances) for s in reg.schedules]
    [('0 8 * * 1-5', 2), ('0 20 * * 1-5', 1)]
"""

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dagster._utils.schedules import is_valid_cron_string

from stream_assets.control.allocation import STRATEGIES, Strategy
from stream_assets.examples import EXAMPLES
from stream_assets.plan.topology import Topology, validate_name

#: Run tag: the topology (job id) a run belongs to.
TOPOLOGY_TAG = "stream_assets/topology"
#: Run tag: the allocation generation an instance run serves.
GENERATION_TAG = "stream_assets/generation"
#: Run tag: the instance index (position in the allocation) of an instance run.
INSTANCE_INDEX_TAG = "stream_assets/instance"
#: Run tag, ``"true"`` on an instance run that owns no queue (more instances than queues),
#: so the Dagster UI's run list shows idle instances as such.
IDLE_TAG = "stream_assets/idle"
#: Run tag: the instance count a scale run was asked for.
TARGET_INSTANCES_TAG = "stream_assets/target_instances"


@dataclass(frozen=True)
class ScaleSchedule:
    """Scale a topology to ``target_instances`` whenever ``cron`` fires (in ``timezone``).

    Example::

        >>> ScaleSchedule("0 8 * * 1-5", 4).target_instances
        4
    """

    cron: str
    target_instances: int
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        if not is_valid_cron_string(self.cron):
            raise ValueError(f"{self.cron!r} is not a valid cron schedule")
        if self.target_instances < 1:
            raise ValueError(f"target_instances must be >= 1, got {self.target_instances}")


@dataclass(frozen=True)
class TopologyRegistration:
    """A topology Dagster deploys: ``name`` is its job id (and consumer group).

    ``build`` is called whenever the topology is needed (cheap: it only builds
    the plan), so registering costs nothing at import time.

    Example::

        >>> from stream_assets.examples import windowed_sum
        >>> reg = TopologyRegistration("windowed-sum", windowed_sum.build, default_instances=2)
        >>> reg.topology().sink_topics
        ('windowed-sum-out',)
    """

    name: str
    build: Callable[[], Topology]
    schedules: tuple[ScaleSchedule, ...] = ()
    default_instances: int = 1
    strategy: Strategy = "average"

    def __post_init__(self) -> None:
        validate_name(self.name, "topology name")
        if self.default_instances < 1:
            raise ValueError(f"default_instances must be >= 1, got {self.default_instances}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")

    def topology(self) -> Topology:
        """Build the topology, checking that its job id is this registration's name.

        The name keys the desired state, the run tags and the scale config
        while the job id keys topics, state and consumer offsets: a mismatch
        would make Dagster operate one group and the engine run another.
        """
        topology = self.build()
        if topology.job_id != self.name:
            raise ValueError(
                f"registration {self.name!r} builds a topology with job id "
                f"{topology.job_id!r}; they must be equal"
            )
        return topology


def _example_registrations() -> dict[str, TopologyRegistration]:
    schedules: Mapping[str, tuple[ScaleSchedule, ...]] = {
        # A demonstration of scheduled scaling (schedules start stopped in Dagster):
        # two instances through the working day, one overnight.
        "wordcount": (ScaleSchedule("0 8 * * 1-5", 2), ScaleSchedule("0 20 * * 1-5", 1)),
    }
    return {
        name: TopologyRegistration(name, build, schedules=schedules.get(name, ()))
        for name, build in sorted(EXAMPLES.items())
    }


def _user_registrations() -> dict[str, TopologyRegistration]:
    """Registrations from the modules named in ``STREAM_ASSETS_TOPOLOGIES``.

    A comma-separated list of importable modules, each defining
    ``REGISTRATIONS``: an iterable of :class:`TopologyRegistration`. This is
    how a deployment adds its own topologies to the code location.
    """
    out: dict[str, TopologyRegistration] = {}
    for module_name in filter(None, os.environ.get("STREAM_ASSETS_TOPOLOGIES", "").split(",")):
        module = importlib.import_module(module_name.strip())
        registrations = getattr(module, "REGISTRATIONS", None)
        if registrations is None:
            raise ValueError(
                f"STREAM_ASSETS_TOPOLOGIES: module {module_name!r} defines no REGISTRATIONS"
            )
        for reg in registrations:
            out[reg.name] = reg
    return out


#: Every topology this code location operates, by name.
REGISTRY: dict[str, TopologyRegistration] = {
    **_example_registrations(),
    **_user_registrations(),
}


def registration(name: str) -> TopologyRegistration:
    """The registration called ``name``; the error lists the known names.

    Example::

        >>> registration("windowed-sum").name
        'windowed-sum'
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no topology {name!r} is registered (known: {sorted(REGISTRY)})") from None
