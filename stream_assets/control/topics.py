"""A topology's topics on the broker: the source must exist, the rest is created if missing.

The source topic belongs to the user: its queue count is the parallelism of
stage 0, a choice only the user makes, so a missing source is an error that
says how to create it, and nothing else is created. Every other topic belongs
to the topology and is created on first use: shuffle and state topics with
``EngineSettings.shuffle_queues`` queues, sink and late-record topics with
``sink_queues``, the dead-letter topic with one. Shuffle and state topics
that exist must have exactly ``shuffle_queues`` queues: records are routed to
a shuffle queue by key hash modulo the count, and a state queue pairs with
the shuffle queue of the same id, so a job keeps that count for life.

The scale job provisions before it allocates queues (the allocation needs
the source's queue ids), an instance before it starts its queries.

Example::

    >>> with RocketMQAdmin(settings) as admin:  # doctest: +SKIP
    ...     topics = provision_topics(admin, wordcount.build(), EngineSettings(), print)
    creating topic wordcount__shuffle__key_by-2 (8 queues)
    ...
    >>> topics.source_queues  # doctest: +SKIP
    (0, 1, 2, 3)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError, TopicNotFoundError
from stream_assets.settings import EngineSettings


@dataclass(frozen=True)
class ProvisionedTopics:
    """What running a topology needs to know of its topics once they are provisioned.

    ``broker_name`` is the broker the first source topic lives on (the first
    by name when it spans several): where stage queues are addressed and
    consumer offsets committed. ``source_queues`` are each source topic's
    readable queue ids, the queues its source stage allocates.
    """

    broker_name: str
    source_queues: dict[str, tuple[int, ...]]


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


def topic_queue_counts(topology: Topology, engine: EngineSettings) -> dict[str, int]:
    """Every topic the topology writes, with the queue count it is created with.

    A topic with two roles (a sink that is also a late-record topic) takes
    the count of its first: shuffle, state, sink, late, dead letters.

    Example::

        >>> from stream_assets.examples import wordcount
        >>> engine = EngineSettings(shuffle_queues=4, sink_queues=2)
        >>> for topic, queues in topic_queue_counts(wordcount.build(), engine).items():
        ...     print(topic, queues)
        wordcount__shuffle__key_by-2 4
        wordcount__state__aggregate-3 4
        wordcount-out 2
        wordcount__dead-letters 1
    """
    wanted = {t: engine.shuffle_queues for t in topology.shuffle_topics}
    wanted |= {t: engine.shuffle_queues for t in topology.state_topics}
    for topic in (*topology.sink_topics, *topology.late_topics):
        wanted.setdefault(topic, engine.sink_queues)
    wanted.setdefault(topology.dead_letter_topic, 1)
    return wanted


def provision_topics(
    admin: RocketMQAdmin,
    topology: Topology,
    engine: EngineSettings,
    progress: Callable[[str], None] | None = None,
) -> ProvisionedTopics:
    """Check ``topology``'s source topic exists and create its other topics where missing.

    Raises :class:`SourceTopicNotFoundError` (a ``TopicNotFoundError``)
    before creating anything if the source is missing, and ``ValueError``
    naming ``STREAM_ASSETS_ENGINE_SHUFFLE_QUEUES`` if an existing shuffle or
    state topic has another queue count than ``engine.shuffle_queues``.
    ``progress`` hears of every topic created. Existing topics are left as
    they are, so calling it again (every instance start does) is cheap.

    Example::

        >>> topics = provision_topics(admin, topology, engine, context.log.info)  # doctest: +SKIP
        >>> topology_queues(topology, topics.source_queues, engine.shuffle_queues)  # doctest: +SKIP
        {'sourceTopic': [0, 1, 2, 3], 'wordcount__shuffle__key_by-2': [0, 1, 2, 3, 4, 5, 6, 7]}
    """
    routes = {}
    for source in topology.source_topics:
        try:
            route = admin.route(source)
        except TopicNotFoundError:
            raise SourceTopicNotFoundError(
                source, admin.settings.namesrv_addr, topology.job_id
            ) from None
        if not route.brokers:
            raise RocketMQError(
                f"source topic {source!r} has a route but no master broker serves "
                "it; is the broker running and registered with the name server?"
            )
        routes[source] = route
    provisioned = ProvisionedTopics(
        broker_name=sorted(routes[topology.source_topic].brokers)[0],
        source_queues={t: tuple(q.queue_id for q in r.read_queues) for t, r in routes.items()},
    )
    fixed = {*topology.shuffle_topics, *topology.state_topics}
    for topic, queues in topic_queue_counts(topology, engine).items():
        if not admin.topic_exists(topic):
            if progress is not None:
                progress(f"creating topic {topic} ({queues} queues)")
            admin.create_topic(topic, queues)
        elif topic in fixed:
            have = admin.route(topic).write_queue_count
            if have != queues:
                raise ValueError(
                    f"topic {topic} has {have} queues but the engine is configured for "
                    f"{queues} (STREAM_ASSETS_ENGINE_SHUFFLE_QUEUES); a job keeps its "
                    "shuffle queue count for life"
                )
    return provisioned
