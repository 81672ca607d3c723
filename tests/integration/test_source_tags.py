"""A source filtered by tag expression on the real broker: the broker filters, the reader
drops tag-hash collisions, and offsets run to the topic's end."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.serde import json_deserializer
from stream_assets.settings import RocketMQSettings
from tests.integration._engine_util import (
    Message,
    current_results,
    produce,
    read_topic,
    unique,
)
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

CATCH_UP_S = 240.0
#: "Aa" and "BB" have the same Java String hashCode, which is all the broker compares:
#: it sends "BB" messages to a source that wants "Aa", and the reader must drop them.
WANTED, COLLIDES, OTHER = "Aa", "BB", "C"


def test_a_tag_filtered_source_counts_exactly_the_selected_messages(
    engine: EngineHarness, admin: RocketMQAdmin, client_settings: RocketMQSettings, tmp_path: Path
) -> None:
    job = unique("it-tags")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 2)
    rnd = random.Random(12)
    sent: list[tuple[str | None, str]] = []
    for i in range(900):
        # Long runs of other tags: whole pulls the broker filters out to nothing.
        tag = OTHER if 200 <= i < 600 else rnd.choice([WANTED, COLLIDES, OTHER, None])
        sent.append((tag, rnd.choice("pqrs")))
    produce(
        client_settings,
        source,
        [
            Message(json.dumps({"k": k}).encode(), queue_id=i % 2, tags=tag)
            for i, (tag, k) in enumerate(sent)
        ],
    )
    b = StreamBuilder(job)
    (
        b.source(source, json_deserializer, tags=f"{WANTED} || D")
        .key_by("k")
        .count()
        .to_rstream()
        .sink(sink)
    )
    inst = engine.start(engine.instance(b.build(), tmp_path / "state"))
    inst.await_caught_up(CATCH_UP_S)  # every source queue committed to its end
    inst.check_failed()
    expected = collections.Counter(k for tag, k in sent if tag == WANTED)
    assert sum(1 for tag, _k in sent if tag == COLLIDES) > 0
    counts = {v["key"]: v["count"] for v in current_results(read_topic(admin, sink)).values()}
    assert counts == dict(expected)
    assert inst.lag()[source] == 0
