"""Protobuf bodies: one serialized message of a generated message class per body.

:func:`protobuf_deserializer` gives the message object, or with
``as_dict=True`` a dict by :func:`google.protobuf.json_format.MessageToDict`:
the ``.proto`` field names, every field present (defaults included, except
unset fields with presence such as proto3 ``optional`` and sub-messages), and
the proto3 JSON mapping's values (64-bit integers as strings, bytes as
base64, enums by name). Message objects cannot cross a ``key_by`` shuffle,
dicts can: use ``as_dict=True`` (or ``map`` to plain values) before one.

:func:`protobuf_serializer` takes a message of the class or a dict in the
same JSON mapping (:func:`google.protobuf.json_format.ParseDict`; ints are
fine for 64-bit fields), and writes it deterministically (map fields in key
order).

A body that does not parse raises :class:`~stream_assets.serde.errors.DecodeError`
naming the message type, which becomes the record's dead-letter reason.
Protobuf parsing is lenient by design: fields the class does not know are
kept as unknown fields, so only malformed bodies fail.

Example (any generated class works; this one comes with protobuf)::

    >>> from google.protobuf.api_pb2 import Mixin
    >>> body = protobuf_serializer(Mixin)({"name": "google.storage", "root": "v1"})
    >>> body
    b'\\n\\x0egoogle.storage\\x12\\x02v1'
    >>> protobuf_deserializer(Mixin)(body).root
    'v1'
    >>> protobuf_deserializer(Mixin, as_dict=True)(body)
    {'name': 'google.storage', 'root': 'v1'}
    >>> protobuf_deserializer(Mixin)(b"\\x0a\\x05ab")
    Traceback (most recent call last):
    ...
    stream_assets.serde.errors.DecodeError: protobuf google.protobuf.Mixin: cannot parse ...

In a topology::

    >>> from stream_assets.dsl.builder import StreamBuilder
    >>> b = StreamBuilder("mixins")
    >>> (b.source("mixins", protobuf_deserializer(Mixin, as_dict=True))
    ...   .map(lambda m: {"name": m["root"], "root": m["name"]})
    ...   .sink("swapped", serializer=protobuf_serializer(Mixin)))

Serdes pickle the message class by import path when it is importable there
(a generated ``_pb2`` module), and carry its ``.proto`` file descriptors too,
so a class built at run time (``message_factory.GetMessageClass``) ships to
Spark executors as well, rebuilt there in a private descriptor pool.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any, cast

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FileDescriptor
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.message import Message

from stream_assets.serde.errors import DecodeError, EncodeError, SchemaError

_MAX_DETAIL = 300

# Classes rebuilt from descriptors, per (full name, files): every serde
# unpickled in one process shares one class, and one pool per message type.
_rebuilt: dict[tuple[str, tuple[bytes, ...]], type[Any]] = {}


def protobuf_deserializer(
    message_class: type[Any], *, as_dict: bool = False
) -> ProtobufDeserializer:
    """A deserializer of ``message_class`` (a generated message class, e.g. ``orders_pb2.Order``).

    Returns message objects, or dicts with ``as_dict=True``.
    """
    return ProtobufDeserializer(message_class, as_dict=as_dict)


def protobuf_serializer(
    message_class: type[Any], *, ignore_unknown_fields: bool = False
) -> ProtobufSerializer:
    """A serializer of ``message_class``: each value a message of it or a dict.

    A dict key the message has no field for fails the record, unless
    ``ignore_unknown_fields`` (e.g. to drop a windowed result's
    ``window_start``/``window_end``).
    """
    return ProtobufSerializer(message_class, ignore_unknown_fields=ignore_unknown_fields)


class ProtobufDeserializer:
    """``body -> message`` (or dict): see :func:`protobuf_deserializer`. Picklable."""

    def __init__(self, message_class: type[Any], *, as_dict: bool = False) -> None:
        self._setup(_checked(message_class, "protobuf_deserializer"), as_dict)

    def _setup(self, message_class: type[Any], as_dict: bool) -> None:
        self.message_class = message_class
        self.as_dict = as_dict
        self.name: str = message_class.DESCRIPTOR.full_name

    def __call__(self, body: bytes) -> Any:
        try:
            message = self.message_class.FromString(body)
        except Exception as exc:
            raise DecodeError(
                f"protobuf {self.name}: cannot parse a {len(body)}-byte body as {self.name} "
                f"(truncated, or another message type or format): {_cut(str(exc))}"
            ) from exc
        if not self.as_dict:
            return message
        return MessageToDict(
            message,
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"message_class": _class_state(self.message_class), "as_dict": self.as_dict}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(_class_from_state(state["message_class"]), state["as_dict"])

    def __repr__(self) -> str:
        return f"<ProtobufDeserializer {self.name}{' as dict' if self.as_dict else ''}>"


class ProtobufSerializer:
    """``message or dict -> body``: see :func:`protobuf_serializer`. Picklable."""

    def __init__(self, message_class: type[Any], *, ignore_unknown_fields: bool = False) -> None:
        self._setup(_checked(message_class, "protobuf_serializer"), ignore_unknown_fields)

    def _setup(self, message_class: type[Any], ignore_unknown_fields: bool) -> None:
        self.message_class = message_class
        self.ignore_unknown_fields = ignore_unknown_fields
        self.name: str = message_class.DESCRIPTOR.full_name

    def __call__(self, value: Any) -> bytes:
        if isinstance(value, Message):
            # By name, not class: a class rebuilt from descriptors on an
            # executor is another class of the same message type.
            given = value.DESCRIPTOR.full_name
            if given != self.name:
                raise EncodeError(f"protobuf {self.name}: got a {given} message")
            message = value
        elif isinstance(value, Mapping):
            message = self.message_class()
            try:
                ParseDict(value, message, ignore_unknown_fields=self.ignore_unknown_fields)
            except Exception as exc:
                raise EncodeError(
                    f"protobuf {self.name}: cannot encode the dict: {_cut(str(exc))}"
                ) from exc
        else:
            raise EncodeError(
                f"protobuf {self.name}: expected a {self.name} message or a dict, "
                f"got a {type(value).__name__}"
            )
        try:
            return cast(bytes, message.SerializeToString(deterministic=True))
        except Exception as exc:  # a proto2 message missing required fields
            raise EncodeError(f"protobuf {self.name}: {_cut(str(exc))}") from exc

    def __getstate__(self) -> dict[str, Any]:
        return {
            "message_class": _class_state(self.message_class),
            "ignore_unknown_fields": self.ignore_unknown_fields,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(_class_from_state(state["message_class"]), state["ignore_unknown_fields"])

    def __repr__(self) -> str:
        return f"<ProtobufSerializer {self.name}>"


def _checked(message_class: Any, what: str) -> type[Any]:
    if isinstance(message_class, Message):
        raise SchemaError(
            f"{what} takes the message class, not a message: {type(message_class).__name__}, "
            f"not an instance of it"
        )
    if not (
        isinstance(message_class, type)
        and issubclass(message_class, Message)
        and isinstance(getattr(message_class, "DESCRIPTOR", None), Descriptor)
    ):
        raise SchemaError(
            f"{what} takes a generated protobuf message class (e.g. orders_pb2.Order), "
            f"got {message_class!r}"
        )
    return message_class


def _class_state(message_class: type[Any]) -> dict[str, Any]:
    """What rebuilds ``message_class`` in another process: its import path and its files."""
    state: dict[str, Any] = {
        "name": message_class.DESCRIPTOR.full_name,
        "files": _files(message_class.DESCRIPTOR.file),
    }
    module = sys.modules.get(message_class.__module__ or "")
    if module is not None and _lookup(module, message_class.__qualname__) is message_class:
        state["module"] = message_class.__module__
        state["qualname"] = message_class.__qualname__
    return state


def _class_from_state(state: dict[str, Any]) -> type[Any]:
    name: str = state["name"]
    if "module" in state:
        # The generated class itself where it imports, so values are instances
        # of the class the user's code knows.
        try:
            found = _lookup(importlib.import_module(state["module"]), state["qualname"])
        except ImportError:
            found = None
        descriptor = getattr(found, "DESCRIPTOR", None)
        if isinstance(found, type) and getattr(descriptor, "full_name", None) == name:
            return found
    key = (name, tuple(state["files"]))
    rebuilt = _rebuilt.get(key)
    if rebuilt is None:
        pool = descriptor_pool.DescriptorPool()
        for serialized in key[1]:
            pool.AddSerializedFile(serialized)
        rebuilt = cast(type[Any], message_factory.GetMessageClass(pool.FindMessageTypeByName(name)))
        _rebuilt[key] = rebuilt
    return rebuilt


def _files(file: FileDescriptor) -> tuple[bytes, ...]:
    """``file`` and every file it imports, serialized, each after its imports."""
    ordered: dict[str, bytes] = {}

    def add(f: Any) -> None:
        if f.name in ordered:
            return
        for dependency in f.dependencies:
            add(dependency)
        ordered[f.name] = f.serialized_pb

    add(file)
    return tuple(ordered.values())


def _lookup(module: ModuleType, qualname: str) -> Any:
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


def _cut(text: str, limit: int = _MAX_DETAIL) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
