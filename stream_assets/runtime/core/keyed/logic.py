"""The one interface every keyed head implements, and the batch it works in.

A keyed stage's per-queue driver (:func:`~stream_assets.runtime.core.keyed.batch.run_keyed_batch`)
is the same for every head: de-duplicate by origin, judge lateness, fold each
record into state, fire what the watermark (or the wall clock, for
processing-time timers) made due, expire keys past their TTL, emit, commit.
What differs per head is how a record folds, what fires, what a key's state
is and how a query reads it: that is a :class:`KeyedLogic`.

Event-time order within a key, whatever the batches: a key's timers due at or
before a record fire first (:meth:`KeyedLogic.before_record`), then the key's
TTL is checked (a record at or after its expiry finds the key forgotten), then
the record folds. At the end of the batch, what the watermark made due fires
before the keys it expired are forgotten, and only then are the updates of
unwindowed keys emitted (:meth:`KeyedLogic.after_expiry`), so an update and an
expiry of one key in one batch never share a version.

>>> logic = logic_for(head)  # doctest: +SKIP
>>> logic.fold(batch, "apple", encode_key("apple"), None, None, 1, ts, "0/5/0")  # doctest: +SKIP
>>> logic.fire(batch, watermark, fire_all=False)  # doctest: +SKIP
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stream_assets.runtime.core.context import TaskStats
from stream_assets.runtime.core.keyed.batch_state import BatchState
from stream_assets.runtime.core.keyed.results import Result
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import Window

#: A late record: (key, value, end of the window it missed, origin).
Late = tuple[Any, Any, int, str]


@dataclass
class KeyedBatch:
    """What one batch of one queue works on, handed to every :class:`KeyedLogic` call."""

    state: BatchState
    #: The seq of the commit this batch makes (versions of updating results).
    seq: int
    #: Processing time (ms since the epoch) this batch runs at: one value per batch,
    #: so every processing-time decision in it agrees.
    now_ms: int
    stats: TaskStats
    #: Dead-letters a value this batch cannot handle: (error, value shown, position).
    fail: Callable[[BaseException, Any, str], None]
    #: The meta's ``extra`` this batch commits: small per-queue facts a logic keeps.
    meta_extra: dict[str, Any] = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    late: list[Late] = field(default_factory=list)
    #: The watermark as it stands after this batch's records (None: none yet).
    watermark: int | None = None
    #: key -> the latest event time that keeps it alive under a TTL this batch: its
    #: records and the event-time timers set for it (:meth:`keep_alive`).
    touched: dict[bytes, int] = field(default_factory=dict)

    def keep_alive(self, key_bytes: bytes, ts: int) -> None:
        """The key lives at least a TTL past ``ts`` (a record, or a timer set for ``ts``)."""
        before = self.touched.get(key_bytes)
        self.touched[key_bytes] = ts if before is None or ts > before else before


class KeyedLogic(ABC):
    """How one kind of keyed head keeps its state, folds records and fires results.

    A logic object lives for one batch of one queue (it may keep what the
    batch touched); everything that must outlive the batch is in ``batch.state``.
    """

    #: Whether results fired because every origin went idle close their windows for
    #: good (a later record for them is late), as for windows and table joins.
    closes_when_idle = True
    #: Whether a record at or after its key's TTL expiry finds the key forgotten first
    #: (False: the logic judges expiry itself, as a table join does by version time).
    forgets_before_record = True
    #: Whether its results are fired by time (counted in ``TaskStats.fired``), rather
    #: than updates of what a batch changed.
    fires_by_time = True

    @abstractmethod
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
        """Fold one record (``value``) or a pre-combined ``partial`` for ``key`` into state.

        ``window``: the window the record counts in (one call per window), None
        when the head is unwindowed; ``origin``: ``src/offset/sub``, unique per
        input record and the same when it is replayed.
        """

    @abstractmethod
    def fire(self, batch: KeyedBatch, fire_to: int | None, fire_all: bool) -> int | None:
        """Append to ``batch.results`` what is due and remove it from state.

        ``fire_to``: the watermark (None: none yet); ``fire_all``: every origin
        is idle. Returns the end of the latest window fired (what is closed now).
        """

    @abstractmethod
    def forget(self, batch: KeyedBatch, key_bytes: bytes, expired_at: int) -> None:
        """Delete all state of one key: its TTL expired at ``expired_at`` (event time)."""

    def before_record(  # noqa: B027 - optional hook
        self, batch: KeyedBatch, key_bytes: bytes, ts: int
    ) -> None:
        """Run what is due for the key before its record at ``ts`` (a processor's timers)."""

    def after_expiry(self, batch: KeyedBatch) -> None:  # noqa: B027 - optional hook
        """Append the results that depend on what expired this batch (none by default)."""

    @abstractmethod
    def read(self, store: QueueStateStore, key: Any, window: Window | None) -> Any:
        """A key's current state as a state query shows it."""

    def touches(self, value: Any) -> bool:
        """Whether a record (``value``) keeps its key alive under a TTL: any record does."""
        return True

    def judged(self, state: BatchState, key_bytes: bytes, window: Window) -> Window:
        """The window a record in ``window`` is judged late by (itself, but for sessions)."""
        return window
