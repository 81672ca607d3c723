"""A compiled topology: the node chain cut into stages at every key_by.

Stage 0 reads the source topic and runs the stateless operators up to the first
key_by, which writes to that key_by's shuffle topic. Stage k > 0 reads the
shuffle topic, starts with the stateful aggregate (state topic alongside) and
runs what follows up to the next key_by or the end. Topic names derive from the
job id and operator id, so every instance of a job agrees on them.

Example::

    >>> t = Topology("wc", (...))  # doctest: +SKIP
    >>> t.stages[1].input_topic  # doctest: +SKIP
    'wc__shuffle__key_by-2'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from stream_assets.operators.aggregates import is_decomposable
from stream_assets.plan import nodes as n

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,80}$")


def validate_name(name: str, what: str) -> str:
    """Return ``name`` if it is a usable job id / topic name, else raise naming it."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} {name!r} is not valid: use 1-80 letters, digits, '_' or '-'")
    return name


@dataclass(frozen=True)
class Stage:
    """One Spark query per instance: reads ``input_topic``, runs ``ops``, maybe shuffles."""

    index: int
    input_topic: str
    source: n.Source | None  # stage 0 only
    aggregate: n.Aggregate | None  # stages > 0: the stateful head
    ops: tuple[n.Node, ...]  # stateless operators and terminal sink/print
    key_by: n.KeyBy | None  # ends with a shuffle into output_topic
    output_topic: str | None  # the next stage's shuffle topic
    state_topic: str | None  # changelog of the aggregate's state
    combine: bool = False  # pre-aggregate before the shuffle (next stage decomposable)

    @property
    def stateful(self) -> bool:
        """Whether this stage keeps RocksDB state."""
        return self.aggregate is not None

    @property
    def sink_topics(self) -> tuple[str, ...]:
        """Topics this stage's sinks write to."""
        return tuple(op.topic for op in self.ops if isinstance(op, n.Sink))


@dataclass(frozen=True)
class Topology:
    """A job's node chain and its stages."""

    job_id: str
    nodes: tuple[n.Node, ...]
    stages: tuple[Stage, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(_cut(self.job_id, self.nodes)))

    @property
    def source_topic(self) -> str:
        """The topic stage 0 reads."""
        return self.stages[0].input_topic

    @property
    def shuffle_topics(self) -> tuple[str, ...]:
        """Every shuffle topic, in stage order."""
        return tuple(s.input_topic for s in self.stages[1:])

    @property
    def state_topics(self) -> tuple[str, ...]:
        """Every state (changelog) topic."""
        return tuple(s.state_topic for s in self.stages if s.state_topic)

    @property
    def sink_topics(self) -> tuple[str, ...]:
        """Every sink topic."""
        return tuple(t for s in self.stages for t in s.sink_topics)

    @property
    def dead_letter_topic(self) -> str:
        """Where records that fail to deserialize or raise in user code go."""
        return f"{self.job_id}__dead-letters"

    @property
    def late_topics(self) -> tuple[str, ...]:
        """Topics that receive dropped late records."""
        return tuple(
            s.aggregate.late_topic for s in self.stages if s.aggregate and s.aggregate.late_topic
        )


def shuffle_topic(job_id: str, key_by: n.KeyBy) -> str:
    """The shuffle topic of a key_by."""
    return f"{job_id}__shuffle__{key_by.op_id}"


def state_topic(job_id: str, aggregate: n.Aggregate) -> str:
    """The state (changelog) topic of an aggregate."""
    return f"{job_id}__state__{aggregate.op_id}"


def _cut(job_id: str, nodes: tuple[n.Node, ...]) -> list[Stage]:
    if not nodes or not isinstance(nodes[0], n.Source):
        raise ValueError(f"{job_id}: a topology starts with source(...)")
    stages: list[Stage] = []
    source: n.Source | None = nodes[0]
    assert source is not None
    input_topic = source.topic
    aggregate: n.Aggregate | None = None
    ops: list[n.Node] = []
    i = 1
    while True:
        node = nodes[i] if i < len(nodes) else None
        if node is None or isinstance(node, n.KeyBy):
            next_agg = nodes[i + 1] if node is not None and i + 1 < len(nodes) else None
            if node is not None and not isinstance(next_agg, n.Aggregate):
                raise ValueError(
                    f"{job_id}: {node.op_id} must be followed by an aggregate "
                    "(count/sum/min/max/avg/aggregate) and to_rstream()"
                )
            if node is not None and aggregate is not None:
                raise ValueError(
                    f"{job_id}: {node.op_id}: a second key_by after an aggregate is not "
                    "supported yet; split the job into two topologies joined by a sink topic"
                )
            out = shuffle_topic(job_id, node) if node is not None else None
            stages.append(
                Stage(
                    index=len(stages),
                    input_topic=input_topic,
                    source=source,
                    aggregate=aggregate,
                    ops=tuple(ops),
                    key_by=node,
                    output_topic=out,
                    state_topic=state_topic(job_id, aggregate) if aggregate else None,
                    # Not when late records go to a topic: a pre-combined
                    # partial no longer has the records' values to send there.
                    combine=isinstance(next_agg, n.Aggregate)
                    and is_decomposable(next_agg.accumulator)
                    and next_agg.late_topic is None,
                )
            )
            if node is None:
                return stages
            assert out is not None and isinstance(next_agg, n.Aggregate)
            source, input_topic, aggregate, ops = None, out, next_agg, []
            i += 2
            continue
        if isinstance(node, n.Aggregate):
            raise ValueError(f"{job_id}: {node.op_id} needs a key_by before it")
        ops.append(node)
        i += 1
