"""What a real-time task holds back while a broker group has no master: the other groups go on.

A stage-0 step sends to the shuffle queues of every broker group (a key's
queue is wherever its hash lands). Were every send waited for, one group
without a master would stop every step, and the keyed queues of the healthy
groups would get nothing new. So a real-time task sends what the groups that
answer can store and holds the rest here, per source queue, in order:

- a group's messages are held once its sends fail as unreachable (after the
  producer's own retries) and from then on every later message for that group
  goes behind them, so each shuffle queue still gets one origin's messages in
  offset order (the keyed stage de-duplicates by origin high-water mark: a
  later message overtaking an earlier one would make the earlier one a replay);
- the source queue's commit stays at the start of its oldest step with a held
  message (:meth:`HeldSends.held_from`): a crash replays from there, the
  healthy groups' messages are dropped as replays, the held ones are sent
  for the first time;
- held messages are sent again every few seconds (the outage policy's
  back-off), in order, before a step's own;
- past ``limit_bytes`` the step waits as a step did before (the task's outage
  policy), so memory stays bounded.

Only a real-time task holds: it keeps its queues for an interval, whereas a
micro-batch's next task for a queue may run in another process. What an
interval ends with still held is dropped and the queue's next interval starts
from :meth:`HeldSends.held_from` (the offset committed for it): the range is
derived again from the source.

Example::

    >>> held = HeldSends(lambda: producer, 64 << 20, retry_every_s=5.0)  # doctest: +SKIP
    >>> SendBuffer(held.transport((0, 3), start=120)).flush()  # doctest: +SKIP
    >>> held.held_from((0, 3)), held.groups  # doctest: +SKIP
    (120, {'broker-b'})
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from stream_assets.rocketmq.errors import BrokerUnreachableError
from stream_assets.rocketmq.records import OutgoingMessage, SendReceipt
from stream_assets.runtime.drive.outage import stderr_log

#: A source queue: (stage index, queue index).
QueueKey = tuple[int, int]


class ReachableSender(Protocol):
    """What :class:`HeldSends` sends through (the batch producer)."""

    @property
    def max_message_size(self) -> int: ...

    def send_reachable(
        self, messages: Sequence[OutgoingMessage], skip: Collection[str] = ...
    ) -> tuple[list[SendReceipt | None], dict[int, str]]: ...


@dataclass(frozen=True)
class _Item:
    #: The first offset of the step that made the message.
    start: int
    message: OutgoingMessage
    group: str


class HeldSends:
    """The messages one real-time task could not send yet, per source queue, in order."""

    def __init__(
        self,
        producer: Callable[[], ReachableSender],
        limit_bytes: int,
        retry_every_s: float,
        log: Callable[[str], None] = stderr_log,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._producer = producer
        self.limit_bytes = limit_bytes
        self._retry_every_s = retry_every_s
        self._log = log
        self._clock = clock
        self._held: dict[QueueKey, list[_Item]] = {}
        self.bytes = 0
        #: Groups with held messages -> when the first was held (monotonic).
        self._since: dict[str, float] = {}
        self._next_retry = 0.0
        #: Queues whose held messages were all stored since :meth:`take_cleared`.
        self._cleared: set[QueueKey] = set()

    @property
    def groups(self) -> set[str]:
        """The broker groups messages are held for."""
        return set(self._since)

    @property
    def messages(self) -> int:
        """How many messages are held."""
        return sum(len(items) for items in self._held.values())

    def queues(self) -> list[QueueKey]:
        """The source queues that hold messages."""
        return list(self._held)

    def held_from(self, queue: QueueKey) -> int | None:
        """The offset to commit at most for ``queue`` (None: nothing held for it)."""
        items = self._held.get(queue)
        return min(i.start for i in items) if items else None

    def transport(self, queue: QueueKey, start: int) -> _StepTransport:
        """The transport of one step of ``queue`` that reads from offset ``start``."""
        return _StepTransport(self, queue, start)

    def unheld_transport(self) -> _UnheldTransport:
        """The transport of a step of several queues at once, whose messages each stand
        for several queues and so cannot be held for one: it raises
        :class:`GroupWentDown` instead of holding (the step then goes queue by queue).
        Only while nothing is held: a queue's messages must not overtake its held ones."""
        assert not self._held, "a step of several queues while messages are held"
        return _UnheldTransport(self)

    def take_cleared(self) -> list[QueueKey]:
        """The queues whose held messages were all stored since the last call and
        that hold none now: their commit may go to where they have been read."""
        cleared, self._cleared = self._cleared, set()
        return sorted(q for q in cleared if q not in self._held)

    def retry(self, force: bool = False) -> None:
        """Send the held messages again if it is time (or ``force``)."""
        if not self._held or (not force and self._clock() < self._next_retry):
            return
        producer = self._producer()
        failed: set[str] = set()  # groups found down this round: not tried again in it
        for queue, items in list(self._held.items()):
            _, unsent = producer.send_reachable([i.message for i in items], failed)
            failed.update(unsent.values())
            left = [items[p] for p in sorted(unsent)]
            self.bytes -= sum(len(i.message.body) for i in items) - sum(
                len(i.message.body) for i in left
            )
            if left:
                self._held[queue] = left
            else:
                del self._held[queue]
                self._cleared.add(queue)
        self._settle()
        self._next_retry = self._clock() + self._retry_every_s

    def _settle(self) -> None:
        """Forget groups with nothing held any more, saying so."""
        holding = {i.group for items in self._held.values() for i in items}
        for group in set(self._since) - holding:
            waited = self._clock() - self._since.pop(group)
            self._log(
                f"broker group {group} answers again: its held messages sent ({waited:.0f} s)"
            )

    def _send(
        self, queue: QueueKey, start: int, messages: Sequence[OutgoingMessage]
    ) -> list[SendReceipt]:
        if self.bytes >= self.limit_bytes:
            self.retry(force=True)
            if self.bytes >= self.limit_bytes:
                # Nothing of this step was sent: the step is retried whole (queues.run_range).
                raise BrokerUnreachableError(
                    f"broker group(s) {', '.join(sorted(self._since))}",
                    "-",
                    f"{self.bytes} bytes of messages are held for them, the limit "
                    f"(STREAM_ASSETS_ENGINE_HELD_SEND_BYTES, {self.limit_bytes}) is reached",
                )
        self.retry()
        receipts, unsent = self._producer().send_reachable(messages, set(self._since))
        if unsent:
            items = self._held.setdefault(queue, [])
            for position in sorted(unsent):
                message, group = messages[position], unsent[position]
                items.append(_Item(start, message, group))
                self.bytes += len(message.body)
                self._went_down(group)
        return [r for r in receipts if r is not None]

    def _went_down(self, group: str) -> None:
        if group not in self._since:
            self._since[group] = self._clock()
            self._next_retry = self._clock() + self._retry_every_s
            self._log(
                f"broker group {group} does not answer: its messages are held (the "
                "other groups' go on; the source offsets that made them stay "
                "uncommitted)"
            )


