"""The bodies of shuffle-topic messages (msgpack via :mod:`stream_assets.serde.packing`).

One shuffle message carries every record one source queue sent to one shuffle
queue in one micro-batch, which is what makes a batch's delivery to a queue
all-or-nothing and keeps sends few.

- per-record: ``{"src": q, "recs": [[key, value, ts, offset, sub(, progress)], ...]
  (, "p": progress)}``
- combined:   ``{"src": q, "comb": [[key, wstart, wend, acc, max_ts, n], ...],
  "end": [offset, sub], "n": records, "p": progress}`` (pre-aggregated per key and window)
- progress mark: ``{"src": q, "end": [offset, sub], "p": progress}`` (no records)
- combined across origins: ``{"srcs": [[q, offset, sub, progress], ...],
  "comb": [...], "n": records}``: one real-time step's pre-combined partials of
  several source queues (:mod:`~stream_assets.runtime.core.stage0.across_queues`),
  each origin's part ending at its own ``[offset, sub]``. Its origins are applied
  together or, as a replay, not at all: no range of it was ever sent combined
  before (``StageContext.may_combine``), so a keyed queue has applied all of them
  or none.

``progress`` is the origin's progress: the highest event time it has sent
(every element a source queue's records gave its exits, whatever their
routes; a keyed stage's results and fired watermark). The last message of a
batch to each shuffle queue carries the progress at the batch's end, and a
queue the batch sent nothing else to gets a mark, so every stateful queue
knows every origin's progress whatever the keys routed where. A record entry
carries its origin's progress before it (a sixth element) only when that
makes it late, which is rare, so the common entry stays five elements.
Messages written before progress travelled (no ``p``, five-element entries)
read the same as ever.

Each record is packed on its own first (:func:`pack_record`), so a value the
codec cannot carry fails that record alone (dead letter), and the message is
assembled from the packed records without encoding them twice.

Example::

    >>> body = records_body(3, [pack_record("k", 1, 10, 5, 0)], progress=12)
    >>> decode(body)
    {'src': 3, 'recs': [['k', 1, 10, 5, 0]], 'p': 12}
    >>> decode(with_progress(pack_record("k", 1, 10, 5, 0), 99_000))
    ['k', 1, 10, 5, 0, 99000]
"""

from __future__ import annotations

from typing import Any

from stream_assets.serde.packing import array_of_packed, pack, unpack


class ShuffleProtocolError(RuntimeError):
    """A shuffle message that breaks the protocol's promises (never expected: a bug)."""


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


def with_progress(packed: bytes, progress: int) -> bytes:
    """A packed entry of :func:`pack_record` with its origin's progress appended."""
    # 0x95/0x96: msgpack fixarrays of five and six elements.
    assert packed[0] == 0x95, "not an entry of pack_record"
    return b"\x96" + packed[1:] + pack(progress)


def records_body(src: int, packed: list[bytes], progress: int | None = None) -> bytes:
    """A per-record shuffle message from entries made by :func:`pack_record`."""
    # 0x82/0x83: a msgpack map of "src", "recs" and maybe "p".
    body = pack("src") + pack(src) + pack("recs") + array_of_packed(packed)
    if progress is None:
        return b"\x82" + body
    return b"\x83" + body + pack("p") + pack(progress)


def encode_combined(
    src: int, entries: list[list[Any]], end: tuple[int, int], records: int, progress: int | None
) -> bytes:
    """A pre-aggregated shuffle message ending at origin ``end``, standing for ``records``."""
    body = {"src": src, "comb": entries, "end": list(end), "n": records}
    return pack(body if progress is None else {**body, "p": progress})


def encode_across(
    origins: list[tuple[int, tuple[int, int], int | None]], entries: list[list[Any]], records: int
) -> bytes:
    """A pre-combined message of several origins, each ``(src, end, progress)``: their
    partials merged per key and window, standing for ``records`` records in all.

    >>> origins = [(1, (9, 7), None), (2, (4, 7), 50)]
    >>> body = encode_across(origins, [["k", None, None, 5, 50, 5]], records=5)
    >>> decode(body)["srcs"], decode(body)["n"]
    ([[1, 9, 7, None], [2, 4, 7, 50]], 5)
    """
    srcs = [[src, end[0], end[1], progress] for src, end, progress in origins]
    return pack({"srcs": srcs, "comb": entries, "n": records})


def encode_mark(src: int, end: tuple[int, int], progress: int) -> bytes:
    """A progress mark: origin ``src`` read everything up to ``end`` and reached ``progress``."""
    return pack({"src": src, "end": list(end), "p": progress})


def decode(body: bytes) -> dict[str, Any]:
    """A shuffle message back."""
    decoded: dict[str, Any] = unpack(body)
    return decoded
