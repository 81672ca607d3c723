"""A new version of a topology keeps its state, or refuses to start and says why.

Every start records the topology on the name server (KV namespace
:data:`TOPOLOGY_NAMESPACE`, key: the job id): per stateful operator its name,
the id it runs under, its shuffle and state topics and what its state holds
(:func:`~stream_assets.plan.names.state_format`); per sink the id its message
keys carry. The next start of the job compares its topology with that record
(:func:`plan_upgrade`) and:

- carries over the state of every operator that kept its name and its state
  format, under the topics (and ids) it had, so names from the previous
  release stay too (:func:`~stream_assets.plan.names.positional_ids`: a job
  with no record whose positional state topics exist is such a job);
- starts new operators empty;
- refuses, naming the operator and what changed, when an operator's state
  format changed (``count`` -> ``sum``, another window), when a new operator
  of a kind whose operator disappeared may be that one renamed, when an
  operator removed earlier comes back (its topics hold stale state), and when
  the broker holds state topics of the job that no operator claims;
- never starts an operator that had state with empty state unless told to:
  ``accepted`` names the operators whose state the user chose to drop
  (``stream-assets upgrade <job> --drop-state NAME``, or the Dagster job
  ``upgrade``), which :func:`drop_state` empties first.

Removed operators stay in the record as retired, with their topics, so their
state is never picked up again by accident. State keeps its seq (and so the
versions of unwindowed results) and its owner generation across an upgrade;
a dropped operator's empty snapshot carries a seq above everything its topic
held, so versions never go backwards.

This module is pure (the broker answers through callables):
:func:`~stream_assets.rocketmq.provision.upgrade_topology` runs it at every
start.

Example::

    >>> plan = plan_upgrade(topology, read_record(admin.get_kv, topology.job_id),
    ...                     admin.topic_exists)  # doctest: +SKIP
    >>> print(plan.describe())  # doctest: +SKIP
    >>> plan.refuse_if_needed()  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from stream_assets.plan import nodes as n
from stream_assets.plan.names import describe_change, positional_ids, state_format, stateful_kind
from stream_assets.plan.topology import Stage, Topology, shuffle_topic, state_topic

#: Name server KV namespace of each job's topology record, by job id.
TOPOLOGY_NAMESPACE = "stream-assets-topology"
#: The record's wire format version; a record of another version is refused by name.
RECORD_VERSION = 1


class UpgradeRefusedError(ValueError):
    """The topology changed in a way that would lose or misread state; nothing was started."""


@dataclass(frozen=True)
class OperatorRecord:
    """One stateful operator as a version of the job ran it."""

    #: Its id in the topology as built (its ``name=`` or default name).
    name: str
    #: The id it runs under (``name``, or the previous release's positional id).
    op_id: str
    shuffle_topic: str
    state_topic: str
    #: What its state holds (:func:`~stream_assets.plan.names.state_format`).
    format: dict[str, Any]
    #: Removed in a later version: its topics hold state nothing reads.
    retired: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "name": self.name,
            "op_id": self.op_id,
            "shuffle_topic": self.shuffle_topic,
            "state_topic": self.state_topic,
            "format": self.format,
        }
        return {**wire, "retired": True} if self.retired else wire


@dataclass(frozen=True)
class TopologyRecord:
    """What a job's latest start ran: its stateful operators and its sinks' ids.

    >>> record = TopologyRecord(
    ...     (OperatorRecord("counts", "counts", "wc__shuffle__counts", "wc__state__counts",
    ...                     {"kind": "aggregate"}),), {"sink_out": "sink_out"})
    >>> TopologyRecord.decode("wc", record.encode()) == record
    True
    """

    operators: tuple[OperatorRecord, ...]
    #: Sink id as built -> the id its message keys carry.
    sinks: dict[str, str] = field(default_factory=dict)

    def encode(self) -> str:
        """The record as stored (versioned JSON)."""
        wire = {
            "version": RECORD_VERSION,
            "operators": [op.to_wire() for op in self.operators],
            "sinks": self.sinks,
        }
        return json.dumps(wire, sort_keys=True, separators=(",", ":"))

    @classmethod
    def decode(cls, job_id: str, text: str) -> TopologyRecord:
        """A stored record; a ValueError naming the job for one this release cannot read."""
        try:
            wire = json.loads(text)
            version = wire.get("version")
            if version != RECORD_VERSION:
                raise ValueError(f"version {version!r}, this release reads {RECORD_VERSION}")
            operators = tuple(
                OperatorRecord(
                    str(op["name"]),
                    str(op["op_id"]),
                    str(op["shuffle_topic"]),
                    str(op["state_topic"]),
                    dict(op["format"]),
                    bool(op.get("retired", False)),
                )
                for op in wire["operators"]
            )
            sinks = {str(k): str(v) for k, v in dict(wire.get("sinks", {})).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"the topology record of job {job_id!r} on the name server (namespace "
                f"{TOPOLOGY_NAMESPACE}) cannot be read: {exc}. Was it written by a newer "
                "release? Run that release, or remove the record to start as a new job"
            ) from exc
        return cls(operators, sinks)

    def operator(self, name: str) -> OperatorRecord | None:
        """The operator recorded under ``name``, or None."""
        return next((op for op in self.operators if op.name == name), None)


@dataclass(frozen=True)
class UpgradePlan:
    """What starting ``topology`` does with the state of the job's previous version."""

    job_id: str
    #: The topology to run: operators under the ids, and topics, their state is in.
    topology: Topology
    #: What to record once it starts.
    record: TopologyRecord
    carried: tuple[str, ...] = ()
    new: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    #: Operators whose state the user chose to drop: emptied before the start.
    dropped: tuple[str, ...] = ()
    #: Why it must not start as it is (each names an operator and what to do).
    problems: tuple[str, ...] = ()
    #: Operator ids of the job's state topics no operator claims (no record yet).
    unclaimed: tuple[str, ...] = ()
    #: No record and no positional state: a job's first start.
    first: bool = False
    #: The record the plan was made against (None: there was none).
    previous: TopologyRecord | None = None

    def describe(self) -> str:
        """The plan in words, one line per kind of change."""
        if self.first:
            return f"{self.job_id}: first start, no state to carry over"
        parts = [
            f"{what} {', '.join(names)}"
            for what, names in (
                ("state carried over for", self.carried),
                ("new (starting empty):", self.new),
                ("removed (state left in its topics):", self.removed),
                ("state dropped for", self.dropped),
            )
            if names
        ]
        lines = [f"{self.job_id}: " + ("; ".join(parts) or "no stateful operator")]
        lines += [f"  refused: {p}" for p in self.problems]
        return "\n".join(lines)

    def refuse_if_needed(self) -> None:
        """Raise :class:`UpgradeRefusedError` with every problem, if there is any."""
        if self.problems:
            raise UpgradeRefusedError(
                f"refusing to start {self.job_id}: "
                + "; ".join(self.problems)
                + ". Nothing was started (docs/operating.md, 'Upgrading a topology')"
            )


