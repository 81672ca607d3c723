"""The bodies of shuffle-topic messages (msgpack via :mod:`stream_assets.serde.packing`).

One shuffle message carries every record one source queue sent to one shuffle
queue in one micro-batch, which is what makes a batch's delivery to a queue
all-or-nothing and keeps sends few.

- per-record: ``{"src": q, "recs": [[key, value, ts, offset, sub], ...]}``
- combined:   ``{"src": q, "comb": [[key, wstart, wend, acc, max_ts, n], ...],
  "end": [offset, sub], "n": records}`` (pre-aggregated per key and window)

Each record is packed on its own first (:func:`pack_record`), so a value the
codec cannot carry fails that record alone (dead letter), and the message is
assembled from the packed records without encoding them twice.

Example::

    >>> body = records_body(3, [pack_record("k", 1, 10, 5, 0)])
    >>> decode(body)["src"], decode(body)["recs"]
    (3, [['k', 1, 10, 5, 0]])
"""

from __future__ import annotations

from typing import Any

from stream_assets.serde.packing import array_of_packed, pack, unpack

#: Packed size of the message envelope around the records (map header, "src", "recs").
ENVELOPE_BYTES = 32


def encode_key(key: Any) -> bytes:
    """Canonical bytes of a grouping key (hashing and state keys use them)."""
    return pack(key)


def decode_key(data: bytes) -> Any:
    """The key back from :func:`encode_key` (lists come back as tuples: hashable)."""
    return unpack(data, use_list=False)


def pack_record(key: Any, value: Any, ts: int, offset: int, sub: int) -> bytes:
    """One per-record entry; raises PackingError naming a value msgpack cannot carry."""
    return pack([key, value, ts, offset, sub])


def records_body(src: int, packed: list[bytes]) -> bytes:
    """A per-record shuffle message from entries made by :func:`pack_record`."""
    # 0x82: a msgpack map of two entries, "src" and "recs".
    return b"\x82" + pack("src") + pack(src) + pack("recs") + array_of_packed(packed)


def encode_combined(
    src: int, entries: list[list[Any]], end: tuple[int, int], records: int
) -> bytes:
    """A pre-aggregated shuffle message ending at origin ``end``, standing for ``records``."""
    return pack({"src": src, "comb": entries, "end": list(end), "n": records})


def decode(body: bytes) -> dict[str, Any]:
    """A shuffle message back."""
    decoded: dict[str, Any] = unpack(body)
    return decoded
