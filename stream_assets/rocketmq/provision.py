"""A topology's topics on the broker: the source must exist, the rest is created if missing.

The source topic belongs to the user: its queue count is the parallelism of
stage 0, a choice only the user makes, so a missing source is an error that
says how to create it, and nothing else is created. Every other topic belongs
to the topology and is created on first use: shuffle and state topics with
``EngineSettings.shuffle_queues`` queues, sink and late-record topics with
``sink_queues``, the dead-letter topic with one. Shuffle and state topics
that exist must have exactly ``shuffle_queues`` queues: records are routed to
a shuffle queue by key hash modulo the count, and a state queue pairs with
the shuffle queue of the same index, so a job keeps that count for life.

A topic the engine creates gets its whole count spread over the broker
groups (``spread_queues``: evenly, by group name). The first provisioning
stores each source, shuffle and state topic's layout on the name server, so
queue indices keep their meaning for the job's life (rocketmq/layout.py).

The scale job provisions before it allocates queues (the allocation needs
the source's queue ids), an instance before it starts its queries.

Example::

    >>> with RocketMQAdmin(settings) as admin:  # doctest: +SKIP
    ...     topics = provision_topics(admin, wordcount.build(), EngineSettings(), print)
    creating topic wordcount__shuffle__aggregate (8 queues)
    ...
    >>> topics.source_queues  # doctest: +SKIP
    {'lines': (0, 1, 2, 3)}
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from stream_assets.plan.topology import Topology
from stream_assets.plan.upgrade import (
    TOPOLOGY_NAMESPACE,
    UpgradePlan,
    plan_upgrade,
    read_record,
)
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    RocketMQError,
    TopicNotFoundError,
)
from stream_assets.rocketmq.layout import LAYOUT_NAMESPACE, TopicLayout, describe_pairs
from stream_assets.settings import EngineSettings


@dataclass(frozen=True)
class ProvisionedTopics:
    """What running a topology needs to know of its topics once they are provisioned.

    ``layouts`` hold every source, shuffle and state topic's queues in index
    order (:class:`~stream_assets.rocketmq.layout.TopicLayout`); the engine
    names those queues by index everywhere and turns an index into
    ``(broker, queue id)`` only to reach the broker. ``source_queues`` are
    each source topic's queue indices, the queues its source stage allocates.
    """

    layouts: dict[str, TopicLayout]
    source_queues: dict[str, tuple[int, ...]]


class LayoutChangedError(RocketMQError, ValueError):
    """A topic's queues differ from the layout the job has used: not something to ride out."""


class SourceTopicNotFoundError(TopicNotFoundError):
    """A topology's source topic does not exist: the user creates it, with the parallelism
    they want, before the topology is deployed."""

    def __init__(self, topic: str, namesrv: str, job_id: str) -> None:
        super().__init__(topic, namesrv)
        self.job_id = job_id
        self.args = (
            f"source topic {topic!r} of topology {job_id!r} does not exist on the name server "
            f"{namesrv}; create it first, with as many queues as stage 0 should run in "
            f"parallel (`stream-assets topic create {topic} --queues 8`), then try again; "
            "no topic was created",
        )


