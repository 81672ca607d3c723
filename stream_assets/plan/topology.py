"""A compiled topology: the plan graph cut into stages at every key_by.

A stage reads one topic and runs as one Spark query per instance. Each source
begins a *source stage* (its topic). Each stateful operator (aggregate, join)
begins a *keyed stage* reading its shuffle topic, which every ``key_by``
feeding it writes to (both sides of a join, every stream of a union). A stage
holds every stateless operator reachable from its head without crossing
another stateful operator; the ``key_by`` nodes it reaches are its *exits*.
An operator downstream of a union of streams from two stages runs in both.
Topic names derive from the job id and the stateful operators' ids, which do
not count operators (:mod:`~stream_assets.plan.names`), so every instance of
a job agrees on them and an unrelated edit leaves them as they are; a job
first run by the previous release keeps its positional names
(``kept_topics``, :mod:`~stream_assets.control.upgrade`).

Records carry their *origin*: the upstream stage's queue (an origin id, see
:func:`origin_id`), an offset and a sub-index. A keyed stage de-duplicates and
tracks event time per origin.

Example::

    >>> from stream_assets.examples import wordcount
    >>> t = wordcount.build("wc", "lines", "counts")
    >>> [(s.index, s.input_topic) for s in t.stages]
    [(0, 'lines'), (1, 'wc__shuffle__aggregate')]
    >>> t.stages[0].exits[0].topic, t.stages[1].state_topic, t.stages[1].upstreams
    ('wc__shuffle__aggregate', 'wc__state__aggregate', (0,))
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from stream_assets.operators.aggregates import is_decomposable
from stream_assets.plan import nodes as n

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,80}$")
#: Origin ids of stage s are s * ORIGIN_STRIDE + queue id (stage 0 keeps plain queue ids).
ORIGIN_STRIDE = 1 << 16


def validate_name(name: str, what: str) -> str:
    """Return ``name`` if it is a usable job id / topic name, else raise naming it."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} {name!r} is not valid: use 1-80 letters, digits, '_' or '-'")
    return name


def origin_id(stage: int, queue_id: int) -> int:
    """The origin id of ``queue_id`` of stage ``stage``'s input (unique in a topology).

    >>> origin_id(0, 3), origin_id(2, 3)
    (3, 131075)
    """
    return stage * ORIGIN_STRIDE + queue_id


@dataclass(frozen=True)
class Exit:
    """A key_by of a stage: records leave through ``topic`` for the stage of ``head``."""

    key_by: n.KeyBy
    topic: str
    head: n.Stateful
    #: Pre-aggregate before the shuffle (the head is a decomposable aggregate).
    combine: bool = False

    @property
    def tagged(self) -> bool:
        """Whether values travel as ``[side, value]`` (the head is a join)."""
        return isinstance(self.head, n.Join | n.TableJoin)


@dataclass(frozen=True)
class Stage:
    """One Spark query per instance: reads ``input_topic``, runs its operators, maybe shuffles."""

    index: int
    input_topic: str
    source: n.Source | None  # source stages
    head: n.Stateful | None  # keyed stages: the stateful operator
    #: Stateless operators, sinks, prints and exits, by op id.
    nodes: dict[str, n.Node]
    #: Edges from the head (source or stateful op) to the exits, by op id.
    children: dict[str, tuple[str, ...]]
    exits: tuple[Exit, ...]
    #: Changelog of the head's state; of a source stage with exactly-once sinks, the log of
    #: its steps (each one's position and transaction: :attr:`positioned`).
    state_topic: str | None
    #: Stages whose exits write to this stage's input topic.
    upstreams: tuple[int, ...] = ()

    @property
    def root(self) -> str:
        """Op id of the node elements start from."""
        node = self.source if self.source is not None else self.head
        assert node is not None
        return node.op_id

    @property
    def stateful(self) -> bool:
        """Whether this stage keeps RocksDB state."""
        return self.head is not None

    @property
    def positioned(self) -> bool:
        """Whether this source stage logs its steps in a state topic: it has exactly-once
        sinks, whose transaction needs a compare-and-append log to commit with (a consumer
        offset names no attempt), and that log's position lets a replay skip what a
        landed step read (runtime/core/stage0/exactly_once.py)."""
        return self.source is not None and self.state_topic is not None

    @property
    def aggregate(self) -> n.Aggregate | None:
        """The head when it is an aggregate (or a windowed join, which is one)."""
        return self.head if isinstance(self.head, n.Aggregate) else None

    @property
    def queryable(self) -> n.Aggregate | n.Process | None:
        """The head when a state query can ask it for a key: an aggregate or a processor."""
        return self.head if isinstance(self.head, n.Aggregate | n.Process) else None

    @property
    def ops(self) -> tuple[n.Node, ...]:
        """The stage's operators (not the head), in plan order."""
        return tuple(self.nodes.values())

    @property
    def sink_topics(self) -> tuple[str, ...]:
        """Topics this stage's sinks write to."""
        return tuple(op.topic for op in self.nodes.values() if isinstance(op, n.Sink))

    @property
    def exactly_once_topics(self) -> frozenset[str]:
        """Topics this stage's exactly-once sinks write to."""
        return frozenset(
            op.topic for op in self.nodes.values() if isinstance(op, n.Sink) and op.exactly_once
        )

    @property
    def output_topics(self) -> tuple[str, ...]:
        """The shuffle topics this stage's exits write to."""
        return tuple(dict.fromkeys(e.topic for e in self.exits))

    @property
    def combine(self) -> bool:
        """Whether this stage pre-aggregates before its (one) shuffle."""
        return len(self.exits) == 1 and self.exits[0].combine


