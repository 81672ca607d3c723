"""What became of one step's commit, read from its state queue: the answer to a sink's check-back.

An exactly-once sink prepares a step's output as half messages before the
step's delta is compare-and-appended at the state queue's offset ``at``
(:mod:`~stream_assets.state.changelog`), and names the step in each message
(:class:`StepTag`). When the broker asks what became of such a message
(:mod:`~stream_assets.rocketmq.transaction_checks`), the state queue alone
answers, so any process can, whatever it remembers (docs/notes/transactions.md,
"Design of the exactly-once sink"):

- :attr:`StepFate.PENDING`: nothing is stored at ``at`` yet (or only some parts
  of the delta): the step may still land.
- :attr:`StepFate.VOID`: another write holds ``at`` (or one of its parts'
  offsets): this step never lands; its replay prepared output of its own.
- :attr:`StepFate.LANDED`: the step's delta is whole. Whether a later commit
  followed does not matter: the broker asks only after the step's end window
  (a property of each half message, which the sink that prepared it sets), when
  its owner can no longer end the step itself.

Example::

    >>> tag = StepTag("wc__count-state", 3, at=120, write_id=bytes.fromhex("00ff00ff00ff00ff"))
    >>> StepTag.decode(tag.encode()) == tag, tag.encode()
    (True, 'v1/wc__count-state/3/120/00ff00ff00ff00ff')
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.state.meta import StateMeta
from stream_assets.state.ports import OffsetQueries, RangeReader
from stream_assets.state.records import Delta, decode_record, is_void, join_delta_parts

#: The message property of an exactly-once sink's message that names its step.
PROPERTY_STEP = "SA_STEP"
_VERSION = "v1"


class StepFate(Enum):
    """What the state queue says of a step (see the module doc)."""

    PENDING = "pending"
    VOID = "void"
    LANDED = "landed"


@dataclass(frozen=True)
class StepTag:
    """A step's commit: its state topic and queue's index, the offset its delta must
    land at, and the delta's write id (fresh per attempt, so two attempts never match).
    """

    state_topic: str
    queue_id: int
    at: int
    write_id: bytes

    def encode(self) -> str:
        """The property value (versioned: ``v1/<state topic>/<queue>/<at>/<write id hex>``;
        a topic name holds no ``/``)."""
        return f"{_VERSION}/{self.state_topic}/{self.queue_id}/{self.at}/{self.write_id.hex()}"

    @classmethod
    def decode(cls, text: str) -> StepTag:
        """Parse :meth:`encode`'s text; ValueError naming what is wrong."""
        parts = text.split("/")
        if len(parts) != 5 or parts[0] != _VERSION or not parts[1]:
            raise ValueError(
                f"{PROPERTY_STEP}={text!r} is not a step tag of version {_VERSION} "
                "(v1/<state topic>/<queue>/<at>/<write id hex>); was it written by a newer "
                "stream-assets?"
            )
        try:
            return cls(parts[1], int(parts[2]), int(parts[3]), bytes.fromhex(parts[4]))
        except ValueError as exc:
            raise ValueError(f"{PROPERTY_STEP}={text!r}: {exc}") from exc


@dataclass(frozen=True)
class StepRead:
    """A step's fate, and the meta its delta committed (for a landed step)."""

    fate: StepFate
    meta: StateMeta | None = None


def step_fate(
    admin: OffsetQueries, reader: RangeReader, queue: MessageQueue, tag: StepTag
) -> StepRead:
    """What ``queue`` (the state queue of ``tag.queue_id``) says of the step ``tag`` names.

    Reads the message at ``tag.at`` (and the delta's other parts).
    """
    end = admin.max_offset(queue)
    if end <= tag.at:
        return StepRead(StepFate.PENDING)
    parts: list[Delta] = []
    while not parts or len(parts) < parts[0].parts:
        offset = tag.at + len(parts)
        if end <= offset:
            return StepRead(StepFate.PENDING)  # the writer may still be sending the rest
        record = _record_at(reader, queue, offset)
        if not isinstance(record, Delta) or not _is_ours(record, offset, tag.write_id):
            return StepRead(StepFate.VOID)
        parts.append(record)
    meta = parts[0].meta if len(parts) == 1 else join_delta_parts(parts)[1]
    return StepRead(StepFate.LANDED, meta)


def _record_at(reader: RangeReader, queue: MessageQueue, offset: int) -> object | None:
    batch = reader.pull(queue, offset, 1)
    if not batch.records or batch.records[0].queue_offset != offset:
        return None  # below the queue's retained start: nothing to prove it ours
    return decode_record(batch.records[0].body)


def _is_ours(record: Delta, offset: int, write_id: bytes) -> bool:
    return record.write_id == write_id and not is_void(record, offset)
