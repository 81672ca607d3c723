"""Avro and Protobuf serdes (stream_assets.serde.avro / .protobuf), alone and in topologies.

Input bodies are written, and output bodies read, with fastavro and the
message classes directly, and every expected result is computed from the
input in plain Python: the serdes are checked against the libraries, the
topologies against a reference, never against themselves.

The Protobuf message classes are built at run time from a FileDescriptorProto
(nothing generated is committed); one imports google/protobuf/timestamp.proto,
so descriptor dependencies travel when a serde is pickled.
"""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from collections import Counter
from typing import Any

import fastavro
import pytest
from google.protobuf.api_pb2 import Mixin
from pyspark import cloudpickle

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.serde import (
    AvroDeserializer,
    DecodeError,
    EncodeError,
    ProtobufDeserializer,
    SchemaError,
    avro_deserializer,
    avro_serializer,
    json_deserializer,
    json_serializer,
    protobuf_deserializer,
    protobuf_serializer,
)
from stream_assets.testing import TopologyTestDriver
from tests.serde_samples import (
    CLICK_V1,
    CLICK_V2,
    USER_TOTALS,
    USERS,
    Click,
    UserCount,
    avro_bytes,
    avro_value,
    sample_clicks,
)


def _latest_by_key(outputs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Unwindowed aggregates emit each changed key's new result: the last one wins."""
    return {out["key"]: out for out in outputs}


def _totals(clicks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    totals: dict[str, dict[str, Any]] = {}
    for c in clicks:
        t = totals.setdefault(c["user"], {"key": c["user"], "total": 0, "n": 0})
        t["total"] += c["dwell"]
        t["n"] += 1
    return totals


# -- Avro through a topology ---------------------------------------------------


@pytest.mark.parametrize("single_object", [False, True])
def test_avro_in_aggregate_avro_out(single_object: bool) -> None:
    clicks = sample_clicks(1, 300)
    canonical = fastavro.schema.to_parsing_canonical_form(fastavro.parse_schema(CLICK_V1))
    header = b"\xc3\x01" + bytes.fromhex(fastavro.schema.fingerprint(canonical, "CRC-64-AVRO"))
    b = StreamBuilder("avro-totals")
    (
        b.source("clicks", avro_deserializer(CLICK_V1, single_object=single_object))
        .key_by("user")
        .sum("dwell", "total")
        .count("n")
        .to_rstream()
        .sink("totals", serializer=avro_serializer(USER_TOTALS))
    )
    with TopologyTestDriver(b.build(), source_queues=3, max_records_per_batch=40) as driver:
        for click in clicks:
            body = avro_bytes(CLICK_V1, click)
            driver.pipe(header + body if single_object else body)
        driver.advance()
        assert driver.dead_letters() == []
        outputs = driver.outputs(decode=lambda body: avro_value(USER_TOTALS, body))
        assert _latest_by_key(outputs) == _totals(clicks)


def test_avro_old_records_are_read_in_the_reader_schema_shape() -> None:
    clicks = sample_clicks(2, 200)
    b = StreamBuilder("avro-evolve")
    b.source("clicks", avro_deserializer(CLICK_V1, reader_schema=CLICK_V2)).sink("out")
    with TopologyTestDriver(b.build(), source_queues=2) as driver:
        driver.pipe_many([avro_bytes(CLICK_V1, c) for c in clicks])
        driver.advance()
        expected = [{"user": c["user"], "dwell": c["dwell"], "country": "zz"} for c in clicks]
        assert sorted(driver.outputs(), key=json.dumps) == sorted(expected, key=json.dumps)


def test_an_undecodable_avro_body_is_one_dead_letter_naming_the_schema() -> None:
    clicks = sample_clicks(3, 120)
    bad_at = 57
    good = avro_bytes(CLICK_V1, clicks[bad_at])
    bad = good[:-1]  # the last varint cut: the datum ends early
    with pytest.raises((EOFError, IndexError)):
        avro_value(CLICK_V1, bad)  # the reference: fastavro itself cannot read it
    b = StreamBuilder("avro-bad")
    (
        b.source("clicks", avro_deserializer(CLICK_V1))
        .key_by("user")
        .sum("dwell", "total")
        .count("n")
        .to_rstream()
        .sink("totals", serializer=avro_serializer(USER_TOTALS))
    )
    topology = b.build()
    with TopologyTestDriver(topology, source_queues=1) as driver:
        for i, click in enumerate(clicks):
            driver.pipe(bad if i == bad_at else avro_bytes(CLICK_V1, click))
        driver.advance()
        [(body, props)] = driver.dead_letters()
        assert body == bad
        assert props["operator"] == topology.stages[0].source.op_id  # type: ignore[union-attr]
        assert props["source_offset"] == str(bad_at)
        assert props["reason"].startswith("DecodeError: Avro shop.Click: ")
        assert "ends inside the datum" in props["reason"]
        outputs = driver.outputs(decode=lambda body: avro_value(USER_TOTALS, body))
        assert _latest_by_key(outputs) == _totals(clicks[:bad_at] + clicks[bad_at + 1 :])


def test_a_value_the_avro_sink_cannot_encode_is_one_dead_letter_naming_the_field() -> None:
    values = [{"user": u, "page": "/", "dwell": i} for i, u in enumerate(USERS * 4)]
    values[6]["dwell"] = "six"
    b = StreamBuilder("avro-sink")
    b.source("in", json_deserializer).sink("out", serializer=avro_serializer(CLICK_V1))
    topology = b.build()
    with TopologyTestDriver(topology, source_queues=1) as driver:
        driver.pipe_many(values)
        driver.advance()
        [(body, props)] = driver.dead_letters()
        assert json.loads(body) == values[6]
        assert props["operator"] == topology.stages[0].ops[-1].op_id
        assert props["reason"].startswith("EncodeError: Avro shop.Click: ")
        assert "shop.Click.dwell is 'six' (str)" in props["reason"]
        outputs = driver.outputs(decode=lambda body: avro_value(CLICK_V1, body))
        assert outputs == values[:6] + values[7:]


def test_an_avro_table_joins_a_stream() -> None:
    users = {
        "type": "record",
        "name": "shop.User",
        "fields": [{"name": "id", "type": "string"}, {"name": "tier", "type": "string"}],
    }
    rnd = random.Random(4)
    updates = [{"id": rnd.choice(USERS[:4]), "tier": rnd.choice("abc")} for _ in range(30)]
    clicks = sample_clicks(5, 80)
    b = StreamBuilder("avro-table")
    table = b.table("users", avro_deserializer(users), key="id")
    (
        b.source("clicks", json_deserializer)
        .join_table(
            table,
            key="user",
            joiner=lambda c, u: {"user": c["user"], "tier": None if u is None else u["tier"]},
            left=True,
        )
        .to_rstream()
        .sink("out")
    )
    latest = {u["id"]: u["tier"] for u in updates}
    with TopologyTestDriver(b.build(), source_queues=1) as driver:
        for i, u in enumerate(updates):
            driver.pipe(avro_bytes(users, u), topic="users", event_time=i + 1)
        driver.advance()
        driver.pipe_many(clicks, topic="clicks", event_time=1_000)
        driver.advance_idle()  # a joined value waits for the watermark to pass it
        assert driver.dead_letters() == []
        expected = [{"user": c["user"], "tier": latest.get(c["user"])} for c in clicks]
        assert sorted(driver.outputs(), key=json.dumps) == sorted(expected, key=json.dumps)


# -- Avro details --------------------------------------------------------------


def test_avro_single_object_header_is_the_spec_fingerprint() -> None:
    # The Avro specification's test vector: CRC-64-AVRO of the schema "null".
    fingerprint = (7195948357588979594).to_bytes(8, "little")
    assert avro_serializer("null", single_object=True)(None) == b"\xc3\x01" + fingerprint
    body = avro_serializer(CLICK_V1, single_object=True)({"user": "a", "page": "/", "dwell": 1})
    assert body[:2] == b"\xc3\x01"
    assert avro_value(CLICK_V1, body[10:]) == {"user": "a", "page": "/", "dwell": 1}
    read = avro_deserializer(CLICK_V1, single_object=True)
    with pytest.raises(DecodeError, match="no single-object header"):
        read(body[10:])
    other = avro_serializer(CLICK_V2, single_object=True)({"user": "a", "dwell": 1})
    with pytest.raises(DecodeError, match=f"fingerprint {other[2:10].hex()}"):
        read(other)


def test_avro_trailing_bytes_and_wrong_types_are_decode_errors() -> None:
    body = avro_bytes(CLICK_V1, {"user": "a", "page": "/", "dwell": 1})
    read = avro_deserializer(CLICK_V1)
    with pytest.raises(DecodeError, match=r"Avro shop\.Click: 2 of \d+ bytes left over"):
        read(body + b"\x00\x00")
    # A JSON body read as Avro: a string length of -62 ('{' zigzag-decoded).
    with pytest.raises(DecodeError, match=r"^Avro shop\.Click: cannot decode a 9-byte body"):
        read(b'{"a": 1}\n')


def test_recursive_avro_schemas_fail_deep_bodies_without_crashing() -> None:
    node = {
        "type": "record",
        "name": "Node",
        "fields": [{"name": "next", "type": ["null", "Node"], "default": None}],
    }
    read = avro_deserializer(node)
    assert read(avro_bytes(node, {"next": {"next": None}})) == {"next": {"next": None}}
    # Union branch 1 (zigzag 2) nested 100,000 deep: fastavro's compiled reader
    # would overflow the C stack and kill the process.
    with pytest.raises(DecodeError, match="deeper than the recursion limit"):
        read(b"\x02" * 100_000 + b"\x00")


@pytest.mark.parametrize(
    ("reader", "message"),
    [
        (
            {**CLICK_V1, "fields": [*CLICK_V1["fields"], {"name": "x", "type": "long"}]},
            "No default value for field x",
        ),
        ({**CLICK_V1, "name": "Tap"}, "neither matches"),
        ({**CLICK_V1, "fields": [{"name": "user", "type": "long"}]}, "string is not long"),
    ],
)
def test_a_reader_schema_that_cannot_read_the_writer_fails_at_construction(
    reader: dict[str, Any], message: str
) -> None:
    with pytest.raises(
        SchemaError, match=r"cannot read data written with writer schema shop\.Click"
    ):
        avro_deserializer(CLICK_V1, reader_schema=reader)
    with pytest.raises(SchemaError, match=message):
        avro_deserializer(CLICK_V1, reader_schema=reader)


def test_renamed_records_resolve_through_aliases() -> None:
    tap = {**CLICK_V2, "name": "Tap", "aliases": ["Click"]}
    body = avro_bytes(CLICK_V1, {"user": "a", "page": "/", "dwell": 3})
    assert avro_deserializer(CLICK_V1, tap)(body) == {"user": "a", "dwell": 3, "country": "zz"}


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"type": "record", "name": "shop.Bad", "fields": [{"name": "a", "type": "lng"}]},
            "invalid Avro writer schema shop.Bad: unknown type 'shop.lng'",
        ),
        ('{"type": "record", "name": ', "Avro writer schema is not valid JSON"),
        (42, "a dict, a list"),
        (
            {
                "type": "record",
                "name": "D",
                "fields": [{"name": "a", "type": "int", "default": "x"}],
            },
            "invalid Avro writer schema D: SchemaParseException: Default value <x>",
        ),
    ],
)
def test_an_invalid_avro_schema_fails_at_construction(schema: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message.replace(".", r"\.")):
        avro_serializer(schema)
    with pytest.raises(SchemaError, match=message.replace(".", r"\.")):
        avro_deserializer(schema)
    b = StreamBuilder("bad-schema")
    with pytest.raises(SchemaError):
        b.source("in", avro_deserializer(schema))


