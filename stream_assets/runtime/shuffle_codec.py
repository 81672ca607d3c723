"""The bodies of shuffle-topic messages (msgpack; no pickle on the wire).

One shuffle message carries every record one source queue sent to one shuffle
queue in one micro-batch, which is what makes a batch's delivery to a queue
all-or-nothing and keeps sends few (the broker's sync send costs ~1 ms).

- per-record: ``{"src": q, "recs": [[key, value, ts, offset, sub], ...]}``
- combined:   ``{"src": q, "comb": [[key, wstart, wend, acc, max_ts, n], ...],
  "end": [offset, sub], "n": records}`` (pre-aggregated per key and window)

Example::

    >>> decode(encode_records(3, [["k", 1, 10, 5, 0]]))["src"]
    3
"""

from __future__ import annotations

from typing import Any

import msgpack


def encode_key(key: Any) -> bytes:
    """Canonical bytes of a grouping key (hashing and state keys use them)."""
    return msgpack.packb(key, use_bin_type=True)  # type: ignore[no-any-return]


def decode_key(data: bytes) -> Any:
    """The key back from :func:`encode_key` (lists come back as tuples: hashable)."""
    return msgpack.unpackb(data, raw=False, use_list=False)


def encode_records(src: int, recs: list[list[Any]]) -> bytes:
    """A per-record shuffle message."""
    return msgpack.packb({"src": src, "recs": recs}, use_bin_type=True)  # type: ignore[no-any-return]


def encode_combined(
    src: int, entries: list[list[Any]], end: tuple[int, int], records: int
) -> bytes:
    """A pre-aggregated shuffle message ending at origin ``end``, standing for ``records``."""
    return msgpack.packb(  # type: ignore[no-any-return]
        {"src": src, "comb": entries, "end": list(end), "n": records}, use_bin_type=True
    )


def decode(body: bytes) -> dict[str, Any]:
    """A shuffle message back."""
    return msgpack.unpackb(body, raw=False, strict_map_key=False)  # type: ignore[no-any-return]


def pack_value(value: Any) -> bytes:
    """Encode an accumulator / record value for RocksDB."""
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def unpack_value(data: bytes) -> Any:
    """Decode what :func:`pack_value` wrote."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
