"""The one msgpack encoding of the engine: bytes stay bin, str stays str.

Shuffle messages, state values, state meta, changelog records and snapshots
all use it, so they cannot drift apart (and the untyped ``msgpack`` import is
wrapped once). No pickle travels on the wire.

Example::

    >>> unpack(pack({"k": b"\\x00", 7: None}))
    {'k': b'\\x00', 7: None}
    >>> unpack(pack(["a", [1, 2]]), use_list=False)  # tuples: hashable keys
    ('a', (1, 2))
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgpack

_packers = threading.local()

_DECODE_ERRORS = (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError)
#: What msgpack raises for a value it cannot encode (a set, an int beyond 64 bits...).
_ENCODE_ERRORS = (TypeError, ValueError, OverflowError)


class PackingError(ValueError):
    """Bytes that do not decode, or a value msgpack cannot encode (names the type)."""


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj``; :class:`PackingError` names what could not be encoded.

    >>> try:
    ...     pack({"n": [1, 2**70]})
    ... except PackingError as exc:
    ...     print(exc)
    cannot encode int 1180591620717411303424: Integer value out of range
    """
    packer = getattr(_packers, "packer", None)
    if packer is None:
        # One Packer per thread: packb builds a new one per call, which was a
        # third of the cost of packing a shuffle record. Not shared across
        # threads: its buffer is per instance.
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    try:
        return packer.pack(obj)  # type: ignore[no-any-return]
    except _ENCODE_ERRORS as exc:
        packer.reset()
        culprit = _culprit(obj)
        shown = repr(culprit)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise PackingError(f"cannot encode {type(culprit).__name__} {shown}: {exc}") from exc


def _culprit(obj: Any) -> Any:
    """The innermost part of ``obj`` msgpack refuses (only on the error path)."""
    parts: list[Any] = []
    if isinstance(obj, dict):
        parts = [p for kv in obj.items() for p in kv]
    elif isinstance(obj, list | tuple):
        parts = list(obj)
    for part in parts:
        try:
            msgpack.packb(part, use_bin_type=True)
        except _ENCODE_ERRORS:
            return _culprit(part)
    return obj


def unpack(data: bytes, use_list: bool = True) -> Any:
    """Inverse of :func:`pack`; integer map keys allowed (``origins`` uses them)."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=use_list)
    except _DECODE_ERRORS as exc:
        raise PackingError(f"undecodable msgpack ({len(data)} bytes): {exc}") from exc


def array_of_packed(items: list[bytes]) -> bytes:
    """A msgpack array whose elements are already packed (concatenated, no re-encoding).

    >>> unpack(array_of_packed([pack(1), pack("a")]))
    [1, 'a']
    """
    return msgpack.Packer().pack_array_header(len(items)) + b"".join(items)  # type: ignore[no-any-return]


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
            raise PackingError(f"undecodable msgpack stream: {exc}") from exc