@dataclass(frozen=True)
class Topology:
    """A job's plan graph and its stages."""

    job_id: str
    nodes: tuple[n.Node, ...]
    #: Topics an earlier version of the job named otherwise, kept: stateful operator id ->
    #: (shuffle topic, state topic). The others follow the operators' ids.
    kept_topics: Mapping[str, tuple[str, str]] = field(
        default_factory=dict, compare=False, hash=False
    )
    stages: tuple[Stage, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "stages", tuple(_cut(self.job_id, self.nodes, dict(self.kept_topics)))
        )

    def renamed(
        self, ids: Mapping[str, str], kept_topics: Mapping[str, tuple[str, str]]
    ) -> Topology:
        """This topology with operators renamed (``ids``: id now -> id to use) and the
        topics of ``kept_topics`` (by the id to use) kept, beside those it kept already.

        >>> from stream_assets.examples import wordcount
        >>> old = wordcount.build("wc").renamed(
        ...     {"aggregate": "aggregate-3"},
        ...     {"aggregate-3": ("wc__shuffle__key_by-2", "wc__state__aggregate-3")})
        >>> old.stages[1].head.op_id, old.stages[1].input_topic, old.stages[1].state_topic
        ('aggregate-3', 'wc__shuffle__key_by-2', 'wc__state__aggregate-3')
        """

        def renamed(node: n.Node) -> n.Node:
            return dataclasses.replace(
                node,
                op_id=ids.get(node.op_id, node.op_id),
                inputs=tuple(ids.get(i, i) for i in node.inputs),
            )

        kept = {ids.get(op, op): topics for op, topics in self.kept_topics.items()}
        return Topology(
            self.job_id, tuple(renamed(x) for x in self.nodes), kept | dict(kept_topics)
        )

    @property
    def stateful_heads(self) -> tuple[n.Stateful, ...]:
        """The stateful operators, in plan order."""
        return tuple(s.head for s in self.stages if s.head is not None)

    @property
    def source_stages(self) -> tuple[Stage, ...]:
        """The stages that read the user's topics."""
        return tuple(s for s in self.stages if s.source is not None)

    @property
    def source_topics(self) -> tuple[str, ...]:
        """Every topic the topology reads, in declaration order."""
        return tuple(s.input_topic for s in self.source_stages)

    @property
    def source_topic(self) -> str:
        """The topic of the first source."""
        return self.stages[0].input_topic

    @property
    def shuffle_topics(self) -> tuple[str, ...]:
        """Every shuffle topic, in stage order."""
        return tuple(s.input_topic for s in self.stages if s.head is not None)

    @property
    def state_topics(self) -> tuple[str, ...]:
        """Every state (changelog) topic."""
        return tuple(s.state_topic for s in self.stages if s.state_topic)

    @property
    def sink_topics(self) -> tuple[str, ...]:
        """Every sink topic (each once)."""
        return tuple(dict.fromkeys(t for s in self.stages for t in s.sink_topics))

    @property
    def dead_letter_topic(self) -> str:
        """Where records that fail to deserialize or raise in user code go."""
        return f"{self.job_id}__dead-letters"

    @property
    def late_topics(self) -> tuple[str, ...]:
        """Topics that receive dropped late records."""
        return tuple(
            dict.fromkeys(s.head.late_topic for s in self.stages if s.head and s.head.late_topic)
        )

    def stage_of_topic(self, topic: str) -> Stage:
        """The stage reading ``topic``."""
        for stage in self.stages:
            if stage.input_topic == topic:
                return stage
        raise ValueError(f"no stage of {self.job_id} reads {topic!r}")


def shuffle_topic(job_id: str, op_id: str) -> str:
    """The shuffle topic named after ``op_id``: a stateful operator's (every key_by feeding
    it writes there), or for the previous release, its first key_by's."""
    return f"{job_id}__shuffle__{op_id}"


def state_topic(job_id: str, op_id: str) -> str:
    """The state (changelog) topic of the stateful operator ``op_id``, or the step log of
    the source ``op_id`` (:attr:`Stage.positioned`)."""
    return f"{job_id}__state__{op_id}"


