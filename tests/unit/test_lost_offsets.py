"""Offsets a restarted master lost are committed again by the instance that committed them.

A RocketMQ master flushes consumer offsets every 5 s; killed in between, it
comes back with older ones. Nothing else commits those queues again until new
input arrives there (the source plans from its own positions), so without
this their lag stayed up for good (seen in CI: 203 messages, 240 s after the
master was back). The broker here is a fake that answers and forgets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import MessageQueue, QueueOffsets
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.runtime.spark.instance import Instance
from stream_assets.settings import EngineSettings, RocketMQSettings


class ForgetfulBroker:
    """Committed offsets and queue ends of one group, as a broker would answer them."""

    def __init__(self, queues: list[MessageQueue], end: int) -> None:
        self.committed: dict[MessageQueue, int | None] = dict.fromkeys(queues)
        self.end = end
        self.commits: list[dict[MessageQueue, int]] = []

    def group_offsets(
        self, group: str, topic: str, queues: list[MessageQueue]
    ) -> dict[MessageQueue, int | None]:
        return {q: self.committed.get(q) for q in queues}

    def topic_offsets(self, topic: str, queues: list[MessageQueue]) -> dict[MessageQueue, Any]:
        return {q: QueueOffsets(q, 0, self.end) for q in queues}

    def commit_consumer_offsets(self, group: str, offsets: Mapping[MessageQueue, int]) -> None:
        self.commits.append(dict(offsets))
        self.committed.update(offsets)


def _instance() -> tuple[Instance, ForgetfulBroker, list[MessageQueue], list[str]]:
    said: list[str] = []
    topology = wordcount.build()
    inst = Instance(
        topology, rocketmq=RocketMQSettings(), engine=EngineSettings(), progress=said.append
    )
    layouts = {}
    for stage in topology.stages:
        queues = [
            MessageQueue(stage.input_topic, b, i) for b in ("broker-a", "broker-b") for i in (0, 1)
        ]
        layouts[stage.input_topic] = TopicLayout.of(queues)
    inst._layouts = layouts
    source = layouts[topology.stages[0].input_topic].queues
    broker = ForgetfulBroker([q for layout in layouts.values() for q in layout.queues], end=10)
    inst._admin_obj = broker  # type: ignore[assignment]
    return inst, broker, list(source), said


def test_offsets_a_restarted_master_lost_are_committed_again() -> None:
    inst, broker, source, said = _instance()
    inst._commit_offsets({q: 10 for q in source})
    assert inst.lag()[source[0].topic] == 0
    # broker-a's master restarts with what it flushed before: two queues behind.
    broker.committed[source[0]], broker.committed[source[1]] = 4, None
    assert inst.lag()[source[0].topic] == 16  # the broker's word, until committed again
    assert "broker group broker-a lost the committed offsets of 2 queues" in said[-1]
    broker.commits.clear()
    assert inst.commit_waiting() == 0
    assert broker.commits == [{source[0]: 10, source[1]: 10}]
    assert inst.lag()[source[0].topic] == 0


def test_an_offset_the_broker_has_beyond_ours_is_left_alone() -> None:
    inst, broker, source, said = _instance()
    inst._commit_offsets({source[0]: 6})
    broker.committed[source[0]] = 9  # e.g. committed by the instance before this one
    broker.commits.clear()
    inst.lag()
    assert inst.commit_waiting() == 0 and broker.commits == [] and said == []


def test_a_commit_landing_while_the_broker_answers_is_no_loss() -> None:
    """The lag reader asks the broker outside the commit lock: a batch's commit that lands
    between the broker's answer and the comparison must not look like a master that lost
    offsets (a false warning seen in production-shaped runs)."""
    inst, broker, source, said = _instance()
    inst._commit_offsets({q: 5 for q in source})
    answer = broker.group_offsets

    def answer_then_commit(
        group: str, topic: str, queues: list[MessageQueue]
    ) -> dict[MessageQueue, int | None]:
        stale = answer(group, topic, queues)  # the broker answers from before ...
        if topic == source[0].topic:
            inst._commit_offsets({q: 9 for q in source})  # ... a commit that then lands
        return stale

    broker.group_offsets = answer_then_commit  # type: ignore[method-assign]
    broker.commits.clear()
    inst.lag()
    assert said == [] and inst.commit_waiting() == 0
    assert broker.commits == [{q: 9 for q in source[:2]}, {q: 9 for q in source[2:]}]
    # A real loss after that is still found, and the newest offset is what goes again.
    broker.group_offsets = answer  # type: ignore[method-assign]
    broker.committed[source[0]] = 2
    inst.lag()
    assert "lost the committed offsets of 1 queues" in said[-1]
    broker.commits.clear()
    assert inst.commit_waiting() == 0 and broker.commits == [{source[0]: 9}]
