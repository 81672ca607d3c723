"""Sources filtered by tag expression: parsing, the DSL, the reader, the test driver."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.reader import PullBatch, PullStatus, QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.rocketmq.tags import TagFilter
from stream_assets.serde import json_deserializer
from stream_assets.testing import TopologyTestDriver


@pytest.mark.parametrize(
    ("expression", "tags"),
    [
        (None, None),
        ("*", None),
        ("  ", None),
        ("A", {"A"}),
        (" B ||A", {"A", "B"}),
        ("A || * ", None),
    ],
)
def test_tag_expressions_parse_as_rocketmq_reads_them(
    expression: str | None, tags: set[str] | None
) -> None:
    parsed = TagFilter.parse(expression)
    assert parsed.tags == (None if tags is None else frozenset(tags))
    assert parsed.expression == ("*" if tags is None else " || ".join(sorted(tags)))


@pytest.mark.parametrize(
    ("expression", "problem"),
    [("A ||", "empty tag"), ("A || | B", "holds a space or"), ("A B", "space"), (7, "a str")],
)
def test_a_bad_tag_expression_fails_when_the_topology_is_built(
    expression: Any, problem: str
) -> None:
    b = StreamBuilder("tags")
    with pytest.raises((ValueError, TypeError), match=problem) as err:
        b.source("orders", json_deserializer, tags=expression)
    assert "tags: source 'orders'" in str(err.value)


def _topology(tags: str | None) -> Any:
    b = StreamBuilder("by-tag")
    b.source("orders", json_deserializer, tags=tags).key_by("k").count().to_rstream().sink("out")
    return b.build()


@pytest.mark.parametrize("tags", ["A || B", "C", None])
def test_a_source_counts_only_the_messages_its_tags_select(tags: str | None) -> None:
    rnd = random.Random(3)
    sent = [(rnd.choice(["A", "B", "C", None]), rnd.choice("xyz")) for _ in range(300)]
    wanted = TagFilter.parse(tags)
    expected = Counter(k for tag, k in sent if wanted.tags is None or tag in wanted.tags)
    with TopologyTestDriver(_topology(tags), source_queues=2, max_records_per_batch=7) as driver:
        for tag, k in sent:
            driver.pipe({"k": k}, tags=tag)
        driver.advance()
        latest = {o["key"]: o["count"] for o in driver.outputs()}
        assert latest == dict(expected)
        # Filtered messages count as read: every source queue committed to its end.
        assert driver.committed("orders") == [driver.broker.topic("orders").end(q) for q in (0, 1)]


class _FilteringBroker:
    """What a broker answers a tag-filtered pull: runs of filtered-out messages come back
    as an empty batch whose next offset passes them."""

    def __init__(self, tags: list[str]) -> None:
        self.tags = tags
        self.pulls: list[tuple[int, str]] = []

    def pull(self, queue: MessageQueue, offset: int, max_messages: int, tags: TagFilter) -> Any:
        self.pulls.append((offset, tags.expression))
        end = min(len(self.tags), offset + max_messages)
        records = [
            Record(queue.topic, 0, o, json.dumps({"o": o}).encode(), tags=self.tags[o])
            for o in range(offset, end)
            if tags.matches(self.tags[o])
        ]
        status = PullStatus.FOUND if records else PullStatus.NO_NEW_MESSAGES
        return PullBatch(queue, status, records, end, 0, len(self.tags))


def test_the_reader_reads_past_runs_the_broker_filtered_out() -> None:
    """(A tag-hash collision, which the reader drops itself, takes a real broker:
    tests/integration/test_source_tags.py.)"""
    tags = ["B"] * 50 + ["A"] + ["C"] * 40 + ["A", "A"] + ["B"] * 30
    broker = _FilteringBroker(tags)
    reader = QueueReader.__new__(QueueReader)
    reader.max_batch = 16
    reader.pull = broker.pull  # type: ignore[method-assign]
    queue = MessageQueue("orders", "broker-a", 0)
    got = list(reader.read(queue, 0, len(tags), TagFilter.parse("A")))
    assert [r.queue_offset for r in got] == [o for o, t in enumerate(tags) if t == "A"]
    assert {expression for _o, expression in broker.pulls} == {"A"}
    assert broker.pulls[-1][0] < len(tags) <= broker.pulls[-1][0] + 16  # read to the end
