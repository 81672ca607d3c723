"""The one msgpack encoding every state byte uses: bytes stay bin, str stays str.

Kept in one place so meta, changelog records and snapshots cannot drift apart
(and so the untyped ``msgpack`` import is wrapped once).

Example::

    >>> unpack(pack({"k": b"\\x00", 7: None}))
    {'k': b'\\x00', 7: None}
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack

from stream_assets.state.errors import StateFormatError

_DECODE_ERRORS = (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError)


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj``."""
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes) -> Any:
    """Inverse of :func:`pack`; integer map keys allowed (``origins`` uses them)."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except _DECODE_ERRORS as exc:
        raise StateFormatError(f"undecodable state bytes ({len(data)} bytes): {exc}") from exc


class StreamPacker:
    """Appends objects to one growing msgpack stream (snapshot key/value pairs)."""

    def __init__(self) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)

    def pack(self, obj: Any) -> bytes:
        """The encoding of ``obj`` as the stream's next object."""
        return self._packer.pack(obj)  # type: ignore[no-any-return]


class StreamUnpacker:
    """Reads objects back from a msgpack stream fed in arbitrary slices."""

    def __init__(self) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)

    def feed(self, data: bytes) -> Iterator[Any]:
        """Add ``data`` and yield every object now complete (a partial one waits)."""
        self._unpacker.feed(data)
        try:
            yield from self._unpacker
        except _DECODE_ERRORS as exc:
            raise StateFormatError(f"undecodable snapshot stream: {exc}") from exc
