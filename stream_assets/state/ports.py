"""What the state layer asks of the broker: a queue's offsets, the stored layout, its records.

The state layer (making a store current, restoring it, a reset's look at a
state queue) takes these Protocols rather than the concrete clients.
:class:`~stream_assets.rocketmq.admin.RocketMQAdmin` and
:class:`~stream_assets.rocketmq.reader.QueueReader` satisfy them against a
broker; the test driver's view of its in-memory topics
(:mod:`stream_assets.testing`) satisfies them without one.

- :class:`OffsetQueries`: a queue's first and end offsets (all a store's
  currency check and a restore of a known queue need of the admin);
- :class:`StateTopicAdmin`: those, and a topic's layout, to turn a state
  topic's queue index into its queue
  (:func:`~stream_assets.state.restore.state_queue`);
- :class:`RangeReader`: one message at an offset, or a range of a queue.

Example: an in-memory queue of three messages answers the offset queries::

    >>> class ThreeMessages:
    ...     def min_offset(self, queue): return 0
    ...     def max_offset(self, queue): return 3
    >>> isinstance(ThreeMessages(), OffsetQueries), isinstance(ThreeMessages(), StateTopicAdmin)
    (True, False)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.layout import LayoutSource
from stream_assets.rocketmq.reader import PullBatch
from stream_assets.rocketmq.records import Record


@runtime_checkable
class OffsetQueries(Protocol):
    """A queue's offset range: the first stored offset and the end (the next one's)."""

    def min_offset(self, queue: MessageQueue) -> int: ...

    def max_offset(self, queue: MessageQueue) -> int: ...


@runtime_checkable
class StateTopicAdmin(OffsetQueries, LayoutSource, Protocol):
    """Offsets, and the layout that names a state topic's queue of a given index."""


@runtime_checkable
class RangeReader(Protocol):
    """Reads a queue by offset: ``pull`` up to ``max_messages`` from one offset (a
    status when there are none), ``read`` every record from ``start`` to ``end``
    (default: the queue's end now)."""

    def pull(
        self, queue: MessageQueue, offset: int, max_messages: int | None = None
    ) -> PullBatch: ...

    def read(self, queue: MessageQueue, start: int, end: int | None = None) -> Iterator[Record]: ...
