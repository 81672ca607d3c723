"""Provisioning a topology's topics, against an in-memory stand-in for the admin client."""

from __future__ import annotations

from typing import cast

import pytest

from stream_assets.control.topics import (
    ProvisionedTopics,
    SourceTopicNotFoundError,
    provision_topics,
    topic_queue_counts,
)
from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import RocketMQAdmin, TopicRoute
from stream_assets.rocketmq.errors import TopicNotFoundError
from stream_assets.settings import EngineSettings, RocketMQSettings

ENGINE = EngineSettings(shuffle_queues=4, sink_queues=2)
SHUFFLE = "wordcount__shuffle__key_by-2"
STATE = "wordcount__state__aggregate-3"


class FakeAdmin:
    """Topics on one broker, ``broker-a``; records what it creates."""

    def __init__(self, topics: dict[str, int]) -> None:
        self.settings = RocketMQSettings(namesrv_addr="127.0.0.1:1")
        self.topics = dict(topics)
        self.created: list[tuple[str, int]] = []

    def route(self, topic: str) -> TopicRoute:
        if topic not in self.topics:
            raise TopicNotFoundError(topic, self.settings.namesrv_addr)
        queues = self.topics[topic]
        return TopicRoute(topic, {"broker-a": ("127.0.0.1:2", queues, queues)})

    def topic_exists(self, topic: str) -> bool:
        return topic in self.topics

    def create_topic(self, topic: str, queues: int) -> None:
        self.topics[topic] = queues
        self.created.append((topic, queues))


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
    fake = FakeAdmin({"sourceTopic": 3})
    lines: list[str] = []
    topics = _provision(fake, lines)
    assert topics == ProvisionedTopics(
        broker_name="broker-a", source_queues={"sourceTopic": (0, 1, 2)}
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
    _provision(fake)
    assert fake.created == []


def test_a_shuffle_or_state_topic_with_another_queue_count_is_refused() -> None:
    for topic in (SHUFFLE, STATE):
        fake = FakeAdmin({"sourceTopic": 2, topic: 8})
        with pytest.raises(ValueError, match=rf"{topic} has 8 queues.*SHUFFLE_QUEUES"):
            _provision(fake)


def test_sinks_keep_whatever_queue_count_they_have() -> None:
    fake = FakeAdmin({"sourceTopic": 2, "wordcount-out": 16})
    _provision(fake)
    assert "wordcount-out" not in dict(fake.created)
