"""What a Spark task needs to run one queue of one stage, and what it reports.

The context is pickled into the task closure, so it holds only plain settings
(never credentials: tasks read those from the environment) plus the stage's
plan nodes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import pyarrow as pa

from stream_assets.plan import nodes as n
from stream_assets.plan.topology import Stage
from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.clients import producer_for
from stream_assets.settings import RocketMQSettings

#: Shuffle and changelog bodies stay under the broker's 4 MiB message limit.
MAX_BODY_BYTES = 3 * 1024 * 1024
_PROPERTY_MAX = 400


@dataclass(frozen=True)
class TaskContext:
    """Everything a stage task needs, pickled into the Spark closure."""

    job_id: str
    stage: Stage
    next_aggregate: n.Aggregate | None
    namesrv_addr: str
    group: str
    broker_name: str
    shuffle_queues: int
    dead_letter_topic: str
    state_dir: str
    snapshot_every: int
    pre_combine: bool  # engine setting: pre-aggregate before the shuffle where exact
    #: Per source queue, the max offset when this query started. A batch may be
    #: pre-combined only from there on: anything below may have been sent, cut
    #: short, by a run that crashed, with other batch boundaries; per-record
    #: origins de-duplicate against any such prefix, combined ones do not.
    combine_from: tuple[tuple[int, int], ...] = ()
    #: Every queue id of the source topic: each one holds the watermark of a
    #: stateful stage until it has spoken or idled (slow queues stay on time).
    source_queues: tuple[int, ...] = ()
    #: Queues a batch of this query run has already processed. A queue's first
    #: batch (not the query's: that one can be empty, or cover other queues)
    #: checks local state against the state topic.
    seen_queues: frozenset[int] = frozenset()
    generation: int = 0
    #: Seconds a task retries while the broker is unreachable (runtime/outage.py).
    broker_outage_s: float = 0.0

    def may_combine(self, queue_id: int, start: int) -> bool:
        """Whether the batch of ``queue_id`` starting at ``start`` may be pre-combined."""
        return self.pre_combine and start >= dict(self.combine_from).get(queue_id, 2**63)

    def client_settings(self) -> RocketMQSettings:
        """Client settings: environment (credentials) plus this job's name server."""
        return RocketMQSettings(namesrv_addr=self.namesrv_addr)

    def producer(self) -> Producer:
        """This worker process's producer."""
        return producer_for(self.client_settings())

    def input_queue(self, queue_id: int) -> MessageQueue:
        """The stage's input queue ``queue_id``."""
        return MessageQueue(self.stage.input_topic, self.broker_name, queue_id)

    @property
    def state_root(self) -> Path:
        """Root of the RocksDB state of this job."""
        return Path(self.state_dir)

    def dead_letter(self, stats: TaskStats, record: Record, op_id: str, exc: BaseException) -> None:
        """Send a record that failed in ``op_id`` to the dead-letter topic, with the reason."""
        reason = _property(f"{type(exc).__name__}: {exc}")
        self.producer().send(
            self.dead_letter_topic,
            record.body,
            key=f"{record.topic}/{record.queue_id}/{record.queue_offset}",
            properties={
                "reason": reason,
                "operator": op_id,
                "source_topic": record.topic,
                "source_queue": str(record.queue_id),
                "source_offset": str(record.queue_offset),
            },
        )
        stats.dead_letters += 1


@dataclass
class TaskStats:
    """Per-queue, per-batch figures a task reports back to the driver."""

    stage: int = 0
    queue_id: int = 0
    end_offset: int = 0
    records_in: int = 0
    outputs: int = 0
    shuffle_messages: int = 0
    shuffle_records: int = 0  # entries sent: records, or pre-combined partials
    dead_letters: int = 0
    late: int = 0
    skipped_duplicates: int = 0
    fired: int = 0
    state_keys: int = 0
    state_bytes: int = 0
    restored_keys: int = 0
    watermark: int = -1
    seconds: float = 0.0
    started: float = field(default_factory=time.monotonic, repr=False)

    def to_batch(self) -> pa.RecordBatch:
        """One Arrow row for mapInArrow's output."""
        self.seconds = time.monotonic() - self.started
        row = {k: v for k, v in asdict(self).items() if k != "started"}
        return pa.RecordBatch.from_pylist([row], schema=STATS_ARROW_SCHEMA)


_STATS_TYPES = {int: ("long", pa.int64()), float: ("double", pa.float64())}
_STAT_FIELDS = [f for f in fields(TaskStats) if f.name != "started"]
STATS_ARROW_SCHEMA = pa.schema(
    [(f.name, _STATS_TYPES[float if f.type == "float" else int][1]) for f in _STAT_FIELDS]
)
#: The same schema as a Spark DDL string.
STATS_DDL = ", ".join(
    f"{f.name} {_STATS_TYPES[float if f.type == 'float' else int][0]}" for f in _STAT_FIELDS
)


def _property(text: str) -> str:
    # Property values cannot hold RocketMQ's separators (\x01, \x02).
    clean = text.replace("\x01", " ").replace("\x02", " ")
    return clean[:_PROPERTY_MAX]


def rows_of(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """The rows of an Arrow batch as dicts."""
    return batch.to_pylist()  # type: ignore[no-any-return]