class _StepTransport:
    """A :class:`~stream_assets.runtime.core.send_buffer.Transport` for one step of one queue."""

    def __init__(self, held: HeldSends, queue: QueueKey, start: int) -> None:
        self._held, self._queue, self._start = held, queue, start

    @property
    def max_message_size(self) -> int:
        return self._held._producer().max_message_size

    def send_all(self, messages: Sequence[OutgoingMessage]) -> list[SendReceipt]:
        return self._held._send(self._queue, self._start, messages)


class GroupWentDown(Exception):
    """A step of several queues found a broker group without a master (not transient:
    the step is not retried as it was, but queue by queue, their messages held)."""


class _UnheldTransport:
    """A :class:`~stream_assets.runtime.core.send_buffer.Transport` that holds nothing."""

    def __init__(self, held: HeldSends) -> None:
        self._held = held

    @property
    def max_message_size(self) -> int:
        return self._held._producer().max_message_size

    def send_all(self, messages: Sequence[OutgoingMessage]) -> list[SendReceipt]:
        receipts, unsent = self._held._producer().send_reachable(messages, set())
        down = sorted(set(unsent.values()))
        for group in down:
            self._held._went_down(group)
        if down:
            raise GroupWentDown(", ".join(down))
        return [r for r in receipts if r is not None]
