"""Which broker groups a running instance waits for, and since when.

An instance rides out a broker outage in its tasks (:mod:`.outage`): nothing
fails, the batch or step in flight simply waits. That is right for the data
and useless to an operator who sees no output, so the instance's own loop asks
each broker group it uses whether its master answers, and says in its log and
heartbeat which group it waits for and since when.

A group "has no master" when the name server's route has none, or the master
it names does not answer: a killed master stays in the routes until the name
server expires it (two minutes). The probe is a read that only a master
answers, one round trip per group.

Example::

    >>> from stream_assets.rocketmq.admin import MessageQueue
    >>> from stream_assets.rocketmq.errors import BrokerUnreachableError
    >>> down = {"broker-b"}
    >>> def probe(q: MessageQueue) -> None:
    ...     if q.broker_name in down:
    ...         raise BrokerUnreachableError("broker group broker-b", "-", "no master")
    >>> clock = iter([100.0, 160.0, 170.0]).__next__
    >>> watch = BrokerWatch(probe, clock)
    >>> queues = {g: MessageQueue("orders", g, 0) for g in ("broker-a", "broker-b")}
    >>> watch.look(queues).went_down
    {'broker-b': 100.0}
    >>> describe_waiting(watch.look(queues).down, now=160.0)
    'broker group broker-b: no master answers, for 60 s'
    >>> down.clear()
    >>> watch.look(queues).came_back
    {'broker-b': 70.0}
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.runtime.drive.outage import TRANSIENT


@dataclass(frozen=True)
class Outages:
    """One look: groups without a master (since when, epoch s), and what changed."""

    down: dict[str, float] = field(default_factory=dict)
    #: Groups found down at this look, not at the one before.
    went_down: dict[str, float] = field(default_factory=dict)
    #: Groups back at this look, with how long they were down (s).
    came_back: dict[str, float] = field(default_factory=dict)


class BrokerWatch:
    """Looks at each broker group's master; remembers since when one is missing.

    ``probe(queue)`` raises a transient broker error when ``queue``'s group has
    no master answering; ``clock`` gives epoch seconds.
    """

    def __init__(
        self, probe: Callable[[MessageQueue], object], clock: Callable[[], float] = time.time
    ) -> None:
        self._probe = probe
        self._clock = clock
        self._since: dict[str, float] = {}

    def look(self, queues: Mapping[str, MessageQueue]) -> Outages:
        """Probe one queue per group (``queues``: group -> a queue of it)."""
        now = self._clock()
        went_down: dict[str, float] = {}
        came_back: dict[str, float] = {}
        for group, queue in queues.items():
            try:
                self._probe(queue)
            except TRANSIENT:
                if group not in self._since:
                    self._since[group] = went_down[group] = now
                continue
            except RocketMQError:
                pass  # a refusal (ACL, an error code) is an answer: the master is there
            if group in self._since:
                came_back[group] = now - self._since.pop(group)
        return Outages(dict(self._since), went_down, came_back)


def describe_waiting(down: Mapping[str, float], now: float | None = None) -> str:
    """What a heartbeat says the instance waits for ("" when nothing).

    >>> describe_waiting({})
    ''
    """
    at = time.time() if now is None else now
    return "; ".join(
        f"broker group {group}: no master answers, for {at - since:.0f} s"
        for group, since in sorted(down.items())
    )
