"""Schemas, message classes and inputs the Avro and Protobuf serde tests share.

The Protobuf message classes are built at run time from a FileDescriptorProto
(nothing generated is committed); one imports google/protobuf/timestamp.proto,
so descriptor dependencies travel when a serde is pickled.
"""

from __future__ import annotations

import io
import random
from typing import Any

import fastavro
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

CLICK_V1: dict[str, Any] = {
    "type": "record",
    "name": "Click",
    "namespace": "shop",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "page", "type": "string"},
        {"name": "dwell", "type": "int"},
    ],
}
# v2 drops page, widens dwell to long and adds country with a default.
CLICK_V2: dict[str, Any] = {
    "type": "record",
    "name": "Click",
    "namespace": "shop",
    "fields": [
        {"name": "user", "type": "string"},
        {"name": "dwell", "type": "long"},
        {"name": "country", "type": "string", "default": "zz"},
    ],
}
USER_TOTALS: dict[str, Any] = {
    "type": "record",
    "name": "shop.UserTotal",
    "fields": [
        {"name": "key", "type": "string"},
        {"name": "total", "type": "long"},
        {"name": "n", "type": "long"},
    ],
}
USERS = ["ann", "bob", "cy", "dé", "eve"]


def proto_classes() -> tuple[type[Any], type[Any]]:
    """satest.Click and satest.UserCount, built from descriptors in a private pool."""
    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="stream_assets_tests/clicks.proto",
        package="satest",
        syntax="proto3",
        dependency=["google/protobuf/timestamp.proto"],
    )
    click = proto.message_type.add(name="Click")
    for number, (name, kind) in enumerate(
        [("user", field.TYPE_STRING), ("page", field.TYPE_STRING), ("dwell", field.TYPE_INT32)],
        start=1,
    ):
        click.field.add(name=name, number=number, type=kind, label=field.LABEL_OPTIONAL)
    click.field.add(
        name="at",
        number=4,
        type=field.TYPE_MESSAGE,
        type_name=".google.protobuf.Timestamp",
        label=field.LABEL_OPTIONAL,
    )
    count = proto.message_type.add(name="UserCount")
    count.field.add(name="key", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    count.field.add(name="count", number=2, type=field.TYPE_INT64, label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(proto)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("satest.Click")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("satest.UserCount")),
    )


Click, UserCount = proto_classes()


def sample_clicks(seed: int, n: int) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    return [
        {
            "user": rnd.choice(USERS),
            "page": f"/p/{rnd.randrange(9)}",
            "dwell": rnd.randrange(1, 500),
        }
        for _ in range(n)
    ]


def avro_bytes(schema: Any, value: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), value)
    return out.getvalue()


def avro_value(schema: dict[str, Any], body: bytes) -> Any:
    return fastavro.schemaless_reader(io.BytesIO(body), fastavro.parse_schema(schema), None)
