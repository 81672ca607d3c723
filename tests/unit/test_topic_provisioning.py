"""Provisioning a topology's topics and fixing their layouts, against an in-memory
stand-in for the admin client (the same against real broker groups: see
tests/integration/test_multi_broker.py)."""

from __future__ import annotations

from typing import cast

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import (
    BrokerRoute,
    MessageQueue,
    RocketMQAdmin,
    TopicRoute,
    spread_queues,
)
from stream_assets.rocketmq.errors import TopicNotFoundError
from stream_assets.rocketmq.layout import LAYOUT_NAMESPACE, TopicLayout
from stream_assets.rocketmq.provision import (
    LayoutChangedError,
    ProvisionedTopics,
    SourceTopicNotFoundError,
    provision_topics,
    topic_queue_counts,
)
from stream_assets.serde import text_deserializer
from stream_assets.settings import EngineSettings, RocketMQSettings

ENGINE = EngineSettings(shuffle_queues=4, sink_queues=2)
SHUFFLE = "wordcount__shuffle__aggregate"
STATE = "wordcount__state__aggregate"


class FakeAdmin:
    """Topics on broker groups (queue count per group), a name-server KV; records creations."""

    def __init__(self, topics: dict[str, dict[str, int]], masters: tuple[str, ...] = ("broker-a",)):
        self.settings = RocketMQSettings(namesrv_addr="127.0.0.1:1")
        self.topics = {t: dict(groups) for t, groups in topics.items()}
        self.masters = masters
        self.created: list[tuple[str, int]] = []
        self.kv: dict[tuple[str, str], str] = {}
        #: Broker groups missing from every route (down).
        self.down: set[str] = set()

    def route(self, topic: str) -> TopicRoute:
        groups = {b: n for b, n in self.topics.get(topic, {}).items() if b not in self.down}
        if not groups:
            raise TopicNotFoundError(topic, self.settings.namesrv_addr)
        return TopicRoute(topic, {b: BrokerRoute("127.0.0.1:2", n, n) for b, n in groups.items()})

    def topic_exists(self, topic: str) -> bool:
        try:
            self.route(topic)
        except TopicNotFoundError:
            return False
        return True

    def create_topic(self, topic: str, queues: int, spread: bool = False) -> None:
        assert spread, "the engine lays its topics' totals out over the groups"
        self.topics[topic] = spread_queues(queues, self.masters)
        self.created.append((topic, queues))

    def get_kv(self, namespace: str, key: str) -> str | None:
        return self.kv.get((namespace, key))

    def put_kv(self, namespace: str, key: str, value: str) -> None:
        self.kv[(namespace, key)] = value


def _provision(fake: FakeAdmin, lines: list[str] | None = None) -> ProvisionedTopics:
    progress = None if lines is None else lines.append
    return provision_topics(cast(RocketMQAdmin, fake), wordcount.build(), ENGINE, progress)


def test_missing_source_names_the_topic_and_the_fix_and_creates_nothing() -> None:
    fake = FakeAdmin({})
    with pytest.raises(SourceTopicNotFoundError) as info:
        _provision(fake)
    message = str(info.value)
    assert "source topic 'sourceTopic' of topology 'wordcount'" in message
    assert "stream-assets topic create sourceTopic --queues" in message
    # Still a TopicNotFoundError: callers that handle that keep working.
    assert isinstance(info.value, TopicNotFoundError) and info.value.topic == "sourceTopic"
    assert fake.created == []


def test_missing_topics_are_created_once_with_their_queue_counts() -> None:
    fake = FakeAdmin({"sourceTopic": {"broker-a": 3}})
    lines: list[str] = []
    topics = _provision(fake, lines)
    assert topics.source_queues == {"sourceTopic": (0, 1, 2)}
    assert topics.layouts["sourceTopic"].pairs == (
        ("broker-a", 0),
        ("broker-a", 1),
        ("broker-a", 2),
    )
    assert fake.created == list(topic_queue_counts(wordcount.build(), ENGINE).items())
    assert dict(fake.created) == {
        SHUFFLE: 4,
        STATE: 4,
        "wordcount-out": 2,
        "wordcount__dead-letters": 1,
    }
    assert lines[0] == f"creating topic {SHUFFLE} (4 queues)"
    fake.created.clear()
    assert _provision(fake) == topics
    assert fake.created == []