def test_avro_schema_as_json_text_and_a_primitive() -> None:
    assert avro_deserializer(json.dumps(CLICK_V1)).name == "shop.Click"
    assert avro_deserializer("long")(avro_serializer("long")(-3)) == -3
    assert avro_serializer(["null", "string"])("x") == avro_bytes(["null", "string"], "x")


# -- Protobuf through a topology -----------------------------------------------


def test_protobuf_in_count_protobuf_out() -> None:
    clicks = sample_clicks(6, 300)
    b = StreamBuilder("pb-counts")
    (
        b.source("clicks", protobuf_deserializer(Click, as_dict=True))
        .key_by("user")
        .count()
        .to_rstream()
        .sink("counts", serializer=protobuf_serializer(UserCount))
    )
    with TopologyTestDriver(b.build(), source_queues=3, shuffle_queues=2) as driver:
        for c in clicks:
            driver.pipe(Click(**c).SerializeToString())
        driver.advance()
        assert driver.dead_letters() == []
        latest: dict[str, int] = {}
        for record in driver.output_records():
            message = UserCount.FromString(record.body)
            latest[message.key] = message.count
        assert latest == dict(Counter(c["user"] for c in clicks))


def test_protobuf_messages_in_avro_out() -> None:
    clicks = sample_clicks(7, 100)
    b = StreamBuilder("pb-avro")
    (
        b.source("clicks", protobuf_deserializer(Click))
        .filter(lambda m: m.dwell % 2 == 0)
        .map(lambda m: {"user": m.user, "page": m.page, "dwell": m.dwell * 10})
        .sink("out", serializer=avro_serializer(CLICK_V1))
    )
    with TopologyTestDriver(b.build(), source_queues=1) as driver:
        for c in clicks:
            driver.pipe(Click(**c).SerializeToString())
        driver.advance()
        outputs = driver.outputs(decode=lambda body: avro_value(CLICK_V1, body))
        assert outputs == [{**c, "dwell": c["dwell"] * 10} for c in clicks if c["dwell"] % 2 == 0]


