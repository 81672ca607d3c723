"""The stable key hash that routes a key to a queue.

Must give the same queue in every process and Python version, so it is not
Python's salted ``hash()``. MD5 of the UTF-8 key, like RocketMQ Streams 1.1,
folded to a non-negative 31-bit int (the C++ client's queue selector takes a C
``int``); the queue is that value modulo the queue count.

Example::

    >>> queue_for_key("user-42", 8)
    7
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable


def key_hash(key: str | bytes) -> int:
    """A stable, non-negative 31-bit hash of ``key``."""
    data = key.encode("utf-8") if isinstance(key, str) else key
    return int.from_bytes(hashlib.md5(data, usedforsecurity=False).digest()[:4], "big") & 0x7FFFFFFF


def queue_for_key(key: str | bytes, queue_count: int) -> int:
    """The queue id ``key`` is routed to among ``queue_count`` queues."""
    if queue_count <= 0:
        raise ValueError(f"queue_count must be positive, got {queue_count}")
    return key_hash(key) % queue_count


def choose_queue(
    topic: str,
    queue_count: int,
    queue_id: int | None = None,
    route_key: str | bytes | None = None,
    turn: Callable[[], int] | None = None,
) -> int:
    """The queue of one message: ``queue_id``, else the stable hash of ``route_key``,
    else the next ``turn()`` (round-robin). Every sender of the project picks so.

    >>> choose_queue("t", 8, queue_id=3), choose_queue("t", 8, route_key="user-42")
    (3, 7)
    """
    if queue_id is not None:
        if not 0 <= queue_id < queue_count:
            raise ValueError(
                f"queue_id {queue_id} is outside topic {topic!r}'s {queue_count} queues"
            )
        return queue_id
    if route_key is not None:
        return key_hash(route_key) % queue_count
    if turn is None:
        raise ValueError(f"message for topic {topic!r}: no queue_id, key or round-robin turn")
    return turn() % queue_count
