"""What a user function may learn about the record it is given (opt-in: ``metadata=True``).

Before the first ``key_by`` a value comes from one source message, and its
metadata is that message's. After a stateful operator a value is a result,
not a message: ``key`` is the result's key, ``event_time`` its time, and the
message fields are None.

Example::

    >>> from stream_assets.dsl.builder import StreamBuilder
    >>> from stream_assets.serde import text_deserializer
    >>> b = StreamBuilder("meta")
    >>> (b.source("lines", text_deserializer)
    ...   .map(lambda v, m: {"line": v, "tag": m.tags, "queue": m.queue_id}, metadata=True)
    ...   .sink("tagged"))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stream_assets.rocketmq.records import Record


@dataclass(frozen=True)
class Metadata:
    """The message behind a value: keys, tag, properties, position and broker times."""

    topic: str
    queue_id: int | None = None
    offset: int | None = None
    keys: tuple[str, ...] = ()
    tags: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    #: When the producer created the message / when the broker stored it (epoch ms).
    born_timestamp: int | None = None
    store_timestamp: int | None = None
    #: The value's event time (epoch ms) as the engine uses it.
    event_time: int | None = None
    #: After a stateful operator: the result's key.
    result_key: Any = None

    @property
    def key(self) -> str | None:
        """The first message key, or None."""
        return self.keys[0] if self.keys else None

    @classmethod
    def of(cls, record: Record, event_time: int) -> Metadata:
        """The metadata of a source message."""
        return cls(
            topic=record.topic,
            queue_id=record.queue_id,
            offset=record.queue_offset,
            keys=record.keys,
            tags=record.tags,
            properties=dict(record.properties),
            born_timestamp=record.born_timestamp,
            store_timestamp=record.store_timestamp,
            event_time=event_time,
        )