def topic_queue_counts(
    topology: Topology, engine: EngineSettings, source_queues: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Every topic the topology writes, with the queue count it is created with.

    A topic with two roles (a sink that is also a late-record topic) takes
    the count of its first: shuffle, state, sink, late, dead letters. The step
    log of a source stage with exactly-once sinks has one queue per source queue
    (``source_queues``: each source topic's count; the shuffle's where not given).

    Example::

        >>> from stream_assets.examples import wordcount
        >>> engine = EngineSettings(shuffle_queues=4, sink_queues=2)
        >>> for topic, queues in topic_queue_counts(wordcount.build(), engine).items():
        ...     print(topic, queues)
        wordcount__shuffle__aggregate 4
        wordcount__state__aggregate 4
        wordcount-out 2
        wordcount__dead-letters 1
    """
    wanted = {t: engine.shuffle_queues for t in topology.shuffle_topics}
    sources = source_queues or {}
    for stage in topology.stages:
        if stage.state_topic is not None:
            wanted[stage.state_topic] = (
                sources.get(stage.input_topic, engine.shuffle_queues)
                if stage.positioned
                else engine.shuffle_queues
            )
    for topic in (*topology.sink_topics, *topology.late_topics):
        wanted.setdefault(topic, engine.sink_queues)
    wanted.setdefault(topology.dead_letter_topic, 1)
    return wanted


def upgrade_topology(
    admin: RocketMQAdmin,
    topology: Topology,
    progress: Callable[[str], None] | None = None,
    accepted: Collection[str] = (),
) -> UpgradePlan:
    """An instance's start: compare ``topology`` with what the job ran last (its record on
    the name server), refuse or record it (:mod:`~stream_assets.plan.upgrade`).

    Raises :class:`~stream_assets.plan.upgrade.UpgradeRefusedError` naming each operator
    that cannot carry its state over and what to do; otherwise stores the record and
    returns the plan, whose ``topology`` names the topics (and ids) the job runs under.
    ``accepted``: operators whose state :func:`~stream_assets.control.upgrade.drop_state`
    emptied.

    Example::

        >>> plan = upgrade_topology(admin, topology, print)  # doctest: +SKIP
        wordcount: state carried over for aggregate
        >>> plan.topology.stages[1].state_topic  # doctest: +SKIP
        'wordcount__state__aggregate'
    """
    plan = plan_topology_upgrade(admin, topology, accepted)
    if progress is not None and not plan.first:
        progress(plan.describe())
    plan.refuse_if_needed()
    if plan.record != plan.previous:
        admin.put_kv(TOPOLOGY_NAMESPACE, topology.job_id, plan.record.encode())
    return plan


def plan_topology_upgrade(
    admin: RocketMQAdmin,
    topology: Topology,
    accepted: Collection[str] = (),
    find_unclaimed: bool = True,
) -> UpgradePlan:
    """What starting ``topology`` would do with the job's state; reads, changes nothing.

    The control plane runs a topology as its ``.topology`` (the topics and ids the job
    runs under); a job that starts it (a scale, a start) refuses first if it has problems.
    ``find_unclaimed=False``: a view only (no refusal follows), so a job that never
    recorded itself costs no listing of every topic on the name server.
    """
    previous = read_record(admin.get_kv, topology.job_id)
    prefix = f"{topology.job_id}__state__"
    job_state = (
        {t for t in admin.topic_names() if t.startswith(prefix)}
        if previous is None and find_unclaimed
        else set()
    )

    def exists(topic: str) -> bool:
        return admin.topic_exists(topic) or admin.get_kv(LAYOUT_NAMESPACE, topic) is not None

    return plan_upgrade(topology, previous, exists, accepted, job_state)


def provision_topics(
    admin: RocketMQAdmin,
    topology: Topology,
    engine: EngineSettings,
    progress: Callable[[str], None] | None = None,
) -> ProvisionedTopics:
    """Check ``topology``'s source topic exists, create its other topics where missing,
    and fix the layout of every source, shuffle and state topic.

    Raises :class:`SourceTopicNotFoundError` (a ``TopicNotFoundError``)
    before creating anything if the source is missing, and
    :class:`LayoutChangedError` naming what to do if a shuffle or state topic
    has another queue count than ``engine.shuffle_queues``
    (``STREAM_ASSETS_ENGINE_SHUFFLE_QUEUES``) or a topic's queues are not
    those of its stored layout. Topics the engine creates get their whole
    count spread over the broker groups (:func:`spread_queues`). ``progress``
    hears of every topic created and of broker groups missing right now.
    Existing topics are left as they are, so calling it again (every
    instance start does) is cheap.

    Example::

        >>> topics = provision_topics(admin, topology, engine, context.log.info)  # doctest: +SKIP
        >>> topics.source_queues  # doctest: +SKIP
        {'sourceTopic': (0, 1, 2, 3, 4, 5, 6, 7)}
        >>> topics.layouts["sourceTopic"].queue(4)  # doctest: +SKIP
        MessageQueue(topic='sourceTopic', broker_name='broker-b', queue_id=0)
    """
    say = progress or (lambda _: None)
    for source in topology.source_topics:
        if not admin.topic_exists(source) and admin.get_kv(LAYOUT_NAMESPACE, source) is None:
            raise SourceTopicNotFoundError(source, admin.settings.namesrv_addr, topology.job_id)
    layouts = {topic: topic_layout(admin, topic, None, say) for topic in topology.source_topics}
    counts = topic_queue_counts(
        topology, engine, {topic: len(layout) for topic, layout in layouts.items()}
    )
    for topic, queues in counts.items():
        if admin.topic_exists(topic) or admin.get_kv(LAYOUT_NAMESPACE, topic) is not None:
            continue
        say(f"creating topic {topic} ({queues} queues)")
        admin.create_topic(topic, queues, spread=True)
    # Every topic's layout is fixed (stored) now, sinks' too: a topic the engine
    # created is then never created again while its broker group is down.
    fixed = {*topology.shuffle_topics, *topology.state_topics}
    for topic in counts:
        if topic not in layouts:
            layouts[topic] = topic_layout(
                admin, topic, counts[topic] if topic in fixed else None, say
            )
    return ProvisionedTopics(
        layouts=layouts,
        source_queues={t: tuple(range(len(layouts[t]))) for t in topology.source_topics},
    )


def topic_layout(
    admin: RocketMQAdmin,
    topic: str,
    expected: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> TopicLayout:
    """``topic``'s layout: the one stored on the name server, else its route's now (stored).

    The first call fixes the layout for the topic's life: a broker group
    that goes down later (or leaves the route) leaves a gap the engine rides
    out, never a renumbering. ``expected``: the queue count the topic must
    have (shuffle and state topics). Raises :class:`LayoutChangedError` when
    the topic now has queues its layout lacks, or the count is not
    ``expected``.

    Example::

        >>> topic_layout(admin, "orders").pairs  # doctest: +SKIP
        (('broker-a', 0), ('broker-a', 1), ('broker-b', 0), ('broker-b', 1))
    """
    stored = admin.get_kv(LAYOUT_NAMESPACE, topic)
    try:
        now = {(q.broker_name, q.queue_id) for q in admin.route(topic).read_queues}
    except TopicNotFoundError:
        if stored is None:
            raise
        now = set()
    if stored is None:
        if not now:
            raise BrokerUnreachableError(
                f"topic {topic!r}",
                admin.settings.namesrv_addr,
                "its route names no broker group with queues; is the broker running and "
                "registered with the name server?",
            )
        current = TopicLayout(topic, tuple(now))
        _check_count(current, expected)
        admin.put_kv(LAYOUT_NAMESPACE, topic, current.encode())
        return current
    layout = TopicLayout.decode(topic, stored)
    _check_count(layout, expected)
    extra = now - set(layout.pairs)
    if extra:
        raise LayoutChangedError(
            f"topic {topic!r} now has queues that its layout, fixed when the engine first "
            f"used it, lacks ({describe_pairs(extra)}; the layout is "
            f"{describe_pairs(layout.pairs)}). Queue indices carry keys and state, so they "
            "cannot change under a running job: remove those queues again, or read the topic "
            "under a new job id"
        )
    missing = set(layout.pairs) - now
    if missing and progress is not None:
        progress(
            f"topic {topic}: {describe_pairs(missing)} are not in the route now (broker group "
            "down?); their reads and writes wait for it to come back"
        )
    return layout


def _check_count(layout: TopicLayout, expected: int | None) -> None:
    if expected is not None and len(layout) != expected:
        raise LayoutChangedError(
            f"topic {layout.topic} has {len(layout)} queues ({describe_pairs(layout.pairs)}) but "
            f"the engine expects {expected} (STREAM_ASSETS_ENGINE_SHUFFLE_QUEUES; for the step "
            "log of a source with exactly-once sinks, the source topic's count); a job keeps "
            "its shuffle and source queue counts for life: set it back, or run the topology "
            "under a new job id"
        )
