"""Deserializers (message -> value) and serializers (value -> body) for sources and sinks.

A deserializer takes the message body (bytes) and returns the record value; a
serializer takes a value and returns bytes. Plain callables work too.

Example::

    >>> json_deserializer(b'{"k": "a", "v": 1}')
    {'k': 'a', 'v': 1}
    >>> json_serializer({"k": "a"})
    b'{"k":"a"}'
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

Deserializer = Callable[[bytes], Any]
Serializer = Callable[[Any], bytes]


def text_deserializer(body: bytes) -> str:
    """UTF-8 text (invalid bytes raise, sending the record to the dead letters)."""
    return body.decode("utf-8")


def json_deserializer(body: bytes) -> Any:
    """A JSON document."""
    return json.loads(body)


def bytes_deserializer(body: bytes) -> bytes:
    """The body unchanged."""
    return body


def json_serializer(value: Any) -> bytes:
    """Compact JSON (non-ASCII kept as UTF-8)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def text_serializer(value: Any) -> bytes:
    """``str(value)`` as UTF-8."""
    return value if isinstance(value, bytes) else str(value).encode()
