"""Time to live for keyed state: a key's state expires a fixed span of event time
after its latest record.

A record at or after its key's expiry finds the key forgotten first (so the
verdict does not depend on whether a batch boundary fell between them), and
at the end of each batch the watermark expires the rest. Each key with a TTL
has one entry in a time-ordered index (``EXPIRY``: expires
at, key) and its expiry time (``EXPIRES``), so a batch finds every expired
key by scanning the index up to the watermark, and a key touched again moves
its one entry. Expiry is a state change like any other: it goes into the
batch's changelog record, so a restore on another executor agrees with the
live store, and the store stays bounded while input flows over new keys.

>>> touch(state, b"k", 5_000)  # doctest: +SKIP
>>> expire(state, logic, watermark=6_000)  # doctest: +SKIP
1
"""

from __future__ import annotations

from stream_assets.keyed.batch_state import BatchState
from stream_assets.keyed.logic import KeyedLogic
from stream_assets.state import layout as lay


def touch(state: BatchState, key_bytes: bytes, expires_at: int) -> None:
    """The key lives at least until ``expires_at`` (event time)."""
    before = state.get(lay.EXPIRES + key_bytes)
    if before is not None and before >= expires_at:
        return
    if before is not None:
        state.put(lay.timer_key(lay.EXPIRY, before, key_bytes), None)
    state.put(lay.timer_key(lay.EXPIRY, expires_at, key_bytes), True)
    state.put(lay.EXPIRES + key_bytes, expires_at)


def forget_key(state: BatchState, logic: KeyedLogic, key_bytes: bytes) -> None:
    """Forget one key's state and its expiry now (a record came at or after its expiry)."""
    before = state.get(lay.EXPIRES + key_bytes)
    if before is not None:
        state.put(lay.timer_key(lay.EXPIRY, before, key_bytes), None)
        state.put(lay.EXPIRES + key_bytes, None)
    logic.forget(state, key_bytes)


def expire(state: BatchState, logic: KeyedLogic, watermark: int | None) -> int:
    """Forget every key whose expiry the watermark reached; how many there were."""
    if watermark is None:
        return 0
    below = lay.timer_key(lay.EXPIRY, watermark + 1, b"")
    expired = list(state.items(lay.EXPIRY, below))
    for raw, _ in expired:
        key_bytes = lay.key_of_timed(raw)
        logic.forget(state, key_bytes)
        state.put(raw, None)
        state.put(lay.EXPIRES + key_bytes, None)
    return len(expired)
