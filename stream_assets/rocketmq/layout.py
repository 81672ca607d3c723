"""A topic's queue layout: which ``(broker name, queue id)`` each queue index names.

A RocketMQ topic is the union of its queues on every broker group that serves
it: ``broker-a`` queues 0-3 and ``broker-b`` queues 0-3 are eight different
queues. The engine numbers them by position in the layout, sorted by broker
name then queue id (the order of RocketMQ's own allocation strategies), and
uses that index wherever a queue is one of a fixed set: shuffle targets
(``key hash % count``), the state queue of a shuffle queue, origins, the
allocation. A layout is fixed for a job's life (rocketmq/provision.py stores it
on the name server), so an index never changes meaning when a broker group
comes or goes: a group missing from the route is an outage, not a new layout.

With one broker group the index is the queue id.

Example::

    >>> layout = TopicLayout("orders", (("broker-b", 0), ("broker-a", 1), ("broker-a", 0)))
    >>> layout.pairs
    (('broker-a', 0), ('broker-a', 1), ('broker-b', 0))
    >>> layout.queue(2)
    MessageQueue(topic='orders', broker_name='broker-b', queue_id=0)
    >>> layout.index(layout.queue(1)), len(layout), layout.brokers
    (1, 3, ('broker-a', 'broker-b'))
    >>> TopicLayout.decode("orders", layout.encode()) == layout
    True
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from stream_assets.rocketmq.admin import MessageQueue

#: The name server KV namespace holding each positional topic's layout, by topic name.
LAYOUT_NAMESPACE = "stream-assets-layout"


@dataclass(frozen=True)
class TopicLayout:
    """The queues of one topic in index order (sorted by broker name, then queue id)."""

    topic: str
    pairs: tuple[tuple[str, int], ...]
    _index: dict[tuple[str, int], int] = field(
        init=False, repr=False, compare=False, hash=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        ordered = tuple(sorted((str(b), int(q)) for b, q in self.pairs))
        if len(set(ordered)) != len(ordered):
            raise ValueError(f"layout of topic {self.topic!r} names a queue twice: {ordered}")
        object.__setattr__(self, "pairs", ordered)
        self._index.update({pair: i for i, pair in enumerate(ordered)})

    @classmethod
    def of(cls, queues: Iterable[MessageQueue]) -> TopicLayout:
        """The layout of ``queues`` (all of one topic, e.g. a route's read queues)."""
        listed = list(queues)
        topics = {q.topic for q in listed}
        if len(topics) != 1:
            raise ValueError(f"a layout is of one topic, got queues of {sorted(topics)}")
        return cls(topics.pop(), tuple((q.broker_name, q.queue_id) for q in listed))

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def brokers(self) -> tuple[str, ...]:
        """The broker groups holding queues of the topic, by name."""
        return tuple(sorted({b for b, _ in self.pairs}))

    @property
    def queues(self) -> list[MessageQueue]:
        """Every queue, in index order."""
        return [MessageQueue(self.topic, b, q) for b, q in self.pairs]

    def queue(self, index: int) -> MessageQueue:
        """The queue at ``index``; IndexError naming the topic if there is none."""
        if not 0 <= index < len(self.pairs):
            raise IndexError(
                f"topic {self.topic!r} has {len(self.pairs)} queues in its layout; "
                f"no queue index {index}"
            )
        broker, queue_id = self.pairs[index]
        return MessageQueue(self.topic, broker, queue_id)

    def index(self, queue: MessageQueue) -> int:
        """The index of ``queue``; KeyError naming it if the layout does not hold it."""
        try:
            return self._index[(queue.broker_name, queue.queue_id)]
        except KeyError:
            raise KeyError(
                f"queue {queue.queue_id} on broker {queue.broker_name} is not in the layout "
                f"of topic {self.topic!r} ({describe_pairs(self.pairs)})"
            ) from None

    def encode(self) -> str:
        """A versioned JSON text (stored on the name server, passed to Spark as an option)."""
        return json.dumps({"v": 1, "queues": [list(p) for p in self.pairs]}, separators=(",", ":"))

    @classmethod
    def decode(cls, topic: str, text: str) -> TopicLayout:
        """The layout :meth:`encode` wrote; ValueError if it is not one."""
        try:
            data = json.loads(text)
            if data.get("v") != 1:
                raise ValueError(f"unknown layout version {data.get('v')!r}")
            return cls(topic, tuple((str(b), int(q)) for b, q in data["queues"]))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"stored layout of topic {topic!r} is not readable: {exc}") from exc


class LayoutSource(Protocol):
    """What :func:`current_layout` reads: the name server's stored layouts and a topic's
    queues now (a :class:`~stream_assets.rocketmq.admin.RocketMQAdmin`, or an in-memory
    stand-in)."""

    def get_kv(self, namespace: str, key: str) -> str | None: ...

    def queues(self, topic: str) -> list[MessageQueue]: ...


def current_layout(admin: LayoutSource, topic: str) -> TopicLayout:
    """``topic``'s layout as the engine fixed it (stored on the name server), else its
    route's now (a topic the engine never provisioned).

    Example::

        >>> current_layout(admin, "wordcount__state__aggregate").queue(2)  # doctest: +SKIP
        MessageQueue(topic='wordcount__state__aggregate', broker_name='broker-a', queue_id=2)
    """
    stored = admin.get_kv(LAYOUT_NAMESPACE, topic)
    if stored is not None:
        return TopicLayout.decode(topic, stored)
    return TopicLayout.of(admin.queues(topic))


def describe_pairs(pairs: Iterable[tuple[str, int]]) -> str:
    """``broker-a: 0-3; broker-b: 0-3`` for a person.

    >>> describe_pairs([("b", 0), ("a", 0), ("a", 1), ("a", 3)])
    'a: 0, 1, 3; b: 0'
    """
    by_broker: dict[str, list[int]] = {}
    for broker, queue_id in sorted(pairs):
        by_broker.setdefault(broker, []).append(queue_id)
    if not by_broker:
        return "no queues"
    return "; ".join(f"{b}: {', '.join(map(str, ids))}" for b, ids in by_broker.items())
