"""A consumer group's offsets as one instance commits them: what the broker acknowledged,
what waits for a group without a master, and what a restarted master lost.

The broker's committed offsets are the only record of where each queue's work
ended (a later start, a rebalance and the lag all read them), so the instance
commits after every batch or step. Two things can go wrong between the commit
and the broker's memory, and both are handled here, under one lock:

- a group has no master right now: its offsets **wait** and go with the next
  commit (or :meth:`OffsetCommits.commit_waiting`) once it is back;
- a master killed before it flushed its consumer offsets (RocketMQ: every 5 s)
  restarts with older ones. Nothing else would commit those queues again until
  new input arrives there, so :meth:`OffsetCommits.group_offsets` commits them
  again when it sees the broker behind what it **acknowledged**.

Only offsets the broker acknowledged count as evidence of a loss, and a lower
answer is asked again of the master itself before it is believed: a commit
that was still waiting when the broker was asked, or a slave's copy (a sync
interval old) answering while the master is down, is no loss.

Example::

    >>> from stream_assets.rocketmq.admin import MessageQueue
    >>> class Broker:  # a stand-in for RocketMQAdmin
    ...     offsets: dict = {}
    ...     def commit_consumer_offsets(self, group, offsets):
    ...         self.offsets.update(offsets)
    ...     def group_offsets(self, group, topic, queues, from_master=False):
    ...         return {q: self.offsets.get(q) for q in queues}
    >>> broker, q = Broker(), MessageQueue("orders", "broker-a", 0)
    >>> said = []
    >>> book = OffsetCommits(lambda: broker, "wordcount", progress=said.append)
    >>> book.commit({q: 120})
    >>> broker.offsets.clear()  # the master restarted without them
    >>> book.group_offsets("orders", [q])[q] is None
    True
    >>> said[0][:55]
    'broker group broker-a lost the committed offsets of 1 q'
    >>> book.commit_waiting(), broker.offsets[q]
    (0, 120)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.errors import BrokerUnreachableError, TopicNotFoundError


class OffsetBroker(Protocol):
    """What committing needs of :class:`~stream_assets.rocketmq.admin.RocketMQAdmin`."""

    def commit_consumer_offsets(self, group: str, offsets: Mapping[MessageQueue, int]) -> None:
        """Store each queue's offset as ``group``'s position (acknowledged)."""

    def group_offsets(
        self,
        group: str,
        topic: str,
        queues: Iterable[MessageQueue] | None = None,
        *,
        from_master: bool = False,
    ) -> dict[MessageQueue, int | None]:
        """``group``'s committed offset on each queue; None if never committed."""


class OffsetCommits:
    """Commits one consumer group's offsets for the queues this instance runs.

    ``admin``: returns the client (the instance opens it lazily); ``progress``:
    where a waiting group or a lost commit is reported.
    """

    def __init__(
        self, admin: Callable[[], OffsetBroker], group: str, progress: Callable[[str], None]
    ) -> None:
        self._admin = admin
        self.group = group
        self._progress = progress
        self._lock = threading.Lock()
        #: The newest offset of each queue this instance committed or tried to.
        self._latest: dict[MessageQueue, int] = {}
        #: The newest offset of each queue the broker acknowledged: the only evidence
        #: a lower answer later is a loss.
        self._acknowledged: dict[MessageQueue, int] = {}
        #: Offsets a group without a master could not store yet; the groups whose
        #: wait was reported (once per outage).
        self._waiting: dict[MessageQueue, int] = {}
        self._reported: set[str] = set()

    def commit(self, ends: Mapping[MessageQueue, int]) -> None:
        """Commit ``ends`` and every offset still waiting, a round trip per broker group;
        a group that cannot store them now keeps them waiting."""
        with self._lock:
            self._latest.update(ends)
            by_group: dict[str, dict[MessageQueue, int]] = {}
            for queue, offset in {**self._waiting, **ends}.items():
                by_group.setdefault(queue.broker_name, {})[queue] = offset
            for broker, offsets in by_group.items():
                try:
                    # Repeating a commit (a retried batch, outage riding) is safe.
                    self._admin().commit_consumer_offsets(self.group, offsets)
                except (BrokerUnreachableError, TopicNotFoundError) as exc:
                    if broker not in self._reported:
                        self._reported.add(broker)
                        self._progress(f"offsets on broker group {broker} wait: {exc}")
                    self._waiting.update(offsets)
                    continue
                self._acknowledged.update(offsets)
                self._reported.discard(broker)
                for queue in offsets:
                    self._waiting.pop(queue, None)

    def commit_waiting(self) -> int:
        """Commit the offsets that wait (nothing else commits them while no new input
        arrives); returns how many still wait."""
        if self._waiting:
            self.commit({})
        return len(self._waiting)

    @property
    def waiting(self) -> int:
        """How many queues' offsets wait for their group's master."""
        return len(self._waiting)

    def forget(self) -> None:
        """The queues are no longer this instance's to vouch for (at a stop): a later
        answer below what it committed is another owner's, not a loss."""
        with self._lock:
            self._latest.clear()
            self._acknowledged.clear()

    def group_offsets(
        self, topic: str, queues: list[MessageQueue]
    ) -> dict[MessageQueue, int | None]:
        """The broker's committed offsets of ``queues``; any it lost of this instance's
        acknowledged commits go with the next commit (:meth:`commit_waiting`)."""
        with self._lock:
            # Taken before the broker is asked: a commit acknowledged while it answers
            # may not show in the answer, and is no loss.
            acknowledged = {q: self._acknowledged[q] for q in queues if q in self._acknowledged}
        answer = self._admin().group_offsets(self.group, topic, queues)
        behind = [q for q in acknowledged if _below(answer[q], acknowledged[q])]
        if behind:
            self._commit_again_if_lost(topic, behind, acknowledged)
        return answer

    def _commit_again_if_lost(
        self, topic: str, behind: list[MessageQueue], acknowledged: dict[MessageQueue, int]
    ) -> None:
        """Ask the masters of the ``behind`` queues; what they lost commits again."""
        try:
            truth = self._admin().group_offsets(self.group, topic, behind, from_master=True)
        except (BrokerUnreachableError, TopicNotFoundError):
            return  # a slave answered, its master down: no evidence either way
        with self._lock:
            lost = {
                q: self._latest.get(q, acknowledged[q])  # the newest of ours
                for q in behind
                if _below(truth[q], acknowledged[q]) and q not in self._waiting
            }
            if not lost:
                return
            self._waiting.update(lost)
        groups = ", ".join(sorted({q.broker_name for q in lost}))
        self._progress(
            f"broker group {groups} lost the committed offsets of {len(lost)} queues "
            "(its master restarted before it flushed them); committing them again"
        )


def _below(on_broker: int | None, ours: int) -> bool:
    """Whether the broker's answer is behind ``ours`` (None: it has no offset at all)."""
    return on_broker is None or on_broker < ours