def test_an_undecodable_protobuf_body_is_one_dead_letter_naming_the_message() -> None:
    clicks = sample_clicks(8, 90)
    bad_at = 31
    bad = Click(**clicks[bad_at]).SerializeToString()[:-1]  # the page or user string cut short
    with pytest.raises(Exception, match=r"satest\.Click"):
        Click.FromString(bad)  # the reference: protobuf itself cannot parse it
    b = StreamBuilder("pb-bad")
    (
        b.source("clicks", protobuf_deserializer(Click, as_dict=True))
        .key_by("user")
        .count()
        .to_rstream()
        .sink("counts", serializer=protobuf_serializer(UserCount))
    )
    topology = b.build()
    with TopologyTestDriver(topology, source_queues=1) as driver:
        for i, c in enumerate(clicks):
            driver.pipe(bad if i == bad_at else Click(**c).SerializeToString())
        driver.advance()
        [(body, props)] = driver.dead_letters()
        assert body == bad
        assert props["source_offset"] == str(bad_at)
        assert props["reason"].startswith("DecodeError: protobuf satest.Click: cannot parse")
        latest = {}
        for record in driver.output_records():
            message = UserCount.FromString(record.body)
            latest[message.key] = message.count
        good = clicks[:bad_at] + clicks[bad_at + 1 :]
        assert latest == dict(Counter(c["user"] for c in good))


