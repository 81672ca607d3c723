"""The state topic's message format: deltas and snapshots, msgpack-encoded.

Every message is one msgpack map with ``"t"`` (kind), ``"seq"``, ``"id"`` (a
random id per written delta or snapshot, so parts of two attempts at the same
seq never mix) and ``"snap"``: the state-topic offset of the latest *complete*
snapshot when the message was written (None before the first one), which is
where a restore starts.

- ``delta``: one commit. Inline ``"changes"`` (``[[key, value-or-None], ...]``)
  and ``"meta"`` when it fits in one body; otherwise the msgpack of
  ``[changes, meta]`` is cut into ``"parts"`` bodies, each with its ``"part"``
  index and a ``"data"`` slice, so even a single value over the broker's
  message limit travels.
- ``snap-begin`` (``"meta"`` at the snapshot's seq), ``snap-chunk`` (``"i"``,
  ``"data"``: a slice of one msgpack stream ``k1 v1 k2 v2 ...``, so a restore
  streams it with bounded memory) and ``snap-end`` (``"chunks"``, ``"keys"``,
  ``"begin"``). ``snap-end``'s ``"snap"`` is its own begin offset: from there on
  the snapshot is complete.

Every record also carries ``"at"``: the state-queue offset its writer expected
it to land at. A record stored anywhere else is *void* (another writer appended
first) and a restore ignores it. That turns the append-only queue into a
compare-and-append log: of two writers that both believed the queue ended at
offset X, exactly one lands at X, so a queue's valid history has one writer
at a time (:mod:`stream_assets.state.changelog`). Records written before
``"at"`` existed have ``at`` None and count as valid.

Example::

    >>> bodies = encode_delta(1, b"id", None, {b"k": b"v"}, StateMeta(seq=1), 1 << 20)
    >>> decode_record(bodies[0]).changes
    [(b'k', b'v')]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stream_assets.serde.packing import PackingError, pack, unpack
from stream_assets.state.errors import StateFormatError
from stream_assets.state.meta import StateMeta

DELTA = "delta"
SNAP_BEGIN = "snap-begin"
SNAP_CHUNK = "snap-chunk"
SNAP_END = "snap-end"

# Under the broker's 4 MiB default maxMessageSize with room for headers and properties.
MAX_BODY = 3_584 * 1024
# Room for the envelope fields around a part's data slice (a few dozen bytes in practice).
_ENVELOPE = 512

Changes = list[tuple[bytes, bytes | None]]


@dataclass(frozen=True)
class Delta:
    """A whole delta (``changes`` and ``meta`` set) or one part of one (``data`` set)."""

    seq: int
    write_id: bytes
    snap: int | None
    part: int = 0
    parts: int = 1
    changes: Changes | None = None
    meta: StateMeta | None = None
    data: bytes | None = None
    at: int | None = None

    @property
    def written_seq(self) -> int:
        """Highest seq whose delta is wholly in the topic once this message is.

        Parts of one write are sent one after another, each only after the
        previous was stored, so a last part means the seq is complete.
        """
        return self.seq if self.part == self.parts - 1 else self.seq - 1


@dataclass(frozen=True)
class SnapBegin:
    """First message of a snapshot of the state at ``seq``."""

    seq: int
    write_id: bytes
    snap: int | None
    meta: StateMeta
    at: int | None = None

    @property
    def written_seq(self) -> int:
        """A snapshot is taken after its seq's delta was written."""
        return self.seq


@dataclass(frozen=True)
class SnapChunk:
    """Slice ``index`` of a snapshot's key/value stream."""

    seq: int
    write_id: bytes
    snap: int | None
    index: int
    begin: int
    data: bytes
    at: int | None = None

    @property
    def written_seq(self) -> int:
        """See :attr:`SnapBegin.written_seq`."""
        return self.seq


@dataclass(frozen=True)
class SnapEnd:
    """Last message of a snapshot: ``chunks`` slices holding ``keys`` pairs."""

    seq: int
    write_id: bytes
    snap: int | None
    begin: int
    chunks: int
    keys: int
    at: int | None = None

    @property
    def written_seq(self) -> int:
        """See :attr:`SnapBegin.written_seq`."""
        return self.seq


ChangelogRecord = Delta | SnapBegin | SnapChunk | SnapEnd


def is_void(record: ChangelogRecord, offset: int) -> bool:
    """Whether ``record``, stored at ``offset``, lost the race for the offset it expected."""
    return record.at is not None and record.at != offset


