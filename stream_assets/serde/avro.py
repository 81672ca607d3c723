"""Avro bodies: one datum per message, no container file (read and written by fastavro).

The body is the datum's binary encoding alone, what Avro's "schemaless"
readers and writers exchange; with ``single_object=True`` it starts with Avro's
single-object header instead: the bytes ``C3 01`` and the writer schema's
8-byte CRC-64-AVRO fingerprint, which the deserializer checks.

Schema evolution: data written with ``writer_schema`` is read into the shape
of ``reader_schema`` by Avro's resolution rules (a field the reader added
takes its default, one it dropped is skipped, an int widens to a long...).

A schema is a dict (a record, enum...), a list (a union), a type name
(``"long"``), or the same as JSON text (an ``.avsc`` file's content). A schema
fastavro rejects, or a reader schema that cannot read the writer's data at
all, fails when the serde is made (:class:`~stream_assets.serde.errors.SchemaError`);
a body that does not decode raises
:class:`~stream_assets.serde.errors.DecodeError` naming the schema and what is
wrong, which becomes the record's dead-letter reason.

Records come back as dicts. Avro's logical types come back as Python objects
(``datetime``, ``Decimal``, ``UUID``), which a ``key_by`` shuffle cannot carry:
``map`` them to plain values before one.

Example::

    >>> v1 = {"type": "record", "name": "shop.Click", "fields": [
    ...     {"name": "user", "type": "string"}]}
    >>> v2 = {"type": "record", "name": "shop.Click", "fields": [
    ...     {"name": "user", "type": "string"},
    ...     {"name": "n", "type": "long", "default": 1}]}
    >>> body = avro_serializer(v1)({"user": "ann"})
    >>> body
    b'\\x06ann'
    >>> avro_deserializer(v1)(body)
    {'user': 'ann'}
    >>> avro_deserializer(v1, reader_schema=v2)(body)
    {'user': 'ann', 'n': 1}
    >>> avro_deserializer(v1)(b"\\x09ann")
    Traceback (most recent call last):
    ...
    stream_assets.serde.errors.DecodeError: Avro shop.Click: cannot decode a 4-byte body: ...

In a topology::

    >>> from stream_assets.dsl.builder import StreamBuilder
    >>> counts = {"type": "record", "name": "shop.ClickCount", "fields": [
    ...     {"name": "key", "type": "string"}, {"name": "count", "type": "long"}]}
    >>> b = StreamBuilder("clicks")
    >>> (b.source("clicks", avro_deserializer(v1, reader_schema=v2)).key_by("user").count()
    ...   .to_rstream().sink("click-counts", serializer=avro_serializer(counts)))
"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable
from typing import IO, Any, cast

import fastavro
from fastavro import _read_py, _write_py
from fastavro.read import SchemaResolutionError
from fastavro.schema import SchemaParseException, UnknownType, fingerprint
from fastavro.schema import to_parsing_canonical_form as canonical_form
from fastavro.validation import ValidationError, validate

from stream_assets.serde.errors import DecodeError, EncodeError, SchemaError

#: A dict (record, enum, ...), a list (union), a type name, or any of them as JSON text.
AvroSchema = dict[str, Any] | list[Any] | str

#: The two bytes opening an Avro single-object encoded body.
SINGLE_OBJECT_MAGIC = b"\xc3\x01"

_Reader = Callable[[IO[bytes], Any, Any], Any]
_Writer = Callable[[IO[bytes], Any, Any], None]

# fastavro's compiled reader and writer recurse on the C stack without a
# limit: a body nesting a recursive type a few thousand deep kills the
# executor's Python worker (SIGSEGV). For recursive schemas its pure-Python
# implementation is used instead, whose recursion limit raises a
# RecursionError: one dead letter, not a crashed task.
_FAST_READ = cast(_Reader, fastavro.schemaless_reader)
_SAFE_READ = cast(_Reader, _read_py.schemaless_reader)
_FAST_WRITE = cast(_Writer, fastavro.schemaless_writer)
_SAFE_WRITE = cast(_Writer, _write_py.schemaless_writer)

# The resolution probe decodes this many zero bytes: the writer's simplest datum
# (zeros, empty strings and arrays, the first union branch and enum symbol) for
# any schema without large fixed fields. So a reader that drops the first branch
# of a writer's union (or its first enum symbol, without a default) is refused
# up front, although the spec fails only the data that uses it: such a pair
# would dead-letter exactly those records, which is rarely what was meant.
_PROBE_BYTES = 4096
_MAX_DETAIL = 300


def avro_deserializer(
    writer_schema: AvroSchema,
    reader_schema: AvroSchema | None = None,
    *,
    single_object: bool = False,
) -> AvroDeserializer:
    """A deserializer of one Avro datum per body, written with ``writer_schema``.

    With ``reader_schema``, values come in the reader's shape (schema
    evolution). ``single_object``: bodies carry Avro's single-object header,
    whose fingerprint must be the writer schema's.
    """
    return AvroDeserializer(writer_schema, reader_schema, single_object=single_object)


def avro_serializer(schema: AvroSchema, *, single_object: bool = False) -> AvroSerializer:
    """A serializer writing each value as one Avro datum of ``schema``.

    A record's missing fields take their defaults and extra keys are left
    out; a value the schema cannot encode raises
    :class:`~stream_assets.serde.errors.EncodeError` naming the fields that
    do not fit. ``single_object``: each body starts with Avro's single-object header.
    """
    return AvroSerializer(schema, single_object=single_object)


class AvroDeserializer:
    """``body -> value`` for one Avro datum (see :func:`avro_deserializer`).

    Picklable: it pickles the schemas as given and parses them again when
    unpickled, so it ships to Spark executors with the topology.
    """

    def __init__(
        self,
        writer_schema: AvroSchema,
        reader_schema: AvroSchema | None = None,
        *,
        single_object: bool = False,
    ) -> None:
        self._setup(
            _load(writer_schema, "writer"),
            None if reader_schema is None else _load(reader_schema, "reader"),
            single_object,
        )

    def _setup(self, writer: Any, reader: Any, single_object: bool) -> None:
        self._sources = (writer, reader)
        self.single_object = single_object
        self.writer_schema: Any = _parse(writer, "writer")
        self.reader_schema: Any = None if reader is None else _parse(reader, "reader")
        self.name = _name(self.writer_schema)
        self._label = f"Avro {self.name}"
        if self.reader_schema is not None:
            self._label += f" (read with reader schema {_name(self.reader_schema)})"
        self._header = _header(self.writer_schema) if single_object else b""
        recursive = _recursive(self.writer_schema) or _recursive(self.reader_schema)
        self._read = _SAFE_READ if recursive else _FAST_READ
        if self.reader_schema is not None:
            self._check_resolution()

    def __call__(self, body: bytes) -> Any:
        stream = io.BytesIO(body)
        if self._header:
            if not body.startswith(self._header):
                raise DecodeError(f"{self._label}: {self._header_problem(body)}")
            stream.seek(len(self._header))
        try:
            value = self._read(stream, self.writer_schema, self.reader_schema)
        except Exception as exc:
            raise DecodeError(
                f"{self._label}: cannot decode a {len(body)}-byte body: {_decode_problem(exc)}"
            ) from exc
        left = len(body) - stream.tell()
        if left:
            raise DecodeError(
                f"{self._label}: {left} of {len(body)} bytes left over after the datum "
                "(written with another schema?)"
            )
        return value

    def _header_problem(self, body: bytes) -> str:
        size = len(SINGLE_OBJECT_MAGIC) + 8
        if len(body) < size or not body.startswith(SINGLE_OBJECT_MAGIC):
            return (
                "no single-object header (C3 01 and the schema fingerprint): "
                "was it written without single_object?"
            )
        return (
            f"written with the schema of fingerprint {body[2:size].hex()}, "
            f"not this writer schema ({self._header[2:].hex()})"
        )

    def _check_resolution(self) -> None:
        writer, reader = self.writer_schema, self.reader_schema
        problem = f"Avro reader schema {_name(reader)} cannot read data written with writer schema"
        if _renamed(writer, reader):
            # fastavro's message for this prints both parsed schemas whole
            raise SchemaError(
                f"{problem} {self.name}: a named type is matched by its name or the reader's "
                "aliases, and neither matches"
            )
        try:
            self._read(io.BytesIO(bytes(_PROBE_BYTES)), writer, reader)
        except SchemaResolutionError as exc:
            raise SchemaError(f"{problem} {self.name}: {_cut(str(exc))}") from exc
        except Exception:
            # Zeros are not a datum of every schema (a large fixed, say): such
            # a mismatch shows up per record instead, with the same message.
            pass

    def __getstate__(self) -> dict[str, Any]:
        writer, reader = self._sources
        return {"writer": writer, "reader": reader, "single_object": self.single_object}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["writer"], state["reader"], state["single_object"])

    def __repr__(self) -> str:
        return f"<AvroDeserializer {self._label[5:]}>"


class AvroSerializer:
    """``value -> body``: one Avro datum of ``schema`` (see :func:`avro_serializer`).

    Picklable like :class:`AvroDeserializer`.
    """

    def __init__(self, schema: AvroSchema, *, single_object: bool = False) -> None:
        self._setup(_load(schema, "writer"), single_object)

    def _setup(self, source: Any, single_object: bool) -> None:
        self._source = source
        self.single_object = single_object
        self.schema: Any = _parse(source, "writer")
        self.name = _name(self.schema)
        self._header = _header(self.schema) if single_object else b""
        self._write = _SAFE_WRITE if _recursive(self.schema) else _FAST_WRITE

    def __call__(self, value: Any) -> bytes:
        stream = io.BytesIO()
        stream.write(self._header)
        try:
            self._write(stream, self.schema, value)
        except Exception as exc:
            raise EncodeError(
                f"Avro {self.name}: cannot encode this {type(value).__name__}: "
                f"{self._encode_problem(value, exc)}"
            ) from exc
        return stream.getvalue()

    def _encode_problem(self, value: Any, exc: Exception) -> str:
        # The writer's own errors do not say where ("an integer is required");
        # validation names each field that does not fit.
        try:
            validate(value, self.schema, raise_errors=True)
        except ValidationError as invalid:
            return "; ".join(_misfit(e.field, e.datum, e.schema) for e in invalid.errors)
        except Exception:
            pass  # validation itself failed: the writer's error is all there is
        return _cut(f"{type(exc).__name__}: {exc}")

    def __getstate__(self) -> dict[str, Any]:
        return {"schema": self._source, "single_object": self.single_object}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["schema"], state["single_object"])

    def __repr__(self) -> str:
        return f"<AvroSerializer {self.name}>"


def _load(schema: Any, role: str) -> Any:
    """The schema as JSON data (what fastavro parses, and what is pickled)."""
    if isinstance(schema, str):
        text = schema.strip()
        if text[:1] in ("{", "[", '"'):
            try:
                return json.loads(text)
            except ValueError as exc:
                raise SchemaError(f"Avro {role} schema is not valid JSON: {exc}") from exc
        return text
    if isinstance(schema, dict | list):
        # A copy: the user's dict may change later, the pickled schema must not.
        return copy.deepcopy(schema)
    raise SchemaError(
        f"an Avro {role} schema is a dict, a list (union), a type name or JSON text, "
        f"got {type(schema).__name__}"
    )


def _parse(schema: Any, role: str) -> Any:
    try:
        return fastavro.parse_schema(schema)
    except UnknownType as exc:
        raise SchemaError(
            f"invalid Avro {role} schema {_given_name(schema)}: unknown type {exc.name!r}"
        ) from exc
    except (SchemaParseException, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SchemaError(
            f"invalid Avro {role} schema {_given_name(schema)}: "
            f"{_cut(f'{type(exc).__name__}: {exc}')}"
        ) from exc


def _given_name(schema: Any) -> str:
    if isinstance(schema, dict):
        name = schema.get("name")
        if isinstance(name, str):
            namespace = schema.get("namespace")
            return f"{namespace}.{name}" if namespace and "." not in name else name
        return f"of type {schema.get('type')!r}"
    return _cut(repr(schema), 60)


def _name(parsed: Any) -> str:
    """A named type's full name, else the schema's canonical form (cut)."""
    if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
        return str(parsed["name"])
    try:
        return _cut(canonical_form(parsed), 60)
    except Exception:
        return _cut(repr(parsed), 60)


def _header(parsed: Any) -> bytes:
    return SINGLE_OBJECT_MAGIC + bytes.fromhex(fingerprint(canonical_form(parsed), "CRC-64-AVRO"))


def _recursive(parsed: Any) -> bool:
    """Whether a named type refers to itself (a datum of it can nest without bound)."""

    def refers(schema: Any, enclosing: frozenset[str]) -> bool:
        if isinstance(schema, str):
            return schema in enclosing
        if isinstance(schema, list):
            return any(refers(branch, enclosing) for branch in schema)
        if not isinstance(schema, dict):
            return False
        kind = schema.get("type")
        if kind in ("record", "error"):
            inner = enclosing | {schema["name"]}
            return any(refers(field["type"], inner) for field in schema.get("fields", ()))
        if kind == "array":
            return refers(schema.get("items"), enclosing)
        if kind == "map":
            return refers(schema.get("values"), enclosing)
        if isinstance(kind, str):  # {"type": "Name"}: a reference
            return kind in enclosing
        return refers(kind, enclosing)  # {"type": {...}}: a nested schema

    return parsed is not None and refers(parsed, frozenset())


def _renamed(writer: Any, reader: Any) -> bool:
    """Both named types of one kind whose names do not match by Avro's rules."""
    if not (isinstance(writer, dict) and isinstance(reader, dict)):
        return False
    if writer.get("type") != reader.get("type") or "name" not in writer or "name" not in reader:
        return False
    short = str(writer["name"]).rsplit(".", 1)[-1]
    aliases = set(reader.get("aliases", ()))
    return short != str(reader["name"]).rsplit(".", 1)[-1] and not {writer["name"], short} & aliases


def _misfit(field: Any, datum: Any, schema: Any) -> str:
    where = field or "the value"
    if datum is None:
        return f"{where} is missing or None, expected {_name(schema)}"
    return f"{where} is {_cut(repr(datum), 60)} ({type(datum).__name__}), expected {_name(schema)}"


def _decode_problem(exc: Exception) -> str:
    text = str(exc)
    # The compiled reader reports a varint running past the end as an IndexError
    # on the body's bytes; a list index is a union branch or enum symbol.
    if isinstance(exc, EOFError) or (isinstance(exc, IndexError) and "string" in text):
        problem = "the body ends inside the datum (truncated, or written with another schema)"
        return f"{problem}: {_cut(text)}" if text and isinstance(exc, EOFError) else problem
    if isinstance(exc, IndexError):
        return "a union branch or enum symbol index out of range (written with another schema?)"
    if isinstance(exc, RecursionError):
        return "nested deeper than the recursion limit (corrupt, or written with another schema)"
    if isinstance(exc, SchemaResolutionError):
        return f"the reader schema cannot read it: {_cut(text)}"
    return _cut(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _cut(text: str, limit: int = _MAX_DETAIL) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