# -- Protobuf details ----------------------------------------------------------


def test_protobuf_dicts_use_field_names_and_the_json_mapping() -> None:
    message = Click(user="ann", dwell=0)
    message.at.FromSeconds(5)
    as_dict = protobuf_deserializer(Click, as_dict=True)(message.SerializeToString())
    # Defaults are present; the Timestamp and int64 follow the proto3 JSON mapping.
    assert as_dict == {"user": "ann", "page": "", "dwell": 0, "at": "1970-01-01T00:00:05Z"}
    count = protobuf_deserializer(UserCount, as_dict=True)
    assert count(UserCount(key="k", count=2**40).SerializeToString()) == {
        "key": "k",
        "count": str(2**40),
    }
    write = protobuf_serializer(Click)
    assert Click.FromString(write(as_dict)) == message
    assert write({"user": "ann", "dwell": 0, "at": "1970-01-01T00:00:05Z"}) == write(message)


def test_protobuf_serializer_errors_name_the_message_and_field() -> None:
    write = protobuf_serializer(UserCount)
    with pytest.raises(
        EncodeError, match=r'protobuf satest\.UserCount: .*no field named "window_end"'
    ):
        write({"key": "a", "count": 1, "window_end": 10})
    lenient = protobuf_serializer(UserCount, ignore_unknown_fields=True)
    assert lenient({"key": "a", "count": 1, "window_end": 10}) == write({"key": "a", "count": 1})
    with pytest.raises(EncodeError, match=r"got a satest\.Click message"):
        write(Click(user="a"))
    with pytest.raises(
        EncodeError, match=r"expected a satest\.UserCount message or a dict, got a list"
    ):
        write(["a", 1])


@pytest.mark.parametrize("given", [Click(), "satest.Click", dict, 3])
def test_protobuf_serdes_take_a_message_class(given: Any) -> None:
    with pytest.raises(SchemaError, match="message class"):
        protobuf_deserializer(given)
    with pytest.raises(SchemaError, match="message class"):
        protobuf_serializer(given)


# -- pickling (topologies ship to Spark executors with cloudpickle) -------------


