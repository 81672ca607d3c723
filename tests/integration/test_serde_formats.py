"""Avro and Protobuf serdes on the real broker and Spark: one instance, exact vs a reference.

Each topology reads bodies of one format, counts per user and writes the
results in that format; the serdes travel to Spark's Python workers with the
topology (the Protobuf classes are built at run time, so the workers rebuild
them from the pickled descriptors). Input bodies are written, and sink bodies
read, with fastavro and the message classes directly; the reference is
computed from the generated input. One body in each run does not decode and
must be the only dead letter.
"""

from __future__ import annotations

import collections
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import fastavro
import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.records import Record
from stream_assets.serde import (
    avro_deserializer,
    avro_serializer,
    protobuf_deserializer,
    protobuf_serializer,
)
from stream_assets.settings import RocketMQSettings
from tests.integration._engine_util import Message, produce, read_topic, unique
from tests.integration.conftest import EngineHarness
from tests.serde_samples import (
    CLICK_V1,
    CLICK_V2,
    USER_TOTALS,
    Click,
    UserCount,
    avro_bytes,
    sample_clicks,
)

pytestmark = pytest.mark.integration

CATCH_UP_S = 240.0


def _current(records: Sequence[Record], decode: Callable[[bytes], Any]) -> dict[Any, Any]:
    """Per result key, the decoded body of its highest version (what docs/guarantees.md
    tells consumers: keep the last copy per message key ``job/op/<result key>/v<version>/
    <pos>``, and per result key the highest version is current)."""
    last = {r.keys[-1]: r.body for r in records}
    best: dict[str, tuple[int, bytes]] = {}
    for message_key, body in last.items():
        result_key, version, _position = message_key.rsplit("/", 2)
        number = int(version.removeprefix("v"))
        if result_key not in best or number > best[result_key][0]:
            best[result_key] = (number, body)
    return {k: decode(body) for k, (_, body) in best.items()}


def _run(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    build: Callable[[StreamBuilder, str, str], None],
    bodies: list[bytes],
    job: str,
) -> tuple[list[Record], list[Record]]:
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 2)
    builder = StreamBuilder(job)
    build(builder, source, sink)
    topology = builder.build()
    produce(client_settings, source, [Message(b, queue_id=i % 2) for i, b in enumerate(bodies)])
    inst = engine.start(engine.instance(topology, tmp_path / "state"))
    inst.await_caught_up(CATCH_UP_S)
    inst.check_failed()
    return read_topic(admin, sink), read_topic(admin, topology.dead_letter_topic)


def test_avro_with_a_reader_schema_round_trips_on_spark(
    engine: EngineHarness, admin: RocketMQAdmin, client_settings: RocketMQSettings, tmp_path: Path
) -> None:
    clicks = sample_clicks(31, 300)
    bodies = [avro_bytes(CLICK_V1, c) for c in clicks]
    bad_at = 150
    bad = bodies[bad_at][:-1]  # the last varint cut short
    bodies[bad_at] = bad

    def build(b: StreamBuilder, source: str, sink: str) -> None:
        (
            b.source(source, avro_deserializer(CLICK_V1, reader_schema=CLICK_V2))
            .key_by("user")
            .sum("dwell", "total")
            .count("n")
            .to_rstream()
            .sink(sink, serializer=avro_serializer(USER_TOTALS))
        )

    sink, dead = _run(
        engine, admin, client_settings, tmp_path, build, bodies, unique("it-serde-avro")
    )
    reference: dict[str, dict[str, Any]] = {}
    for i, c in enumerate(clicks):
        if i != bad_at:
            t = reference.setdefault(c["user"], {"key": c["user"], "total": 0, "n": 0})
            t["total"] += c["dwell"]
            t["n"] += 1
    schema = fastavro.parse_schema(USER_TOTALS)
    results = _current(sink, lambda body: fastavro.schemaless_reader(io.BytesIO(body), schema))
    assert {v["key"]: v for v in results.values()} == reference
    assert [r.body for r in dead] == [bad]
    assert dead[0].properties["reason"].startswith("DecodeError: Avro shop.Click")


def test_protobuf_built_at_run_time_round_trips_on_spark(
    engine: EngineHarness, admin: RocketMQAdmin, client_settings: RocketMQSettings, tmp_path: Path
) -> None:
    clicks = [{"user": c["user"], "dwell": c["dwell"]} for c in sample_clicks(37, 300)]
    bodies = [Click(**c).SerializeToString() for c in clicks]
    bad_at = 120
    bad = Click(user="a-long-user-name", dwell=1).SerializeToString()[:5]  # inside the string
    bodies[bad_at] = bad

    def build(b: StreamBuilder, source: str, sink: str) -> None:
        (
            b.source(source, protobuf_deserializer(Click, as_dict=True))
            .key_by("user")
            .count()
            .to_rstream()
            .sink(sink, serializer=protobuf_serializer(UserCount))
        )

    sink, dead = _run(
        engine, admin, client_settings, tmp_path, build, bodies, unique("it-serde-proto")
    )
    reference = collections.Counter(c["user"] for i, c in enumerate(clicks) if i != bad_at)
    results = _current(sink, UserCount.FromString)
    assert {m.key: m.count for m in results.values()} == dict(reference)
    assert [r.body for r in dead] == [bad]
    assert dead[0].properties["reason"].startswith("DecodeError: protobuf satest.Click")