def read_record(reader: Callable[[str, str], str | None], job_id: str) -> TopologyRecord | None:
    """The job's record from the name server KV (``reader``: ``admin.get_kv``), or None."""
    text = reader(TOPOLOGY_NAMESPACE, job_id)
    return None if text is None else TopologyRecord.decode(job_id, text)


def plan_upgrade(
    topology: Topology,
    previous: TopologyRecord | None,
    topic_exists: Callable[[str], bool],
    accepted: Collection[str] = (),
    job_state_topics: Collection[str] = (),
) -> UpgradePlan:
    """Compare ``topology`` with the ``previous`` record; pure but for ``topic_exists``.

    ``accepted``: operators whose state the user chose to drop (a changed format,
    a removed operator a new one may replace, a retired one coming back, or an
    unclaimed state topic by its operator's id). ``job_state_topics``: the
    broker's ``<job>__state__*`` topics, to find state no operator claims.
    """
    if previous is None:
        return _first_or_positional(topology, topic_exists, accepted, job_state_topics)
    job = topology.job_id
    heads = {h.op_id: h for h in topology.stateful_heads}
    recorded = {op.name: op for op in previous.operators}
    problems: list[str] = []
    dropped: list[str] = []
    for name, head in heads.items():
        old = recorded.get(name)
        if old is None:
            continue
        change = describe_change(old.format, state_format(head))
        if old.retired or change:
            why = (
                "was removed by an earlier version; its topics hold the state it had then"
                if old.retired
                else f"changed what its state holds ({change})"
            )
            if name in accepted:
                dropped.append(name)
            else:
                problems.append(f"operator {name!r} {why}: {_drop_hint(job, name)}")
    live = {name for name, op in recorded.items() if not op.retired}
    removed = sorted(live - set(heads))
    new = sorted(set(heads) - set(recorded))
    problems += _maybe_renamed(job, heads, recorded, removed, new, accepted)
    ids = {name: recorded[name].op_id for name in heads if name in recorded}
    ids |= {sink: previous.sinks.get(sink, sink) for sink in _sinks(topology)}
    kept = {
        recorded[name].op_id: (recorded[name].shuffle_topic, recorded[name].state_topic)
        for name in heads
        if name in recorded
    }
    resolved = topology.renamed(ids, kept)
    retired = [
        OperatorRecord(op.name, op.op_id, op.shuffle_topic, op.state_topic, op.format, True)
        for name, op in recorded.items()
        if name not in heads
    ]
    return UpgradePlan(
        job_id=job,
        topology=resolved,
        record=_record(topology, resolved, retired),
        carried=tuple(sorted((set(heads) & live) - set(dropped))),
        new=tuple(new),
        removed=tuple(removed),
        dropped=tuple(sorted(dropped)),
        problems=tuple(problems),
        previous=previous,
    )


