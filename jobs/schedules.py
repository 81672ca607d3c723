"""Scheduled scale events: each registered topology's ``ScaleSchedule`` as a Dagster schedule.

A schedule launches the scale job with its op ``scale`` configured for the
topology and the target instance count, and tags the run so the supervisor
and the UI can tell scale runs apart. Schedules start stopped (Dagster's
default): turning one on is an operator's decision.

Example::

    >>> from stream_assets.control.registry import REGISTRY
    >>> [s.name for s in scale_schedules(REGISTRY["wordcount"], scale_job)]  # doctest: +SKIP
    ['scale_wordcount_to_2_at_0800', 'scale_wordcount_to_1_at_2000']
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


def schedule_name(registration: TopologyRegistration, event: ScaleSchedule) -> str:
    """A valid Dagster name that says what the schedule does: scale to what, when.

    ``scale_<topology>_to_<target>_at_<HHMM>`` when the cron fires at one time of
    day; otherwise the cron's fields spelled with ``[A-Za-z0-9_]`` only. The days
    are left out (they are in the description): two schedules of a topology
    that differ only there are told apart by :func:`schedule_names`.

    Example::

        >>> reg = TopologyRegistration("windowed-sum", lambda: None)
        >>> schedule_name(reg, ScaleSchedule("0 8 * * 1-5", 2))
        'scale_windowed_sum_to_2_at_0800'
        >>> schedule_name(reg, ScaleSchedule("*/15 9-17 * * *", 3))
        'scale_windowed_sum_to_3_cron_every15_9to17_x_x_x'
    """
    fields = event.cron.split()
    base = f"scale_{key_component(registration.name)}_to_{event.target_instances}"
    if len(fields) == 5 and fields[0].isdigit() and fields[1].isdigit():
        return f"{base}_at_{int(fields[1]):02d}{int(fields[0]):02d}"
    return f"{base}_cron_{_spelled(fields)}"


def schedule_names(registration: TopologyRegistration) -> list[str]:
    """:func:`schedule_name` of each of the topology's schedules, made unique.

    Schedules that would share a name get their days (the cron's last three
    fields), then their time zone, then their position added, so a name stays
    the same while no other schedule of the topology clashes with it.

    Example::

        >>> reg = TopologyRegistration("wordcount", lambda: None, schedules=(
        ...     ScaleSchedule("0 8 * * 1-5", 2), ScaleSchedule("0 8 * * 0,6", 2),
        ...     ScaleSchedule("0 20 * * *", 1)))
        >>> schedule_names(reg)  # doctest: +NORMALIZE_WHITESPACE
        ['scale_wordcount_to_2_at_0800_on_x_x_1to5', 'scale_wordcount_to_2_at_0800_on_x_x_0and6',
         'scale_wordcount_to_1_at_2000']
    """
    events = registration.schedules
    names = [schedule_name(registration, event) for event in events]

    def refinements(i: int) -> tuple[str, str, str]:
        days, zone = _spelled(events[i].cron.split()[2:]), key_component(events[i].timezone)
        return f"_on_{days}", f"_{zone}", f"_{i}"

    for level in range(3):
        clashing = [i for i, name in enumerate(names) if names.count(name) > 1]
        for i in clashing:
            names[i] += refinements(i)[level]
    if len(set(names)) != len(names):  # a refined name met another's plain one
        names = [f"{name}_{i}" for i, name in enumerate(names)]
    return names


def _spelled(fields: list[str]) -> str:
    """Cron fields as a name part: ``*`` x, ``*/n`` everyn, ``a-b`` atob, ``a,b`` aandb.

    >>> _spelled("*/15 9-17 * * 1,3".split())
    'every15_9to17_x_x_1and3'
    """
    out = []
    for field in fields:
        text = field.replace("*/", "every").replace("*", "x").replace("-", "to")
        out.append(key_component(text.replace(",", "and").replace("/", "by")))
    return "_".join(out) or "x"


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
    for name, event in zip(schedule_names(registration), registration.schedules, strict=True):
        out.append(
            dg.ScheduleDefinition(
                name=name,
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
    """:func:`scale_schedules` of every registration, e.g. ``REGISTRY.values()``.

    Topology names that differ only in characters a Dagster name cannot hold
    (``a-b``, ``a_b``) would give two schedules one name: refused here, naming
    both, rather than by Dagster's duplicate check.
    """
    out: list[dg.ScheduleDefinition] = []
    owners: dict[str, str] = {}
    for reg in registrations:
        for schedule in scale_schedules(reg, scale_job):
            other = owners.setdefault(schedule.name, reg.name)
            if other != reg.name:
                raise ValueError(
                    f"topologies {other!r} and {reg.name!r} both have a schedule named "
                    f"{schedule.name!r}: rename one of the topologies"
                )
            out.append(schedule)
    return out