def _cut(job_id: str, nodes: tuple[n.Node, ...], kept: dict[str, tuple[str, str]]) -> list[Stage]:
    by_id = {node.op_id: node for node in nodes}
    children: dict[str, list[str]] = {node.op_id: [] for node in nodes}
    for node in nodes:
        for parent in node.inputs:
            if parent not in by_id:
                raise ValueError(
                    f"{job_id}: {node.op_id} reads {parent!r}, which is not in the plan"
                )
            children[parent].append(node.op_id)
    heads: list[n.Source | n.Stateful] = [x for x in nodes if isinstance(x, n.Source)]
    if not heads:
        raise ValueError(f"{job_id}: a topology starts with source(...)")
    topics = [h.topic for h in heads if isinstance(h, n.Source)]
    twice = sorted({t for t in topics if topics.count(t) > 1})
    if twice:
        raise ValueError(
            f"{job_id}: topic(s) {twice} read by more than one source(); read a topic once "
            "and use its stream handle twice to branch"
        )
    heads += [x for x in nodes if isinstance(x, n.Stateful)]
    input_of: dict[str, str] = {}  # head op id -> input topic
    for head in heads:
        if isinstance(head, n.Source):
            input_of[head.op_id] = head.topic
            continue
        feeders = [by_id[i] for i in head.inputs]
        if not feeders or not all(isinstance(f, n.KeyBy) for f in feeders):
            raise ValueError(f"{job_id}: {head.op_id} needs a key_by before it")
        earlier = kept.get(head.op_id)
        input_of[head.op_id] = earlier[0] if earlier else shuffle_topic(job_id, head.op_id)
    stages = [
        _stage(job_id, index, head, nodes, by_id, children, input_of, kept)
        for index, head in enumerate(heads)
    ]
    by_topic = {s.input_topic: s.index for s in stages}
    upstreams: dict[int, list[int]] = {s.index: [] for s in stages}
    for stage in stages:
        for topic in stage.output_topics:
            upstreams[by_topic[topic]].append(stage.index)
    return [
        Stage(**{**s.__dict__, "upstreams": tuple(sorted(set(upstreams[s.index])))}) for s in stages
    ]


def _stage(
    job_id: str,
    index: int,
    head: n.Source | n.Stateful,
    nodes: tuple[n.Node, ...],
    by_id: dict[str, n.Node],
    children: dict[str, list[str]],
    input_of: dict[str, str],
    kept: dict[str, tuple[str, str]],
) -> Stage:
    """The stage ``head`` starts: every node it reaches up to the next key_by (an exit)."""
    stage_nodes: dict[str, n.Node] = {}
    edges: dict[str, tuple[str, ...]] = {}
    exits: list[Exit] = []
    todo = [head.op_id]
    while todo:
        op_id = todo.pop()
        if op_id in edges:
            continue
        edges[op_id] = tuple(children[op_id])
        for child_id in children[op_id]:
            child = by_id[child_id]
            if child_id in stage_nodes:
                continue
            stage_nodes[child_id] = child
            if isinstance(child, n.KeyBy):
                exits.append(_exit(job_id, child, children[child_id], by_id, input_of))
                edges[child_id] = ()
            else:
                todo.append(child_id)
    # Plan order (declaration order is a topological order).
    ordered = {x.op_id: x for x in nodes if x.op_id in stage_nodes}
    exits.sort(key=lambda e: list(ordered).index(e.key_by.op_id))
    stateful = head if isinstance(head, n.Stateful) else None
    logged = stateful is not None or any(
        isinstance(x, n.Sink) and x.exactly_once for x in ordered.values()
    )
    return Stage(
        index=index,
        input_topic=input_of[head.op_id],
        source=head if isinstance(head, n.Source) else None,
        head=stateful,
        nodes=ordered,
        children=edges,
        exits=tuple(exits),
        state_topic=_state_topic_of(job_id, head, kept) if logged else None,
    )


def _state_topic_of(
    job_id: str, head: n.Source | n.Stateful, kept: dict[str, tuple[str, str]]
) -> str:
    return kept[head.op_id][1] if head.op_id in kept else state_topic(job_id, head.op_id)


def _exit(
    job_id: str,
    key_by: n.KeyBy,
    after: list[str],
    by_id: dict[str, n.Node],
    input_of: dict[str, str],
) -> Exit:
    heads = [by_id[c] for c in after]
    if len(heads) != 1 or not isinstance(heads[0], n.Stateful):
        raise ValueError(
            f"{job_id}: {key_by.op_id} must be followed by exactly one aggregate or join "
            "(count/sum/min/max/avg/aggregate/join) and to_rstream()"
        )
    head = heads[0]
    return Exit(
        key_by=key_by,
        topic=input_of[head.op_id],
        head=head,
        # Not when late records go to a topic: a pre-combined partial no
        # longer has the records' values to send there. Not with a TTL: a
        # key's expiry falls between two of its records, which a partial merges.
        combine=isinstance(head, n.Aggregate)
        and not isinstance(head, n.Join)
        and is_decomposable(head.accumulator)
        and head.late_topic is None
        and head.ttl_ms is None,
    )
