"""``rocketmq``: a streaming source on PySpark's Python Data Source API.

One Spark input partition per message queue, offsets per queue, and a bound on
records per micro-batch (``ReadMaxRows``, PySpark >= 4.2). The start position
of every queue is the consumer group's committed offset on the broker (its min
offset if the group never committed); the consumer of a batch commits its end
once the batch's work is durable: the broker, not a Spark
checkpoint, is the authority, so a queue can move to another instance.

Two row shapes (option ``rows``):

- ``messages`` (default): one row per message (queue_id, queue_offset, body,
  keys, tags, born_ts, store_ts) for ad-hoc use.
- ``ranges``: one row per queue (queue_id, start, end) and the engine's task
  pulls the messages itself, which saves two JVM round trips per record
  (docs/engine.md). Every assigned queue gets its row, even with no new
  messages, so stateful stages see idle ticks (option ``tick_ms``).

Example::

    >>> spark.dataSource.register(RocketMQDataSource)  # doctest: +SKIP
    >>> df = (spark.readStream.format("rocketmq").option("topic", "orders")
    ...       .option("group", "g").load())  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.runtime.outage import ride_out_outage
from stream_assets.settings import RocketMQSettings

T = TypeVar("T")

MESSAGE_SCHEMA = StructType(
    [
        StructField("queue_id", IntegerType()),
        StructField("queue_offset", LongType()),
        StructField("body", BinaryType()),
        StructField("keys", ArrayType(StringType())),
        StructField("tags", StringType()),
        StructField("born_ts", LongType()),
        StructField("store_ts", LongType()),
    ]
)
RANGE_SCHEMA = StructType(
    [
        StructField("queue_id", IntegerType()),
        StructField("start", LongType()),
        StructField("end", LongType()),
    ]
)


@dataclass(frozen=True)
class QueueRange(InputPartition):
    """One queue's slice of a micro-batch."""

    topic: str
    broker_name: str
    queue_id: int
    start: int
    end: int


@dataclass(frozen=True)
class SourceOptions:
    """The source's options, parsed and checked once."""

    topic: str
    group: str
    namesrv_addr: str
    queues: tuple[int, ...] | None
    rows: str
    max_records_per_batch: int
    tick_ms: int
    broker_outage_s: float

    @classmethod
    def parse(cls, options: dict[str, str]) -> SourceOptions:
        """Parse Spark's string options, raising a clear error for a bad one."""
        for required in ("topic", "group"):
            if not options.get(required):
                raise ValueError(f"rocketmq source: option {required!r} is required")
        rows = options.get("rows", "messages")
        if rows not in ("messages", "ranges"):
            raise ValueError(f"rocketmq source: option rows must be messages|ranges, got {rows!r}")
        queues = options.get("queues")
        return cls(
            topic=options["topic"],
            group=options["group"],
            namesrv_addr=options.get("namesrv_addr") or RocketMQSettings().namesrv_addr,
            # "" is an assignment of no queues (an idle instance), not "all queues".
            queues=tuple(int(q) for q in queues.split(",") if q) if queues is not None else None,
            rows=rows,
            max_records_per_batch=int(options.get("max_records_per_batch", "100000")),
            tick_ms=int(options.get("tick_ms", "0")),
            broker_outage_s=float(options.get("broker_outage_s", "0")),
        )

    def settings(self) -> RocketMQSettings:
        """Client settings: the environment's, with this source's name server."""
        return RocketMQSettings(namesrv_addr=self.namesrv_addr)


class RocketMQDataSource(DataSource):
    """The ``rocketmq`` format."""

    @classmethod
    def name(cls) -> str:
        return "rocketmq"

    def schema(self) -> StructType:
        return RANGE_SCHEMA if self.options.get("rows") == "ranges" else MESSAGE_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return RocketMQStreamReader(SourceOptions.parse(dict(self.options)))


