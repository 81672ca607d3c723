"""Scheduled scale events: each registered topology's ``ScaleSchedule`` as a Dagster schedule.

A schedule launches the scale job with its op ``scale`` configured for the
topology and the target instance count, and tags the run so the supervisor
and the UI can tell scale runs apart. Schedules start stopped (Dagster's
default): turning one on is an operator's decision.

Example::

    >>> from stream_assets.control.registry import REGISTRY
    >>> [s.name for s in scale_schedules(REGISTRY["wordcount"], scale_job)]  # doctest: +SKIP
    ['scale_wordcount_0_to_2', 'scale_wordcount_1_to_1']
"""

from collections.abc import Iterable
from typing import Any

import dagster as dg

from stream_assets.control.lineage import key_component
from stream_assets.control.registry import (
    TARGET_INSTANCES_TAG,
    TOPOLOGY_TAG,
    ScaleSchedule,
    TopologyRegistration,
)

#: The op of the scale job that these schedules configure.
SCALE_OP = "scale"


def scale_run_config(topology: str, target_instances: int) -> dict[str, Any]:
    """Run config of the scale job for ``topology`` -> ``target_instances``.

    Example::

        >>> scale_run_config("wordcount", 3)
        {'ops': {'scale': {'config': {'topology': 'wordcount', 'target_instances': 3}}}}
    """
    return {
        "ops": {SCALE_OP: {"config": {"topology": topology, "target_instances": target_instances}}}
    }


def scale_run_tags(topology: str, target_instances: int) -> dict[str, str]:
    """Run tags of a scale run."""
    return {TOPOLOGY_TAG: topology, TARGET_INSTANCES_TAG: str(target_instances)}


def schedule_name(registration: TopologyRegistration, index: int, event: ScaleSchedule) -> str:
    """A stable, valid Dagster name for the ``index``-th schedule of a topology."""
    return f"scale_{key_component(registration.name)}_{index}_to_{event.target_instances}"


def scale_schedules(
    registration: TopologyRegistration,
    scale_job: dg.JobDefinition,
) -> list[dg.ScheduleDefinition]:
    """One schedule per scale event of ``registration``, each launching ``scale_job``.

    Example::

        >>> reg = TopologyRegistration("wordcount", wordcount.build,
        ...                            schedules=(ScaleSchedule("0 8 * * *", 2),))  # doctest: +SKIP
        >>> scale_schedules(reg, scale_job)[0].cron_schedule  # doctest: +SKIP
        '0 8 * * *'
    """
    out = []
    for index, event in enumerate(registration.schedules):
        out.append(
            dg.ScheduleDefinition(
                name=schedule_name(registration, index, event),
                cron_schedule=event.cron,
                execution_timezone=event.timezone,
                job=scale_job,
                run_config=scale_run_config(registration.name, event.target_instances),
                tags=scale_run_tags(registration.name, event.target_instances),
                description=(
                    f"Scale topology {registration.name} to {event.target_instances} "
                    f"instance(s) at '{event.cron}' ({event.timezone})."
                ),
            )
        )
    return out


def all_scale_schedules(
    registrations: Iterable[TopologyRegistration],
    scale_job: dg.JobDefinition,
) -> list[dg.ScheduleDefinition]:
    """:func:`scale_schedules` of every registration, e.g. ``REGISTRY.values()``."""
    return [s for reg in registrations for s in scale_schedules(reg, scale_job)]