def test_two_broker_groups_every_queue_of_the_source_and_totals_spread() -> None:
    fake = FakeAdmin({"sourceTopic": {"broker-b": 4, "broker-a": 4}}, ("broker-a", "broker-b"))
    topics = _provision(fake)
    source = topics.layouts["sourceTopic"]
    # Both groups' queues, sorted by broker then id (RocketMQ's own order).
    assert topics.source_queues == {"sourceTopic": tuple(range(8))}
    assert [source.queue(i) for i in (0, 3, 4, 7)] == [
        MessageQueue("sourceTopic", "broker-a", 0),
        MessageQueue("sourceTopic", "broker-a", 3),
        MessageQueue("sourceTopic", "broker-b", 0),
        MessageQueue("sourceTopic", "broker-b", 3),
    ]
    # The engine's topics have the configured total, half on each group,
    # and a state queue pairs with the shuffle queue of the same (broker, id).
    for topic in (SHUFFLE, STATE):
        assert fake.topics[topic] == {"broker-a": 2, "broker-b": 2}
        assert len(topics.layouts[topic]) == ENGINE.shuffle_queues
    assert topics.layouts[SHUFFLE].pairs == topics.layouts[STATE].pairs
    assert fake.topics["wordcount__dead-letters"] == {"broker-a": 1}


def test_a_sink_before_any_aggregate_exactly_once_gets_a_step_log_of_the_source_s_count() -> None:
    """Its step log pairs each source queue with a state queue of the same index: one per
    source queue, whatever the shuffle count, spread as the source is."""
    fake = FakeAdmin({"sourceTopic": {"broker-b": 3, "broker-a": 3}}, ("broker-a", "broker-b"))
    topology = wordcount.build(exactly_once=True)
    builder = StreamBuilder("copies", exactly_once_sinks=True)
    builder.source("sourceTopic", text_deserializer).sink("copied")
    copies = builder.build()
    log = copies.stages[0].state_topic
    assert log == "copies__state__source-0" and not topology.stages[0].positioned
    topics = provision_topics(cast(RocketMQAdmin, fake), copies, ENGINE)
    assert dict(fake.created)[log] == 6 and fake.topics[log] == {"broker-a": 3, "broker-b": 3}
    assert len(topics.layouts[log]) == len(topics.layouts["sourceTopic"]) == 6
    fake.topics["sourceTopic"] = {"broker-a": 4, "broker-b": 4}  # the source grew
    fake.kv.pop((LAYOUT_NAMESPACE, "sourceTopic"))
    with pytest.raises(LayoutChangedError, match="source topic's count"):
        provision_topics(cast(RocketMQAdmin, fake), copies, ENGINE)


def test_a_group_gone_from_the_route_keeps_the_layout() -> None:
    fake = FakeAdmin({"sourceTopic": {"broker-a": 2, "broker-b": 2}}, ("broker-a", "broker-b"))
    first = _provision(fake)
    fake.down.add("broker-a")
    lines: list[str] = []
    again = _provision(fake, lines)
    assert again == first  # the same indices, not a renumbering onto broker-b
    assert any("broker-a: 0, 1" in line and "not in the route" in line for line in lines)
    assert fake.created == list(topic_queue_counts(wordcount.build(), ENGINE).items())


def test_a_source_that_gained_queues_is_refused_naming_them() -> None:
    fake = FakeAdmin({"sourceTopic": {"broker-a": 2}}, ("broker-a", "broker-b"))
    _provision(fake)
    fake.topics["sourceTopic"]["broker-b"] = 2
    with pytest.raises(LayoutChangedError, match=r"sourceTopic.*broker-b: 0, 1.*new job id"):
        _provision(fake)


def test_a_shuffle_or_state_topic_with_another_queue_count_is_refused() -> None:
    for topic in (SHUFFLE, STATE):
        fake = FakeAdmin({"sourceTopic": {"broker-a": 2}, topic: {"broker-a": 4, "broker-b": 4}})
        with pytest.raises(ValueError, match=rf"{topic} has 8 queues.*SHUFFLE_QUEUES"):
            _provision(fake)


def test_the_stored_layout_is_what_the_name_server_holds() -> None:
    fake = FakeAdmin({"sourceTopic": {"broker-a": 2, "broker-b": 1}}, ("broker-a", "broker-b"))
    topics = _provision(fake)
    stored = fake.kv[(LAYOUT_NAMESPACE, "sourceTopic")]
    assert TopicLayout.decode("sourceTopic", stored) == topics.layouts["sourceTopic"]


def test_sinks_keep_whatever_queue_count_they_have() -> None:
    fake = FakeAdmin({"sourceTopic": {"broker-a": 2}, "wordcount-out": {"broker-a": 16}})
    _provision(fake)
    assert "wordcount-out" not in dict(fake.created)
