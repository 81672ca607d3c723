"""Exactly-once sinks: a step's sink messages as one RocketMQ transaction, ended after its commit.

A keyed step with ``sink(..., exactly_once=True)`` (docs/notes/transactions.md,
"Design of the exactly-once sink"):

1. fixes its :class:`~stream_assets.state.step_fate.StepTag` before it sends
   anything: the offset its delta must land at and the delta's write id;
2. at its flush, *prepares* the exactly-once sinks' messages (half messages
   no consumer sees, each naming the step in ``SA_STEP``), the rest sent as
   always;
3. commits its state with the messages' places (:meth:`StepTransaction.messages`,
   in ``meta.extra["tx"]``);
4. then commits the half messages, each key's in order, and notes locally
   that it did (``tx_ended``), as the outbox's ``outbox_sent``.

A step that does not commit rolls back what it prepared. A step not ended
within :data:`END_WINDOW_S` (its owner died, or was that slow) is the broker's
check-back's to end, which the state queue answers
(:mod:`~stream_assets.runtime.drive.sink_checks`); the queue's next step waits
until those messages are visible before it starts
(:meth:`ExactlyOnceSinks.await_previous`), so every key keeps step order, and
never ends them itself, so each message has one committer.

Example::

    >>> tx = StepTransaction(port, frozenset({"counts"}), tag)  # doctest: +SKIP
    >>> buffer = SendBuffer(producer, transaction=tx)  # doctest: +SKIP
    >>> buffer.send("counts", b"3", key="apple"); buffer.flush()  # prepared  # doctest: +SKIP
    >>> tx.commit()  # after the step's delta landed: a consumer sees it  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.discarded import Discarded, discard_queue, ids_of
from stream_assets.rocketmq.errors import CredentialsRefusedError, TopicNotFoundError
from stream_assets.rocketmq.records import OutgoingMessage, Record
from stream_assets.rocketmq.transactions import PROPERTY_END_WINDOW, EndWindowClosedError, Prepared
from stream_assets.state.errors import StateError
from stream_assets.state.meta import StateMeta
from stream_assets.state.ports import OffsetQueries, RangeReader
from stream_assets.state.step_fate import PROPERTY_STEP, StepTag
from stream_assets.state.store import QueueStateStore

_log = logging.getLogger(__name__)

#: ``meta.extra`` keys: the latest step's prepared messages, and the seq whose
#: messages this store's process committed (local only until the next commit).
TX, TX_ENDED = "tx", "tx_ended"
_WIRE_VERSION = 1
#: Messages read per pull while looking for a step's messages at a sink queue's end.
_SCAN_BATCH = 256
#: Steps whose sink reads :class:`SeenIds` keeps (the least recently looked at go first).
_STEPS_KEPT = 256
#: How long a step has to end its transaction; later, only the broker's check-back
#: may (the broker refuses the step's end and checks the message only after it), so a
#: fenced owner still ending its step and the next owner's check-back never both
#: commit one message. Long enough for a loaded machine's step; it is also how soon
#: the check-back resolves a dead owner's step.
END_WINDOW_S = 20
#: How often a wait for a step's messages looks for them among the broker's discarded ones.
_DISCARD_LOOK_S = 5.0
#: How far before a step's born time (the client's clock) the look goes back: the
#: broker's clock stamps the stored copies; clocks kept by NTP differ by far less.
_CLOCK_SKEW_MS = 5_000


class TransactionPort(Protocol):
    """Half messages: prepared, then committed or rolled back
    (:class:`~stream_assets.rocketmq.transactions.TransactionalSender`, or the test
    driver's in-memory broker)."""

    def prepare(
        self, messages: Sequence[OutgoingMessage], properties: Mapping[str, str] | None = None
    ) -> list[Prepared]: ...

    def commit(self, prepared: Sequence[Prepared]) -> None: ...

    def rollback(self, prepared: Sequence[Prepared]) -> None: ...

    def resend(self, discarded: Sequence[Discarded]) -> None: ...


@dataclass(frozen=True)
class StepMessages:
    """A committed step's exactly-once messages, as its delta records them: by sink queue,
    each queue's UNIQ_KEYs in order, and when they were prepared."""

    born_ms: int
    queues: dict[MessageQueue, list[str]]

    def to_wire(self) -> list[Any]:
        """Versioned, for ``meta.extra``: ``[1, born_ms, [[topic, broker, queue, [ids]], ...]]``."""
        rows = [[q.topic, q.broker_name, q.queue_id, ids] for q, ids in self.queues.items()]
        return [_WIRE_VERSION, self.born_ms, rows]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> StepMessages:
        """Parse :meth:`to_wire`; ValueError for another version."""
        if not raw or raw[0] != _WIRE_VERSION:
            raise ValueError(
                f"state meta {TX!r} of version {raw[0] if raw else None}; this stream-assets "
                f"reads version {_WIRE_VERSION}: was the state written by a newer one?"
            )
        _, born_ms, rows = raw
        return cls(int(born_ms), {MessageQueue(t, b, int(q)): list(ids) for t, b, q, ids in rows})


@dataclass
class StepTransaction:
    """One attempt's exactly-once sink messages (a fresh one per attempt)."""

    port: TransactionPort
    topics: frozenset[str]
    tag: StepTag
    born_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    prepared: list[Prepared] = field(default_factory=list)

    def takes(self, topic: str) -> bool:
        """Whether a message to ``topic`` goes in this transaction."""
        return topic in self.topics

    def prepare(self, messages: Sequence[OutgoingMessage]) -> None:
        """Store ``messages`` as half messages naming this step, to be ended within
        :data:`END_WINDOW_S`."""
        if messages:
            properties = {PROPERTY_STEP: self.tag.encode(), PROPERTY_END_WINDOW: str(END_WINDOW_S)}
            self.prepared += self.port.prepare(messages, properties)

    def messages(self) -> StepMessages | None:
        """What the step's delta records (None: nothing prepared)."""
        if not self.prepared:
            return None
        queues: dict[MessageQueue, list[str]] = {}
        for p in self.prepared:
            queues.setdefault(MessageQueue(p.topic, p.broker_name, p.queue_id), []).append(p.msg_id)
        return StepMessages(self.born_ms, queues)

    def commit(self) -> None:
        """Make the prepared messages visible, each sink queue's in order."""
        self.port.commit(self.prepared)

    def rollback_quietly(self) -> None:
        """Drop the prepared messages; if that fails, the check-back does (the step's delta
        never landed)."""
        try:
            self.port.rollback(self.prepared)
        except Exception as exc:
            _log.warning("rolling back %d sink messages failed (%s)", len(self.prepared), exc)


class ExactlyOnceSinks:
    """An attempt's exactly-once sinks: its transaction, and what it reads the sink
    queues with when the previous step may be unended."""

    def __init__(
        self,
        transaction: StepTransaction,
        admin: OffsetQueries,
        reader: RangeReader,
        wait_s: float,
    ) -> None:
        self.transaction = transaction
        self.seen = SeenIds(admin, reader)
        self.wait_s = wait_s

    def await_previous(self, meta: StateMeta) -> bool:
        """Before a step: return once the previous step's messages are all visible; True
        if they were not known to be (note it: :data:`TX_ENDED`, so later steps do not
        look again).

        Its owner may have died between its delta and its end, or ended it too late
        (past :data:`END_WINDOW_S`): the check-back commits them then, so the wait is
        at most about the window plus one check interval after they were prepared.
        A key's results are therefore seen in step order without the step ever ending
        another step's messages.
        """
        step = unended(meta)
        if step is None:
            return False
        await_visible(self.seen, step, self.wait_s, self.transaction.port.resend)
        return True

    def end(self) -> bool:
        """After the step's delta landed: make its messages visible. Returns False if the
        broker refused (past the window): its check-back commits the rest then."""
        try:
            self.transaction.commit()
        except EndWindowClosedError as exc:
            _log.warning("%s; the broker's check-back commits the step's other messages", exc)
            return False
        return True

    def roll_back(self) -> None:
        """The step's delta never lands (not sent, or void): drop what it prepared."""
        if self.transaction.prepared:
            self.transaction.rollback_quietly()

    def finish(self, store: QueueStateStore, committed: bool) -> None:
        """After the step's commit: end its transaction and note that locally, or, if it
        committed nothing (so prepared nothing), roll back."""
        if not committed:
            self.roll_back()
        elif self.end():
            note_ended(store)


def record_step(meta: StateMeta, sinks: ExactlyOnceSinks | None, log_end: int) -> bytes | None:
    """Put the step's exactly-once messages in its delta's ``meta`` (and clear the previous
    step's). Returns the write id they name, which the delta must carry."""
    meta.extra.pop(TX_ENDED, None)
    meta.extra.pop(TX, None)
    if sinks is None:
        return None
    tag = sinks.transaction.tag
    if tag.at != log_end:
        raise StateError(
            f"{tag.encode()}: the step's sink messages name state offset {tag.at}, "
            f"but its delta goes to {log_end}; a bug: report it"
        )
    messages = sinks.transaction.messages()
    if messages is not None:
        meta.extra[TX] = messages.to_wire()
    return tag.write_id


def note_ended(store: QueueStateStore) -> None:
    """Note locally that the latest step's messages are visible (until the next commit)."""
    meta = store.meta.copy()
    meta.extra[TX_ENDED] = meta.seq
    store.update_meta(meta)


def unended(meta: StateMeta) -> StepMessages | None:
    """The latest committed step's messages, if no commit of them by this store's process
    is noted (the previous owner may have died before it ended them)."""
    raw = meta.extra.get(TX)
    if raw is None or meta.extra.get(TX_ENDED) == meta.seq:
        return None
    return StepMessages.from_wire(raw)


class SeenIds:
    """Which of a step's messages a consumer of a sink queue sees yet (by its own id, or,
    re-sent after the broker discarded it, by the original's:
    :func:`~stream_assets.rocketmq.discarded.ids_of`).

    The first look reads back from the queue's end to the step's born time (a
    committed message is stored when its commit is processed, after it was
    prepared); later looks at the same step read only what was stored since, so
    waiting for a step's messages, or answering many checks of one step, reads
    each message once. The latest :data:`_STEPS_KEPT` steps' reads are kept:
    checks of several steps' messages in one sink queue (keyed queues share sink
    queues) come interleaved.
    """

    def __init__(self, admin: OffsetQueries, reader: RangeReader) -> None:
        self.admin, self.reader = admin, reader
        #: Per queue and step (its ids there): the end read up to, which were seen.
        self._read: OrderedDict[tuple[MessageQueue, frozenset[str]], tuple[int, set[str]]] = (
            OrderedDict()
        )

    def unseen(self, queue: MessageQueue, born_ms: int, ids: list[str]) -> list[str]:
        """``ids`` (one step's, prepared at ``born_ms``) not in ``queue`` yet, in order."""
        wanted = frozenset(ids)
        end = self.admin.max_offset(queue)
        known = self._read.pop((queue, wanted), None)
        if known is None:
            found = {i for r in self._back(queue, end, born_ms, wanted) for i in ids_of(r) & wanted}
        else:
            found = known[1]
            for start in range(known[0], end, _SCAN_BATCH):
                records = self.reader.pull(queue, start, min(_SCAN_BATCH, end - start)).records
                found.update(i for r in records for i in ids_of(r) & wanted)
        self._read[(queue, wanted)] = (end, found)
        while len(self._read) > _STEPS_KEPT:
            self._read.popitem(last=False)
        return [i for i in ids if i not in found]

    def discarded(
        self, step: StepMessages, missing: Mapping[MessageQueue, list[str]]
    ) -> list[Discarded]:
        """Which of ``missing`` (``step``'s messages not seen yet, by queue) the broker
        discarded: their copies, each queue's in the step's order."""
        wanted: dict[str, set[str]] = {}
        for queue, ids in missing.items():
            wanted.setdefault(queue.broker_name, set()).update(ids)
        found: list[Discarded] = []
        for broker, of_broker in wanted.items():
            where = discard_queue(broker)
            try:
                end = self.admin.max_offset(where)
                # Discarded after the step was prepared: at most back to its born time.
                copies = self._back(where, end, step.born_ms, frozenset(of_broker))
            except TopicNotFoundError:  # the broker never discarded anything
                continue
            except CredentialsRefusedError as exc:  # a user granted before this existed
                _log.warning(
                    "cannot look for discarded sink messages on %s (%s): grant Sub and Get on "
                    "%s (docs/acl.md), or such a step waits for them in vain",
                    broker,
                    exc,
                    where.topic,
                )
                continue
            found += [Discarded(broker, r) for r in copies]
        rank = {i: n for ids in missing.values() for n, i in enumerate(ids)}
        return sorted(found, key=lambda d: rank[d.record.msg_id])

    def _back(
        self, queue: MessageQueue, end: int, born_ms: int, wanted: frozenset[str]
    ) -> list[Record]:
        """``queue``'s records answering to one of ``wanted``, read back from ``end`` to
        ``born_ms`` (less the clock skew)."""
        floor = born_ms - _CLOCK_SKEW_MS
        low = self.admin.min_offset(queue)
        found: list[Record] = []
        while end > low:
            start = max(low, end - _SCAN_BATCH)
            records = self.reader.pull(queue, start, end - start).records
            found += [r for r in records if ids_of(r) & wanted]
            if not records or records[0].store_timestamp < floor:
                break
            end = start
        return found


def await_visible(
    seen: SeenIds,
    step: StepMessages,
    wait_s: float,
    resend: Callable[[Sequence[Discarded]], None],
    poll_s: float = 0.25,
) -> None:
    """Return once every message of ``step`` is visible (the check-back committed it, or
    ``resend`` delivered it after the broker discarded it); TimeoutError after
    ``wait_s``, naming what is missing and what to check."""
    deadline = time.monotonic() + wait_s
    missing = dict(step.queues)
    look_for_discards = time.monotonic()
    resent: set[str] = set()
    while True:
        missing = {
            q: left for q, ids in missing.items() if (left := seen.unseen(q, step.born_ms, ids))
        }
        if not missing:
            return
        if time.monotonic() >= look_for_discards:
            # A step's owner died and no instance answered the broker's checks for
            # transactionCheckMax rounds: the broker gave up on its messages. They
            # are due (the step landed), so they are delivered plainly, once. The
            # copies stay in the discard queue, and a re-sent message may show in its
            # queue's offsets a moment after the send returned (the broker indexes
            # it behind the write): one re-send per id per wait.
            gone = [d for d in seen.discarded(step, missing) if d.record.msg_id not in resent]
            if gone:
                _log.warning(
                    "%d exactly-once sink messages of the previous step were discarded by "
                    "the broker (no instance answered its checks in time): re-sending them",
                    len(gone),
                )
                resend(gone)
                resent.update(d.record.msg_id for d in gone)
            look_for_discards = time.monotonic() + _DISCARD_LOOK_S
        if time.monotonic() >= deadline:
            sample = next(iter(missing.items()))
            raise TimeoutError(
                f"{sum(map(len, missing.values()))} exactly-once sink messages of the previous "
                f"step are still not visible after {wait_s:.0f} s (e.g. "
                f"{sample[0].topic}[{sample[0].queue_id}] on {sample[0].broker_name}: "
                f"{sample[1][:3]}). The broker's check-back commits them: check that an "
                "instance of the job runs (its driver answers the checks) and that the "
                "broker's transactionCheckInterval is set. Messages the broker discarded "
                "(to TRANS_CHECK_MAX_TIME_TOPIC) are re-sent as soon as they are found there; "
                "if that topic is gone, this queue cannot go on exactly once: reset the job "
                "(docs/guarantees.md)"
            )
        time.sleep(poll_s)
