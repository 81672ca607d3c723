"""The stream-table join as keyed logic.

The table's versions are kept per key, and each stream record waits until the
watermark passes its event time; it then meets the table as of that time, so
the result does not depend on which topic was read first. With a TTL, a
table value is valid for that long after its update (unless a newer one
replaced it): a stream record joins the version at or before its time only
while it is valid, which the versions' own times decide, whatever the batches;
the watermark then forgets keys whose latest update is a TTL behind it.
"""

from __future__ import annotations

from typing import Any

from stream_assets.plan import nodes as n
from stream_assets.runtime.core.keyed.logic import KeyedBatch, KeyedLogic
from stream_assets.runtime.core.keyed.results import Joined, result_key
from stream_assets.runtime.core.shuffle_codec import encode_key
from stream_assets.serde.packing import unpack
from stream_assets.state import layout as lay
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import Window


class TableJoinLogic(KeyedLogic):
    """Side 1 updates the key's table; side 0 waits for the watermark, then joins."""

    forgets_before_record = False

    def __init__(self, head: n.TableJoin) -> None:
        self.head = head

    def touches(self, value: Any) -> bool:
        """Only a table update (side 1) keeps a key's table alive."""
        return int(value[0]) == 1

    def fold(
        self,
        batch: KeyedBatch,
        key: Any,
        key_bytes: bytes,
        window: Window | None,
        partial: Any,
        value: Any,
        ts: int,
        origin: str,
    ) -> None:
        """A table update joins the key's versions; a stream record waits."""
        side, item = value
        state = batch.state
        if int(side) == 1:
            skey = lay.TABLE + key_bytes
            versions = [v for v in state.get(skey) or [] if v[0] != ts]
            versions.append([ts, item])
            versions.sort(key=lambda v: v[0])
            state.put(skey, versions)
            return
        src, off, sub = (int(p) for p in origin.split("/"))
        state.put(lay.pending_key(ts, src, off, sub, key_bytes), [key, item, ts])

    def fire(self, batch: KeyedBatch, fire_to: int | None, fire_all: bool) -> int | None:
        """Join and remove stream records the watermark passed (all with ``fire_all``).

        Returns one past the latest event time joined (what is closed now).
        """
        state = batch.state
        if fire_all:
            due = list(state.items(lay.PENDING))
        elif fire_to is None:
            due = []
        else:  # ordered by event time: every record before fire_to
            due = list(state.items(lay.PENDING, lay.pending_key(fire_to, 0, 0, 0, b"")))
        fired_end: int | None = None
        for raw, (key, item, ts) in due:
            _ts, (src, off, sub), key_bytes = lay.parse_pending_key(raw)
            versions = state.get(lay.TABLE + key_bytes) or []
            current = [v for v in versions if v[0] <= ts]
            ttl = self.head.ttl_ms
            valid = bool(current) and (ttl is None or ts < current[-1][0] + ttl)
            table_value = current[-1][1] if valid else None
            origin = (f"{ts}/{src}/{off}/{sub}", result_key(key))
            if valid or self.head.kind == "left":
                batch.results.append((origin, Joined(self.head, item, table_value), ts, key))
            state.put(raw, None)
            fired_end = ts + 1 if fired_end is None else max(fired_end, ts + 1)
            if len(current) > 1:
                # Older versions can meet no record to come: those are at or after this one.
                state.put(lay.TABLE + key_bytes, versions[len(current) - 1 :])
        return fired_end

    def forget(self, batch: KeyedBatch, key_bytes: bytes, expired_at: int) -> None:
        """Drop the key's table versions (records still waiting keep theirs: they are due).

        Nothing is emitted: the table is this join's state, never a sink's content.
        """
        batch.state.put(lay.TABLE + key_bytes, None)

    def read(self, store: QueueStateStore, key: Any, window: Window | None) -> Any:
        """The key's table versions ``[[ts, value], ...]``, oldest first, or None."""
        raw = store.get(lay.TABLE + encode_key(key))
        return None if raw is None else unpack(raw)