class RocketMQStreamReader(DataSourceStreamReader):
    """Plans micro-batches over the assigned queues; runs in the driver's Python."""

    def __init__(self, options: SourceOptions) -> None:
        self.opts = options
        self._admin_obj: RocketMQAdmin | None = None
        # Spark may create this reader late (a query's first batch), even while
        # the broker restarts: every broker call here rides out an outage.
        route_queues = self._ride(lambda: self._admin.queues(options.topic), "queues")
        wanted = set(options.queues) if options.queues is not None else None
        self._queues = [q for q in route_queues if wanted is None or q.queue_id in wanted]
        if wanted is not None and len(self._queues) != len(wanted):
            missing = sorted(wanted - {q.queue_id for q in self._queues})
            raise ValueError(f"rocketmq source: topic {options.topic!r} has no queues {missing}")

    @property
    def _admin(self) -> RocketMQAdmin:
        # Created lazily and never pickled: Spark ships this reader (for read())
        # to executors, and sockets do not pickle.
        if self._admin_obj is None:
            self._admin_obj = RocketMQAdmin(self.opts.settings())
        return self._admin_obj

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_admin_obj": None}

    def _ride(self, step: Callable[[], T], what: str) -> T:
        return ride_out_outage(
            step, budget_s=self.opts.broker_outage_s, what=f"source {self.opts.topic}: {what}"
        )

    def _key(self, queue: MessageQueue) -> str:
        return f"{queue.broker_name}:{queue.queue_id}"

    def initialOffset(self) -> dict[str, Any]:
        def start_offsets() -> dict[str, int]:
            offsets: dict[str, int] = {}
            for queue in self._queues:
                committed = self._admin.query_consumer_offset(self.opts.group, queue)
                offsets[self._key(queue)] = (
                    committed if committed is not None else self._admin.min_offset(queue)
                )
            return offsets

        return {"q": self._ride(start_offsets, "start offsets"), "tick": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.opts.max_records_per_batch)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin: dict[str, int] = start["q"]
        available = self._ride(
            lambda: {self._key(q): self._admin.max_offset(q) for q in self._queues},
            "latest offsets",
        )
        budget = None if isinstance(limit, ReadAllAvailable) else getattr(limit, "max_rows", None)
        end = _cap(begin, available, budget)
        tick = int(start.get("tick", 0))
        if self.opts.tick_ms > 0:
            tick = max(tick, int(time.time() * 1000) // self.opts.tick_ms)
        return {"q": end, "tick": tick}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[QueueRange]:
        ticked = end.get("tick", 0) != start.get("tick", 0)
        parts = []
        for queue in self._queues:
            key = self._key(queue)
            lo, hi = int(start["q"].get(key, 0)), int(end["q"][key])
            if hi > lo or (ticked and self.opts.rows == "ranges"):
                parts.append(QueueRange(queue.topic, queue.broker_name, queue.queue_id, lo, hi))
        return parts

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, QueueRange)
        if self.opts.rows == "ranges":
            yield (partition.queue_id, partition.start, partition.end)
            return
        from stream_assets.runtime.clients import reader_for

        queue = MessageQueue(partition.topic, partition.broker_name, partition.queue_id)
        reader = reader_for(self.opts.settings(), self.opts.group)
        for r in reader.read(queue, partition.start, partition.end):
            yield (
                r.queue_id,
                r.queue_offset,
                r.body,
                list(r.keys),
                r.tags,
                r.born_timestamp,
                r.store_timestamp,
            )

    def commit(self, end: dict[str, Any]) -> None:
        # Offsets are committed by whoever consumes the batch, once its work is
        # durable (Instance._commit); Spark calls this only when it plans the
        # *next* batch, which may never come.
        return None

    def stop(self) -> None:
        self._admin.close()


def _cap(begin: dict[str, int], available: dict[str, int], budget: int | None) -> dict[str, int]:
    """End offsets: all that is available, or at most ``budget`` records shared fairly.

    Fair share: every queue with a backlog gets an equal slice; slices a queue
    cannot use go to the others, so one busy queue does not starve.
    """
    backlog = {k: max(0, available[k] - begin.get(k, available[k])) for k in available}
    if budget is None or sum(backlog.values()) <= budget:
        return {k: begin.get(k, available[k]) + backlog[k] for k in available}
    take = dict.fromkeys(available, 0)
    left = budget
    pending = [k for k in available if backlog[k] > 0]
    while left > 0 and pending:
        share = max(1, left // len(pending))
        for k in list(pending):
            step = min(share, backlog[k] - take[k], left)
            take[k] += step
            left -= step
            if take[k] >= backlog[k]:
                pending.remove(k)
            if left == 0:
                break
    return {k: begin.get(k, available[k]) + take[k] for k in available}
