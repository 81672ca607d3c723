"""Aggregates as keyed logic: unwindowed, fixed windows (tumbling, sliding, and the
windowed join's collection), and session windows.

Emit modes (``Aggregate.emit_every_ms``): windows fire their final result when
the watermark passes their end; with early results on, an open window also
emits its current result, for every window a batch changed (0) or for every
open window each N ms of wall clock. An early result's origin carries the
version of the commit that emits it (:func:`~stream_assets.runtime.core.keyed.results.
versioned`), as does the final one then, so a consumer keeps the highest
version per window and key; ``"final"`` in the value tells which one closed it.

>>> logic = logic_for(head)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stream_assets.operators.joins import join_pairs
from stream_assets.plan import nodes as n
from stream_assets.runtime.core.keyed.batch_state import BatchState
from stream_assets.runtime.core.keyed.logic import KeyedBatch, KeyedLogic
from stream_assets.runtime.core.keyed.partials import FAILED, MergedSlot
from stream_assets.runtime.core.keyed.results import (
    Expired,
    Finish,
    Joined,
    Result,
    result_key,
    versioned,
)
from stream_assets.runtime.core.shuffle_codec import decode_key, encode_key
from stream_assets.serde.packing import unpack
from stream_assets.state import layout as lay
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import Window, merge_sessions, window_closed


class PlainAggregate(KeyedLogic):
    """An unwindowed aggregate: every key changed in a batch emits its new value, and
    a key whose TTL expired emits a deletion (unless the TTL's tombstones are off)."""

    fires_by_time = False

    def __init__(self, head: n.Aggregate) -> None:
        self.head = head
        self.acc_def = head.accumulator
        #: key -> max event time folded this batch (a logic lives for one batch).
        self._changed: dict[bytes, int] = {}
        #: key -> when it expired this batch (and was not folded into again since).
        self._expired: dict[bytes, int] = {}

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
        """Fold into the key's accumulator."""
        skey = lay.PLAIN + key_bytes
        _fold_acc(batch.state, self.acc_def, skey, partial, value)
        self._changed[key_bytes] = max(self._changed.get(key_bytes, ts), ts)
        self._expired.pop(key_bytes, None)  # started over: its update replaces the deletion

    def fold_merged(self, batch: KeyedBatch, slots: Iterable[MergedSlot]) -> list[MergedSlot]:
        """Fold each key's merged partials (no window, no TTL: nothing is late, nothing
        expires, no timer is due between them); the slots whose merge or fold failed,
        which changed nothing, for the caller to fold part by part.

        :meth:`fold` for a whole step's keys in one loop: its calls per key were a
        tenth of a WordCount result's cost.
        """
        state, acc_def, changed, expired = batch.state, self.acc_def, self._changed, self._expired
        get, put, merge, plain = state.get, state.put, acc_def.merge, lay.PLAIN
        failed: list[MergedSlot] = []
        for slot in slots:
            key, merged, ts = slot[0], slot[1], slot[2]
            if merged is FAILED or merged is None:  # None: fold adds, not merges
                failed.append(slot)
                continue
            try:
                key_bytes = encode_key(key)
                acc = get(plain + key_bytes)
                put(plain + key_bytes, merge(acc_def.zero() if acc is None else acc, merged))
            except Exception:  # put packs first: a value it refuses changed nothing
                failed.append(slot)
                continue
            changed[key_bytes] = max(changed.get(key_bytes, ts), ts)
            expired.pop(key_bytes, None)
        return failed

    def fire(self, batch: KeyedBatch, fire_to: int | None, fire_all: bool) -> int | None:
        """Nothing fires by time: updates wait for expiry (:meth:`after_expiry`)."""
        return None

    def after_expiry(self, batch: KeyedBatch) -> None:
        """The new value of every key this batch changed, then a deletion of every key
        that expired and stayed gone, each versioned by the commit's seq (one result
        per key and batch, so an update and a deletion never share a version)."""
        for key_bytes, ts in sorted(self._changed.items()):
            acc = batch.state.get(lay.PLAIN + key_bytes)
            if acc is None:  # expired after its update, in this very batch: deleted below
                continue
            key = decode_key(key_bytes)
            finish = Finish(self.head, key, acc, None)
            batch.results.append((versioned(key, batch.seq), finish, ts, key))
        if not self.head.expiry_tombstones:
            return
        for key_bytes, at in sorted(self._expired.items()):
            key = decode_key(key_bytes)
            batch.results.append((versioned(key, batch.seq), Expired(key), at, key))

    def forget(self, batch: KeyedBatch, key_bytes: bytes, expired_at: int) -> None:
        """Drop the key's accumulator; its deletion is emitted after expiry."""
        batch.state.put(lay.PLAIN + key_bytes, None)
        self._expired[key_bytes] = expired_at

    def read(self, store: QueueStateStore, key: Any, window: Window | None) -> Any:
        """The key's result (a dict by alias) or None."""
        raw = store.get(lay.PLAIN + encode_key(key))
        return None if raw is None else self.acc_def.result(unpack(raw))


class WindowedAggregate(KeyedLogic):
    """Fixed windows (tumbling, sliding; a windowed join collects its sides here)."""

    def __init__(self, head: n.Aggregate) -> None:
        self.head = head
        self.acc_def = head.accumulator
        self._touched: set[bytes] = set()

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
        """Fold into the window's accumulator."""
        assert window is not None
        skey = lay.window_key(window, key_bytes)
        _fold_acc(batch.state, self.acc_def, skey, partial, value)
        if self.head.emit_every_ms is not None:
            self._touched.add(skey)

    def fire(self, batch: KeyedBatch, fire_to: int | None, fire_all: bool) -> int | None:
        """Windows ending at or before ``fire_to`` (all with ``fire_all``), then early results."""
        fired_end: int | None = None
        for raw in self._due(batch.state, fire_to, fire_all):
            acc = batch.state.get(raw)
            window, key_bytes = lay.parse_window_key(raw)
            self._collect(batch, key_bytes, window, acc, final=True)
            batch.state.put(raw, None)
            fired_end = window.end if fired_end is None else max(fired_end, window.end)
        for raw in _early_keys(batch, self.head, lay.WINDOWED, self._touched):
            window, key_bytes = lay.parse_window_key(raw)
            self._collect(batch, key_bytes, window, batch.state.get(raw), final=False)
        return fired_end

    def _due(self, state: BatchState, fire_to: int | None, fire_all: bool) -> list[bytes]:
        if fire_all:
            return [raw for raw, _ in state.items(lay.WINDOWED)]
        if fire_to is None:
            return []
        # Keys are ordered by window end: every window ending at or before fire_to.
        below = lay.WINDOWED + (fire_to + 1 + lay.BIAS).to_bytes(8, "big")
        return [raw for raw, _ in state.items(lay.WINDOWED, below)]

    def _collect(
        self, batch: KeyedBatch, key_bytes: bytes, window: Window, acc: Any, final: bool
    ) -> None:
        batch.results.extend(window_results(self.head, batch.seq, key_bytes, window, acc, final))

    def forget(self, batch: KeyedBatch, key_bytes: bytes, expired_at: int) -> None:
        """Windows are bounded by the watermark; TTL does not apply."""

    def read(self, store: QueueStateStore, key: Any, window: Window | None) -> Any:
        """The key's open windows ``{Window: result}``, or ``window``'s result."""
        key_bytes = encode_key(key)
        if window is not None:
            raw = store.get(lay.window_key(window, key_bytes))
            return None if raw is None else self.acc_def.result(unpack(raw))
        found: dict[Window, Any] = {}
        for raw_key, raw in store.items(lay.WINDOWED):
            w, kb = lay.parse_window_key(raw_key)
            if kb == key_bytes:
                found[w] = self.acc_def.result(unpack(raw))
        return found


class SessionAggregate(KeyedLogic):
    """Session windows: a key's sessions merge as records bridge their gaps."""

    def __init__(self, head: n.Aggregate) -> None:
        self.head = head
        self.acc_def = head.accumulator
        self._touched: set[bytes] = set()

    def judged(self, state: BatchState, key_bytes: bytes, window: Window) -> Window:
        """The session a record's lateness is judged by: what it merges into.

        A record's own ``[t, t + gap)`` may end before the watermark while the
        key's session it touches is still open (other keys moved the
        watermark): it is on time then, and joins that session. A record that
        touches a session which has closed is late, even if it would also
        bridge to an open one: whether a closed session had fired yet depends
        on other source queues and on batch boundaries, which must not change
        a verdict. So the judged window is the earliest-ending session the
        record touches (closed if any is), its own window if it touches none,
        and one ending at the key's latest fired session when it reaches back
        to or before that session's end. That end is kept per key (one
        integer) for as long as the key's state is: a record can bridge back,
        gap by gap, through open sessions, so no watermark makes it safe to
        forget.
        """
        fired = state.get(lay.FIRED + key_bytes)
        if fired is not None and window.start <= fired:
            return Window(window.start, fired)  # ends at or before the watermark: closed
        touched = [
            Window(s, e)
            for s, e, _acc in state.get(lay.SESSION + key_bytes) or []
            if s <= window.end and window.start <= e  # overlaps or touches (merge_sessions)
        ]
        return min(touched, key=lambda w: w.end) if touched else window

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
        """Merge the record's session into the key's sessions."""
        assert window is not None
        acc_def, state = self.acc_def, batch.state
        skey = lay.SESSION + key_bytes
        acc = (
            acc_def.merge(acc_def.zero(), partial)
            if partial is not None
            else acc_def.add(acc_def.zero(), value)
        )
        candidates = [(Window(s, e), a) for s, e, a in state.get(skey) or []] + [(window, acc)]
        merged = []
        for merged_window, members in merge_sessions([w for w, _ in candidates]):
            total = acc_def.zero()
            for i in members:
                total = acc_def.merge(total, candidates[i][1])
            merged.append([merged_window.start, merged_window.end, total])
        state.put(skey, merged)
        if self.head.emit_every_ms is not None:
            self._touched.add(skey)

    def fire(self, batch: KeyedBatch, fire_to: int | None, fire_all: bool) -> int | None:
        """Sessions ending at or before ``fire_to`` (all with ``fire_all``), then early results."""
        fired_end: int | None = None
        state = batch.state
        for skey, sessions in list(state.items(lay.SESSION)):
            keep = []
            for s, e, acc in sessions:
                if not (fire_all or window_closed(Window(s, e), fire_to)):
                    keep.append([s, e, acc])
                    continue
                batch.results.extend(
                    window_results(self.head, batch.seq, skey[1:], Window(s, e), acc, True)
                )
                fired_key = lay.FIRED + skey[1:]
                state.put(fired_key, max(e, state.get(fired_key) or e))
                fired_end = e if fired_end is None else max(fired_end, e)
            if len(keep) != len(sessions):
                state.put(skey, keep or None)
        for skey in _early_keys(batch, self.head, lay.SESSION, self._touched):
            for s, e, acc in state.get(skey):
                batch.results.extend(
                    window_results(self.head, batch.seq, skey[1:], Window(s, e), acc, False)
                )
        return fired_end

    def forget(self, batch: KeyedBatch, key_bytes: bytes, expired_at: int) -> None:
        """Sessions are bounded by the watermark; TTL does not apply."""

    def read(self, store: QueueStateStore, key: Any, window: Window | None) -> Any:
        """The key's open sessions ``{Window: result}``, or ``window``'s result."""
        raw = store.get(lay.SESSION + encode_key(key))
        found = {
            Window(start, end): self.acc_def.result(acc)
            for start, end, acc in ([] if raw is None else unpack(raw))
        }
        return found if window is None else found.get(window)


def window_results(
    head: n.Aggregate, seq: int, key_bytes: bytes, window: Window, acc: Any, final: bool
) -> list[Result]:
    """A window's results: its aggregate, or a join's pairs; at the window's last instant.

    Final only: the origin is the window and key. With early results, every
    result of the window (early and final) also carries the commit's version.
    """
    key = decode_key(key_bytes)
    bounds = f"{window.start}-{window.end}"
    origin: tuple[str, ...] = (bounds, result_key(key))
    if head.emit_every_ms is not None:
        origin = (bounds, *versioned(key, seq))
    ts = window.end - 1
    if isinstance(head, n.Join):
        pairs = join_pairs(head.accumulator.result(acc), head.kind)
        return [(origin, Joined(head, left, right), ts, key) for left, right in pairs]
    finish = Finish(head, key, acc, window, final if head.emit_every_ms is not None else None)
    return [(origin, finish, ts, key)]


def _fold_acc(state: BatchState, acc_def: Any, skey: bytes, partial: Any, value: Any) -> None:
    acc = state.get(skey)
    acc = acc_def.zero() if acc is None else acc
    state.put(skey, acc_def.merge(acc, partial) if partial is not None else acc_def.add(acc, value))


def _early_keys(
    batch: KeyedBatch, head: n.Aggregate, prefix: bytes, touched: set[bytes]
) -> list[bytes]:
    """The state keys (windows, a key's sessions) whose early results this batch emits:
    every open one once per period, or the ones this batch changed (none: off)."""
    if head.emit_every_ms is None:
        return []
    if head.emit_every_ms > 0:
        keys = [k for k, _ in batch.state.items(prefix)]
    else:
        keys = sorted(k for k in touched if batch.state.get(k) is not None)
    return keys if _early_due(batch, head, bool(keys)) else []


def _early_due(batch: KeyedBatch, head: n.Aggregate, anything_open: bool) -> bool:
    """Whether this batch emits early results: every batch (0), or once per period of
    the wall clock in which a window is open (the period is noted in the meta)."""
    every = head.emit_every_ms or 0
    if every <= 0 or not anything_open:
        return anything_open
    period = batch.now_ms // every
    if period == batch.meta_extra.get("early_period"):
        return False
    batch.meta_extra["early_period"] = period
    return True