def test_every_serde_survives_cloudpickle_and_still_works() -> None:
    click = {"user": "ann", "page": "/x", "dwell": 7}
    avro_body = avro_bytes(CLICK_V1, click)
    pb_body = Click(**click).SerializeToString()
    serdes: list[tuple[Any, Any, Any]] = [
        (
            avro_deserializer(CLICK_V1, CLICK_V2),
            avro_body,
            {"user": "ann", "dwell": 7, "country": "zz"},
        ),
        (avro_serializer(CLICK_V1, single_object=True), click, None),
        (protobuf_deserializer(Click, as_dict=True), pb_body, click),
        (protobuf_serializer(Click), click, pb_body),
        (protobuf_deserializer(Mixin, as_dict=True), Mixin(name="n").SerializeToString(), None),
    ]
    for serde, given, expected in serdes:
        copy = cloudpickle.loads(cloudpickle.dumps(serde))
        assert type(copy) is type(serde)
        assert copy(given) == serde(given)
        if expected is not None:
            assert copy(given) == expected
    # A generated class travels by reference: values keep their class.
    mixin = cloudpickle.loads(cloudpickle.dumps(protobuf_deserializer(Mixin)))
    assert mixin.message_class is Mixin


def test_a_topology_runs_the_same_after_a_cloudpickle_round_trip() -> None:
    clicks = sample_clicks(9, 60)
    b = StreamBuilder("pickled")
    (
        b.source("clicks", avro_deserializer(CLICK_V1))
        .map(lambda c: {"user": c["user"], "page": c["page"], "dwell": c["dwell"]})
        .sink("out", serializer=protobuf_serializer(Click))
    )
    topology = b.build()
    bodies = [avro_bytes(CLICK_V1, c) for c in clicks]
    runs = []
    for t in (topology, cloudpickle.loads(cloudpickle.dumps(topology))):
        with TopologyTestDriver(t, source_queues=1) as driver:
            driver.pipe_many(bodies)
            driver.advance()
            runs.append([r.body for r in driver.output_records()])
    assert runs[0] == runs[1] == [Click(**c).SerializeToString() for c in clicks]


def test_a_runtime_built_message_class_is_rebuilt_in_a_fresh_process() -> None:
    """What an executor does: the class exists nowhere but in the pickle's descriptors."""
    message = Click(user="ann", page="/x", dwell=7)
    message.at.FromSeconds(9)
    serde = protobuf_deserializer(Click, as_dict=True)
    script = (
        "import json, pickle, sys\n"
        "serde = pickle.loads(sys.stdin.buffer.read())\n"
        "print(json.dumps(serde(bytes.fromhex(sys.argv[1]))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, message.SerializeToString().hex()],
        input=cloudpickle.dumps(serde),
        capture_output=True,
        check=True,
        timeout=120,
    )
    assert json.loads(done.stdout) == serde(message.SerializeToString())
    assert isinstance(pickle.loads(cloudpickle.dumps(serde)), ProtobufDeserializer)


def test_the_serde_package_imports_its_format_libraries_only_when_used() -> None:
    script = (
        "import sys\n"
        "import stream_assets.serde as s\n"
        "before = {m for m in ('fastavro', 'google.protobuf.json_format') if m in sys.modules}\n"
        "s.avro_deserializer, s.protobuf_serializer\n"
        "after = {m for m in ('fastavro', 'google.protobuf.json_format') if m in sys.modules}\n"
        "print(sorted(before), sorted(after))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, check=True, text=True, timeout=120
    )
    assert done.stdout.split("\n")[0] == "[] ['fastavro', 'google.protobuf.json_format']"
    assert isinstance(avro_deserializer("long"), AvroDeserializer)


def test_json_bodies_are_the_standard_encoders_bytes_and_errors() -> None:
    """``json_serializer`` runs the C encoder directly: for every kind of value it gives
    what ``json.dumps`` with the same options gives, and fails where it fails."""
    circular: list[Any] = []
    circular.append(circular)
    values: list[Any] = [
        {"key": "café", "count": 3},
        {"key": ("eu", 7), "sum": 2.5, "none": None, "ok": True},
        'text\n"quoted"',
        [1, {"a": [float("nan"), float("inf")]}],
        {1: "int key", 2.5: "float key", None: "null key"},
        {"set": {1}, "bytes": b"x"},  # not JSON: str() of it, as default=str says
        10**30,
        circular,
        {("tuple",): "a key JSON has not"},
    ]
    for value in values:
        try:
            expected: Any = json.dumps(
                value, separators=(",", ":"), ensure_ascii=False, default=str
            ).encode()
        except (TypeError, ValueError) as exc:
            expected = (type(exc), str(exc))
        try:
            got: Any = json_serializer(value)
        except (TypeError, ValueError) as exc:
            got = (type(exc), str(exc))
        assert got == expected, value
