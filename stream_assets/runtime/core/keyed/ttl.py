"""Time to live for keyed state: a key's state expires a fixed span of event time
after the latest of its records and of the event-time timers set for it.

Counting pending timers in keeps every timer ahead of its key's expiry, so
``on_timer`` always sees the key's state, whether the expiry is found by the
key's next record or by the watermark, whatever the batches: a record at or
after its key's expiry first fires the key's due timers, then finds the key
forgotten; at the end of each batch the watermark fires what is due, then
expires the rest. A timer deleted after it was set does not shorten the key's
life (expiry only moves forward). Each key with a TTL has one entry in a
time-ordered index (``EXPIRY``: expires at, key) and its expiry time
(``EXPIRES``), so a batch finds every expired key by scanning the index up to
the watermark, and a key touched again moves its one entry. Expiry is a state
change like any other: it goes into the batch's changelog record, so a
restore on another executor agrees with the live store, and the store stays
bounded while input flows over new keys.

The boundary: a key's state is valid for event times strictly before
``latest + ttl``; a record at exactly ``latest + ttl`` starts over.

>>> touch(state, b"k", 5_000)  # doctest: +SKIP
>>> expire(batch, logic, watermark=6_000)  # doctest: +SKIP
1
"""

from __future__ import annotations

from stream_assets.runtime.core.keyed.batch_state import BatchState
from stream_assets.runtime.core.keyed.logic import KeyedBatch, KeyedLogic
from stream_assets.state import layout as lay


def expires_at(state: BatchState, key_bytes: bytes) -> int | None:
    """When the key's state expires as committed so far (None: no expiry recorded)."""
    found: int | None = state.get(lay.EXPIRES + key_bytes)
    return found


def touch(state: BatchState, key_bytes: bytes, expires: int) -> None:
    """The key lives at least until ``expires`` (event time)."""
    before = expires_at(state, key_bytes)
    if before is not None and before >= expires:
        return
    if before is not None:
        state.put(lay.timer_key(lay.EXPIRY, before, key_bytes), None)
    state.put(lay.timer_key(lay.EXPIRY, expires, key_bytes), True)
    state.put(lay.EXPIRES + key_bytes, expires)


def forget_key(batch: KeyedBatch, logic: KeyedLogic, key_bytes: bytes, expired_at: int) -> None:
    """Forget one key's state and its expiry now (a record came at or after its expiry)."""
    state = batch.state
    before = expires_at(state, key_bytes)
    if before is not None:
        state.put(lay.timer_key(lay.EXPIRY, before, key_bytes), None)
        state.put(lay.EXPIRES + key_bytes, None)
    logic.forget(batch, key_bytes, expired_at)


def expire(batch: KeyedBatch, logic: KeyedLogic, watermark: int | None) -> int:
    """Forget every key whose expiry the watermark reached; how many there were."""
    if watermark is None:
        return 0
    state = batch.state
    below = lay.timer_key(lay.EXPIRY, watermark + 1, b"")
    expired = list(state.items(lay.EXPIRY, below))
    for raw, _ in expired:
        key_bytes = lay.key_of_timed(raw)
        logic.forget(batch, key_bytes, lay.time_of(raw))
        state.put(raw, None)
        state.put(lay.EXPIRES + key_bytes, None)
    return len(expired)
