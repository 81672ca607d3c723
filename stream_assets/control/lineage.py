"""Topics and topologies as Dagster assets, with lineage source -> topology -> outputs.

Every topic a topology touches becomes an :class:`dagster.AssetSpec` keyed
``["topics", <topic>]``, and the topology itself one keyed
``["topologies", <job id>]`` that depends on its source topic. Shuffle, state,
sink, late-record and dead-letter topics depend on the topology, so the UI
draws ``source -> topology -> {shuffle, state, sinks, ...}``. A topic several
topologies share (a common source, or one topology's sink feeding another's
source) becomes one asset with the union of their edges, so chained
topologies show as one graph.

Key components are the names with every character outside ``[A-Za-z0-9_]``
replaced by ``_``. Dagster 1.13 accepts ``-`` in asset keys when they are built
from lists, but a key given as a *string* is split at every such character
(``AssetMaterialization(asset_key="topics/wordcount-out")`` names
``["topics", "wordcount", "out"]``) and the UI's selection syntax rejects an
unquoted ``-``; sanitized keys avoid both traps. The real name stays in the
metadata (``topic`` / ``job_id``), and two names that sanitize alike are an
error, never a silent merge. Use :func:`topic_asset_key` and
:func:`topology_asset_key` to address these assets (observations, materializations).

Example::

    >>> from stream_assets.examples import wordcount
    >>> for spec in topology_asset_specs(wordcount.build()):
    ...     print(spec.key.to_user_string(), [d.asset_key.to_user_string() for d in spec.deps])
    topics/sourceTopic []
    topologies/wordcount ['topics/sourceTopic']
    topics/wordcount__shuffle__aggregate ['topologies/wordcount']
    topics/wordcount__state__aggregate ['topologies/wordcount']
    topics/wordcount_out ['topologies/wordcount']
    topics/wordcount__dead_letters ['topologies/wordcount']
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import dagster as dg

from stream_assets.plan.topology import Topology

TOPICS_PREFIX = "topics"
TOPOLOGIES_PREFIX = "topologies"
#: Group of a topic that belongs to several topologies.
SHARED_GROUP = "shared_topics"

#: Role names, in the order the metadata lists them.
ROLES = ("source", "shuffle", "state", "sink", "late", "dead_letter")

_INVALID = re.compile(r"[^A-Za-z0-9_]")


def key_component(name: str) -> str:
    """``name`` as an asset key component / group name: ``[A-Za-z0-9_]`` only.

    Example::

        >>> key_component("wordcount__shuffle__aggregate")
        'wordcount__shuffle__aggregate'
    """
    if not name:
        raise ValueError("an empty name has no asset key")
    return _INVALID.sub("_", name)


def topic_asset_key(topic: str) -> dg.AssetKey:
    """The asset key of a topic.

    Example::

        >>> topic_asset_key("wordcount-out")
        AssetKey(['topics', 'wordcount_out'])
    """
    return dg.AssetKey([TOPICS_PREFIX, key_component(topic)])


def topology_asset_key(job_id: str) -> dg.AssetKey:
    """The asset key of a topology (by job id).

    Example::

        >>> topology_asset_key("windowed-sum")
        AssetKey(['topologies', 'windowed_sum'])
    """
    return dg.AssetKey([TOPOLOGIES_PREFIX, key_component(job_id)])


@dataclass
class _TopicNode:
    topic: str
    roles: set[str] = field(default_factory=set)
    topologies: set[str] = field(default_factory=set)
    upstream: set[str] = field(default_factory=set)  # job ids that write the topic


def topology_asset_specs(topology: Topology) -> list[dg.AssetSpec]:
    """The asset specs of one topology: its topics and itself.

    Example::

        >>> from stream_assets.examples import windowed_sum
        >>> specs = {s.key: s for s in topology_asset_specs(windowed_sum.build())}
        >>> [d.asset_key for d in specs[topic_asset_key("windowed-sum-out")].deps]
        [AssetKey(['topologies', 'windowed_sum'])]
    """
    return lineage_asset_specs([topology])


def lineage_asset_specs(topologies: Iterable[Topology]) -> list[dg.AssetSpec]:
    """Asset specs of several topologies, one per key (shared topics merged).

    Order: for each topology in turn, its source topic, the topology, then its
    other topics in :data:`ROLES` order; a topic already listed is not repeated.

    Example::

        >>> from stream_assets.examples import windowed_sum, wordcount
        >>> a = wordcount.build()
        >>> b = wordcount.build(job_id="wordcount2")  # same source topic
        >>> specs = lineage_asset_specs([a, b])
        >>> src = next(s for s in specs if s.key == topic_asset_key("sourceTopic"))
        >>> src.group_name, src.metadata["topologies"]
        ('shared_topics', 'wordcount, wordcount2')
    """
    nodes: dict[dg.AssetKey, _TopicNode] = {}
    order: list[dg.AssetKey] = []
    jobs: dict[dg.AssetKey, Topology] = {}

    def add(topic: str, role: str, topology: Topology, written: bool) -> None:
        key = topic_asset_key(topic)
        node = nodes.get(key)
        if node is None:
            node = nodes[key] = _TopicNode(topic)
            order.append(key)
        elif node.topic != topic:
            raise ValueError(
                f"topics {node.topic!r} and {topic!r} both map to asset key "
                f"{key.to_user_string()!r}; rename one"
            )
        node.roles.add(role)
        node.topologies.add(topology.job_id)
        if written:
            node.upstream.add(topology.job_id)

    for topology in topologies:
        job_key = topology_asset_key(topology.job_id)
        if job_key in jobs:
            if jobs[job_key].job_id != topology.job_id:
                raise ValueError(
                    f"job ids {jobs[job_key].job_id!r} and {topology.job_id!r} both map to "
                    f"asset key {job_key.to_user_string()!r}; rename one"
                )
            raise ValueError(f"topology {topology.job_id!r} is listed twice")
        for source in topology.source_topics:
            add(source, "source", topology, written=False)
        jobs[job_key] = topology
        order.append(job_key)
        outputs = (
            ("shuffle", topology.shuffle_topics),
            ("state", topology.state_topics),
            ("sink", topology.sink_topics),
            ("late", topology.late_topics),
            ("dead_letter", (topology.dead_letter_topic,)),
        )
        for role, topics in outputs:
            for topic in topics:
                add(topic, role, topology, written=True)

    clash = jobs.keys() & nodes.keys()
    assert not clash, f"topic and topology keys live under different prefixes: {clash}"
    return [_topology_spec(jobs[k]) if k in jobs else _topic_spec(nodes[k]) for k in order]


def _topic_spec(node: _TopicNode) -> dg.AssetSpec:
    roles = [r for r in ROLES if r in node.roles]
    owners = sorted(node.topologies)
    group = key_component(owners[0]) if len(owners) == 1 else SHARED_GROUP
    return dg.AssetSpec(
        key=topic_asset_key(node.topic),
        deps=[topology_asset_key(j) for j in sorted(node.upstream)],
        description=f"RocketMQ topic `{node.topic}` ({', '.join(roles)} of {', '.join(owners)}).",
        group_name=group,
        kinds={"rocketmq"},
        metadata={
            "topic": node.topic,
            "roles": ", ".join(roles),
            "topologies": ", ".join(owners),
        },
    )


def _topology_spec(topology: Topology) -> dg.AssetSpec:
    return dg.AssetSpec(
        key=topology_asset_key(topology.job_id),
        deps=[topic_asset_key(t) for t in topology.source_topics],
        description=(
            f"Streaming topology `{topology.job_id}`: {len(topology.stages)} stage(s), "
            f"reads {', '.join(f'`{t}`' for t in topology.source_topics)}. "
            # Says where the numbers on this asset come from (two writers, distinct keys).
            "Materializations: the topology's totals from the metrics sensor, headline "
            "first (1_lag, 2_records_per_s, 3_records_out_per_s, 4_dead_letters, "
            "5_running_instances, 6_desired_instances); observations: each instance's "
            "own numbers under `instance_<i>.*`."
        ),
        group_name=key_component(topology.job_id),
        kinds={"spark"},
        metadata={
            "job_id": topology.job_id,
            "stages": len(topology.stages),
            "source_topics": ", ".join(topology.source_topics),
            "sink_topics": ", ".join(topology.sink_topics),
            "dead_letter_topic": topology.dead_letter_topic,
        },
    )
