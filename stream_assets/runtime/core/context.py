"""What the per-queue core needs to run one queue of one stage, and what it reports.

:class:`StageContext` is plain data (the stage's plan nodes and engine numbers,
no clients, no settings that reach a broker), so the same core runs inside a
Spark task and inside :mod:`stream_assets.testing`. The Spark adapter wraps it
in a :class:`~stream_assets.runtime.drive.queues.TaskContext` with the client
settings.

Example::

    >>> from stream_assets.examples import wordcount
    >>> topology = wordcount.build("wc", "lines", "counts")
    >>> ctx = StageContext.of(topology, 1, shuffle_queues=4, source_queues=(0, 1))
    >>> ctx.stage.stateful, ctx.origins
    (True, (0, 1))
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import pyarrow as pa

from stream_assets.plan.topology import Stage, Topology, origin_id
from stream_assets.settings import DEFAULT_MAX_MESSAGE_SIZE

#: Shuffle bodies stay under the broker's 4 MiB message limit.
MAX_BODY_BYTES = 3 * 1024 * 1024


@dataclass(frozen=True)
class StageContext:
    """One stage of one topology, as every queue task of it sees it."""

    job_id: str
    stage: Stage
    shuffle_queues: int
    dead_letter_topic: str
    snapshot_every: int = 100
    pre_combine: bool = True  # engine setting: pre-aggregate before the shuffle where exact
    #: Per source queue, the end of the last batch any earlier run planned (see
    #: Instance._combine_from). A batch may be pre-combined only from there on:
    #: anything below may have been sent, cut short, by a run that crashed, with
    #: other batch boundaries; per-record origins de-duplicate against any such
    #: prefix, combined ones do not.
    combine_from: tuple[tuple[int, int], ...] = ()
    #: Every origin (upstream queue, see plan.topology.origin_id) of a keyed
    #: stage: each one holds its watermark until it has spoken or is idle
    #: (slow queues stay on time).
    origins: tuple[int, ...] = ()
    #: The allocation generation and the instance that commits state: recorded
    #: in every changelog record, so the state topic says who owns a queue.
    generation: int = 0
    writer: str = ""
    #: The client's message size limit: a sink body over it is that record's dead letter.
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE

    @classmethod
    def of(
        cls,
        topology: Topology,
        index: int,
        *,
        shuffle_queues: int,
        source_queues: Mapping[str, Sequence[int]] | Sequence[int] = (),
        **kwargs: object,
    ) -> StageContext:
        """The context of stage ``index`` of ``topology``.

        ``source_queues``: the queue ids of each source topic (one sequence: the
        same for every source), from which a keyed stage's origins follow.
        """
        stage = topology.stages[index]
        origins: list[int] = []
        for up in stage.upstreams:
            upstream = topology.stages[up]
            if upstream.source is None:
                queues: Sequence[int] = range(shuffle_queues)
            elif isinstance(source_queues, Mapping):
                queues = source_queues.get(upstream.input_topic, ())
            else:
                queues = source_queues
            origins.extend(origin_id(up, q) for q in queues)
        return cls(
            job_id=topology.job_id,
            stage=stage,
            shuffle_queues=shuffle_queues,
            dead_letter_topic=topology.dead_letter_topic,
            origins=tuple(origins),
            **kwargs,  # type: ignore[arg-type]
        )

    def may_combine(self, queue_id: int, start: int) -> bool:
        """Whether the batch of ``queue_id`` starting at ``start`` may be pre-combined."""
        return self.pre_combine and start >= dict(self.combine_from).get(queue_id, 2**63)


@dataclass
class TaskStats:
    """Per-queue, per-batch figures a task reports back to the driver."""

    stage: int = 0
    queue_id: int = 0
    end_offset: int = 0
    #: Where the commit must stay (a step's messages for a broker group without a
    #: master are still held: runtime/drive/held_sends.py); -1: at ``end_offset``.
    held_from: int = -1
    records_in: int = 0
    #: Of records_in: records a batch operator chain counted a whole batch at a time.
    batched_in: int = 0
    outputs: int = 0
    shuffle_messages: int = 0
    shuffle_records: int = 0  # entries sent: records, or pre-combined partials
    #: Of shuffle_messages: progress marks (a shuffle queue the batch had no entries for).
    progress_marks: int = 0
    dead_letters: int = 0
    late: int = 0
    skipped_duplicates: int = 0
    fired: int = 0
    expired: int = 0  # keys whose TTL passed
    state_keys: int = 0
    state_bytes: int = 0
    #: 1 when this batch found its local store behind the state topic and restored it
    #: in full (wipe, latest snapshot, tail) ...
    restores: int = 0
    #: ... or 1 when it caught up by applying only the deltas written since its own.
    catch_ups: int = 0
    restored_keys: int = 0
    #: Seconds spent proving the local store current (the offset query) ...
    currency_s: float = 0.0
    #: ... and restoring or catching up when it was not.
    restore_s: float = 0.0
    watermark: int = -1
    #: Digest of the client settings the task used (credentials included, never shown):
    #: lets the driver prove its settings, not the executor's environment, reached the task.
    settings_digest: str = ""
    seconds: float = 0.0
    started: float = field(default_factory=time.monotonic, repr=False)

    def as_row(self) -> dict[str, Any]:
        """The figures as the driver records them, ``seconds`` taken now."""
        self.seconds = time.monotonic() - self.started
        return {k: v for k, v in asdict(self).items() if k != "started"}

    def to_batch(self) -> pa.RecordBatch:
        """One Arrow row for mapInArrow's output."""
        return pa.RecordBatch.from_pylist([self.as_row()], schema=STATS_ARROW_SCHEMA)


_STATS_TYPES = {
    "int": ("long", pa.int64()),
    "float": ("double", pa.float64()),
    "str": ("string", pa.string()),
}
_STAT_FIELDS = [f for f in fields(TaskStats) if f.name != "started"]
STATS_ARROW_SCHEMA = pa.schema([(f.name, _STATS_TYPES[str(f.type)][1]) for f in _STAT_FIELDS])
#: The same schema as a Spark DDL string.
STATS_DDL = ", ".join(f"{f.name} {_STATS_TYPES[str(f.type)][0]}" for f in _STAT_FIELDS)
