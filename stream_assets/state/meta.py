"""What a queue's state remembers besides its values: sequence, applied offsets, watermark.

The same wire form (a msgpack-friendly dict) is stored in RocksDB next to the
values and carried in every changelog record, so a restored store ends with
exactly the meta the original had.

Example::

    >>> meta = StateMeta(seq=3, origins={0: (41, 2)}, input_offset=42)
    >>> StateMeta.from_wire(meta.to_wire()) == meta
    True
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from stream_assets.state.codec import pack, unpack
from stream_assets.state.errors import StateFormatError

_WIRE_VERSION = 1


@dataclass
class StateMeta:
    """Bookkeeping committed atomically with a queue's state values.

    - ``seq``: commit sequence number; 0 for a fresh store, +1 per commit.
    - ``origins``: per source queue id, the highest applied ``(offset, sub_index)``
      (the exactly-once filter across the shuffle).
    - ``input_offset``: next offset to read from the queue this state consumes.
    - ``watermark``: opaque JSON-like dict of the watermark tracker. Tuples come
      back as lists (msgpack), so keep it to dicts, lists and scalars.
    - ``snapshot_offset``: state-topic offset where the latest complete snapshot
      begins (managed by the changelog writer).
    - ``extra``: anything else an operator wants committed with its state.
    """

    seq: int = 0
    origins: dict[int, tuple[int, int]] = field(default_factory=dict)
    input_offset: int | None = None
    watermark: dict[str, Any] = field(default_factory=dict)
    snapshot_offset: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def copy(self) -> StateMeta:
        """A deep copy, safe to modify without touching the original."""
        return copy.deepcopy(self)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-friendly form stored in RocksDB and in changelog records."""
        return {
            "v": _WIRE_VERSION,
            "seq": self.seq,
            "origins": {q: [off, sub] for q, (off, sub) in self.origins.items()},
            "input_offset": self.input_offset,
            "watermark": self.watermark,
            "snapshot_offset": self.snapshot_offset,
            "extra": self.extra,
        }

    @classmethod
    def from_wire(cls, wire: Any) -> StateMeta:
        """Inverse of :meth:`to_wire`; raises :class:`StateFormatError` on anything else."""
        if not isinstance(wire, dict) or wire.get("v") != _WIRE_VERSION:
            raise StateFormatError(f"not a version-{_WIRE_VERSION} state meta: {wire!r:.200}")
        try:
            return cls(
                seq=int(wire["seq"]),
                origins={int(q): (int(o[0]), int(o[1])) for q, o in wire["origins"].items()},
                input_offset=wire["input_offset"],
                watermark=dict(wire["watermark"]),
                snapshot_offset=wire["snapshot_offset"],
                extra=dict(wire["extra"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise StateFormatError(f"malformed state meta {wire!r:.200}: {exc}") from exc

    def encode(self) -> bytes:
        """msgpack bytes of :meth:`to_wire`."""
        return pack(self.to_wire())

    @classmethod
    def decode(cls, data: bytes) -> StateMeta:
        """Inverse of :meth:`encode`."""
        return cls.from_wire(unpack(data))
