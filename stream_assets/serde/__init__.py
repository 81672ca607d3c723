"""Deserializers (message -> value) and serializers (value -> body) for sources and sinks.

A deserializer takes the message body (bytes) and returns the record value; a
serializer takes a value and returns bytes. Plain callables work too.

Schema-bound formats, each a small picklable object made from its schema:
Avro (:func:`avro_deserializer`, :func:`avro_serializer`, in
:mod:`stream_assets.serde.avro`) and Protobuf (:func:`protobuf_deserializer`,
:func:`protobuf_serializer`, in :mod:`stream_assets.serde.protobuf`). Their
libraries load on first use, so importing this package stays cheap.

Example::

    >>> json_deserializer(b'{"k": "a", "v": 1}')
    {'k': 'a', 'v': 1}
    >>> json_serializer({"k": "a"})
    b'{"k":"a"}'
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stream_assets.serde.avro import (
        AvroDeserializer,
        AvroSerializer,
        avro_deserializer,
        avro_serializer,
    )
    from stream_assets.serde.errors import DecodeError, EncodeError, SchemaError, SerdeError
    from stream_assets.serde.protobuf import (
        ProtobufDeserializer,
        ProtobufSerializer,
        protobuf_deserializer,
        protobuf_serializer,
    )

Deserializer = Callable[[bytes], Any]
Serializer = Callable[[Any], bytes]

# Exported name -> submodule, imported on first access (PEP 562): fastavro and
# protobuf together cost tens of milliseconds that JSON-only topologies skip.
_LAZY = {
    "AvroDeserializer": "avro",
    "AvroSerializer": "avro",
    "avro_deserializer": "avro",
    "avro_serializer": "avro",
    "ProtobufDeserializer": "protobuf",
    "ProtobufSerializer": "protobuf",
    "protobuf_deserializer": "protobuf",
    "protobuf_serializer": "protobuf",
    "SerdeError": "errors",
    "SchemaError": "errors",
    "DecodeError": "errors",
    "EncodeError": "errors",
}

__all__ = [
    "AvroDeserializer",
    "AvroSerializer",
    "DecodeError",
    "Deserializer",
    "EncodeError",
    "ProtobufDeserializer",
    "ProtobufSerializer",
    "SchemaError",
    "SerdeError",
    "Serializer",
    "avro_deserializer",
    "avro_serializer",
    "bytes_deserializer",
    "json_deserializer",
    "json_serializer",
    "protobuf_deserializer",
    "protobuf_serializer",
    "text_deserializer",
    "text_serializer",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def text_deserializer(body: bytes) -> str:
    """UTF-8 text (invalid bytes raise, sending the record to the dead letters)."""
    return body.decode("utf-8")


def json_deserializer(body: bytes) -> Any:
    """A JSON document."""
    return json.loads(body)


def bytes_deserializer(body: bytes) -> bytes:
    """The body unchanged."""
    return body


#: One encoder for every body: ``json.dumps`` with options builds a new one per call,
#: a tenth of the cost of serializing a small result.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)


def json_serializer(value: Any) -> bytes:
    r"""Compact JSON (non-ASCII kept as UTF-8).

    >>> json_serializer({"key": "café", "count": 3})
    b'{"key":"caf\xc3\xa9","count":3}'
    """
    if c_make_encoder is None:  # an interpreter without the C accelerator
        return _COMPACT.encode(value).encode()
    # What _COMPACT.encode runs for one value, without its Python layers (half the
    # cost of a small body, one per WordCount result): the same C encoder, options
    # and cycle check (a fresh markers dict), so the same bytes and the same errors.
    chunks = c_make_encoder({}, str, encode_basestring, None, ":", ",", False, False, True)
    return "".join(chunks(value, 0)).encode()


def text_serializer(value: Any) -> bytes:
    """``str(value)`` as UTF-8."""
    return value if isinstance(value, bytes) else str(value).encode()