def encode_delta(
    seq: int,
    write_id: bytes,
    snap: int | None,
    changes: Mapping[bytes, bytes | None],
    meta: StateMeta,
    max_body: int = MAX_BODY,
    at: int | None = None,
) -> list[bytes]:
    """The message bodies of one commit: one inline body, or parts of at most ``max_body``.

    ``at``: the offset the first body must land at (part ``i`` at ``at + i``).
    """
    pairs = [[key, value] for key, value in changes.items()]
    wire_meta = meta.to_wire()
    body = pack(
        {
            "t": DELTA,
            "seq": seq,
            "id": write_id,
            "snap": snap,
            "changes": pairs,
            "meta": wire_meta,
            "at": at,
        }
    )
    if len(body) <= max_body:
        return [body]
    payload = pack([pairs, wire_meta])
    step = max_body - _ENVELOPE
    if step <= 0:
        raise ValueError(f"max_body {max_body} leaves no room for data")
    parts = -(-len(payload) // step)
    return [
        pack(
            {
                "t": DELTA,
                "seq": seq,
                "id": write_id,
                "snap": snap,
                "part": i,
                "parts": parts,
                "data": payload[i * step : (i + 1) * step],
                "at": None if at is None else at + i,
            }
        )
        for i in range(parts)
    ]


def join_delta_parts(parts: list[Delta]) -> tuple[Changes, StateMeta]:
    """Changes and meta of a split delta from all of its parts, in part order."""
    payload = b"".join(p.data or b"" for p in sorted(parts, key=lambda p: p.part))
    try:
        decoded = unpack(payload)
    except PackingError as exc:
        raise StateFormatError(f"split delta of seq {parts[0].seq}: {exc}") from exc
    if not isinstance(decoded, list) or len(decoded) != 2:
        raise StateFormatError(f"split delta of seq {parts[0].seq} does not decode to a pair")
    return _changes(decoded[0]), StateMeta.from_wire(decoded[1])


def encode_snap_begin(
    seq: int, write_id: bytes, snap: int | None, meta: StateMeta, at: int | None = None
) -> bytes:
    """Body of a snapshot's first message."""
    return pack(
        {
            "t": SNAP_BEGIN,
            "seq": seq,
            "id": write_id,
            "snap": snap,
            "meta": meta.to_wire(),
            "at": at,
        }
    )


def encode_snap_chunk(
    seq: int,
    write_id: bytes,
    snap: int | None,
    index: int,
    begin: int,
    data: bytes,
    at: int | None = None,
) -> bytes:
    """Body of one slice of a snapshot's key/value stream."""
    return pack(
        {
            "t": SNAP_CHUNK,
            "seq": seq,
            "id": write_id,
            "snap": snap,
            "i": index,
            "begin": begin,
            "data": data,
            "at": at,
        }
    )


def encode_snap_end(
    seq: int, write_id: bytes, begin: int, chunks: int, keys: int, at: int | None = None
) -> bytes:
    """Body of a snapshot's last message; its ``snap`` is the snapshot itself."""
    return pack(
        {
            "t": SNAP_END,
            "seq": seq,
            "id": write_id,
            "snap": begin,
            "begin": begin,
            "chunks": chunks,
            "keys": keys,
            "at": at,
        }
    )


def decode_record(body: bytes) -> ChangelogRecord:
    """Parse one state-topic message; raises :class:`StateFormatError` if it is none."""
    try:
        raw = unpack(body)
    except PackingError as exc:
        raise StateFormatError(f"undecodable state-topic message: {exc}") from exc
    if not isinstance(raw, dict):
        raise StateFormatError(f"state-topic message is not a map: {raw!r:.200}")
    try:
        return _decode(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise StateFormatError(f"malformed {raw.get('t')!r} state record: {exc}") from exc


def _decode(raw: dict[str, Any]) -> ChangelogRecord:
    kind = raw["t"]
    seq, write_id, snap = int(raw["seq"]), bytes(raw["id"]), raw["snap"]
    at = None if raw.get("at") is None else int(raw["at"])
    if kind == DELTA:
        if "parts" in raw:
            return Delta(
                seq, write_id, snap, int(raw["part"]), int(raw["parts"]), data=raw["data"], at=at
            )
        return Delta(
            seq,
            write_id,
            snap,
            changes=_changes(raw["changes"]),
            meta=StateMeta.from_wire(raw["meta"]),
            at=at,
        )
    if kind == SNAP_BEGIN:
        return SnapBegin(seq, write_id, snap, StateMeta.from_wire(raw["meta"]), at)
    if kind == SNAP_CHUNK:
        return SnapChunk(
            seq, write_id, snap, int(raw["i"]), int(raw["begin"]), bytes(raw["data"]), at
        )
    if kind == SNAP_END:
        return SnapEnd(
            seq, write_id, snap, int(raw["begin"]), int(raw["chunks"]), int(raw["keys"]), at
        )
    raise StateFormatError(f"unknown state record kind {kind!r}")


def _changes(pairs: Any) -> Changes:
    return [(bytes(k), None if v is None else bytes(v)) for k, v in pairs]