def _first_or_positional(
    topology: Topology,
    topic_exists: Callable[[str], bool],
    accepted: Collection[str],
    job_state_topics: Collection[str],
) -> UpgradePlan:
    """No record: a new job, or one the previous release ran under positional names."""
    job = topology.job_id
    old = positional_ids(topology.nodes)
    heads = {h.op_id: h for h in topology.stateful_heads}
    positional = {
        name: head for name, head in heads.items() if topic_exists(state_topic(job, old[name]))
    }
    ids: dict[str, str] = {}
    kept: dict[str, tuple[str, str]] = {}
    if positional:
        # A job of the previous release: its operators and sinks keep the names it gave them.
        ids = {name: old[name] for name in positional} | {s: old[s] for s in _sinks(topology)}
        kept = {
            old[name]: (shuffle_topic(job, head.inputs[0]), state_topic(job, old[name]))
            for name, head in positional.items()
        }
    resolved = topology.renamed(ids, kept)
    claimed = {s.state_topic for s in resolved.stages if s.state_topic}
    unclaimed = [_operator_of(job, t) for t in sorted(set(job_state_topics) - claimed)]
    problems = [
        f"state topic {state_topic(job, op_id)} of an earlier version of {job} belongs to no "
        "operator of this topology (an operator renamed or moved while the engine was "
        "upgraded?): start the version that wrote it once under this release, then this "
        f"one; or, to leave that state behind, "
        f"`stream-assets upgrade {job} --drop-state {op_id}`"
        for op_id in unclaimed
        if op_id not in accepted
    ]
    return UpgradePlan(
        job_id=job,
        topology=resolved,
        record=_record(topology, resolved, []),
        carried=tuple(sorted(positional)),
        new=tuple(sorted(set(heads) - set(positional))) if positional else (),
        problems=tuple(problems),
        unclaimed=tuple(unclaimed),
        first=not positional and not unclaimed,
    )


def _maybe_renamed(
    job: str,
    heads: dict[str, n.Stateful],
    recorded: dict[str, OperatorRecord],
    removed: list[str],
    new: list[str],
    accepted: Collection[str],
) -> list[str]:
    """A new operator of the kind of one that disappeared may be that one renamed: its
    state would start empty. Refused until the user names it as before or lets it go."""
    problems = []
    for name in new:
        kind = stateful_kind(heads[name])
        gone = [r for r in removed if recorded[r].format.get("kind") == kind and r not in accepted]
        if gone:
            problems.append(
                f"operator {name!r} is new and {kind} operator(s) {gone} are gone: if {name!r} "
                f"is one of them renamed, give it that name (name=...) to keep its state; to "
                f"start {name!r} empty and leave their state behind: "
                + " ".join(f"--drop-state {g}" for g in gone)
                + f" (stream-assets upgrade {job})"
            )
    return problems


def _drop_hint(job: str, name: str) -> str:
    return (
        f"to start it empty, drop its state with `stream-assets upgrade {job} --drop-state "
        f"{name} --yes` (or the Dagster job upgrade_job), with the old version stopped "
        "(stop_topology_job with drain: true first, so nothing it sent is left unapplied)"
    )


def _record(built: Topology, resolved: Topology, retired: list[OperatorRecord]) -> TopologyRecord:
    """The record of ``resolved`` (the names as built come from ``built``)."""
    operators = [
        OperatorRecord(
            name=built_head.op_id,
            op_id=stage.head.op_id,
            shuffle_topic=stage.input_topic,
            state_topic=stage.state_topic or "",
            format=state_format(stage.head),
        )
        for built_head, stage in zip(built.stateful_heads, _keyed(resolved), strict=True)
        if stage.head is not None
    ]
    sinks = {
        b.op_id: r.op_id
        for b, r in zip(built.nodes, resolved.nodes, strict=True)
        if isinstance(b, n.Sink)
    }
    return TopologyRecord((*operators, *retired), sinks)


def _keyed(topology: Topology) -> list[Stage]:
    return [s for s in topology.stages if s.head is not None]


def _sinks(topology: Topology) -> list[str]:
    return [x.op_id for x in topology.nodes if isinstance(x, n.Sink)]


def _operator_of(job: str, topic: str) -> str:
    """The operator id a ``<job>__state__<id>`` topic is named after."""
    return topic.removeprefix(f"{job}__state__")
