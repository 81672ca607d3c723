"""``rocketmq``: a streaming source on PySpark's Python Data Source API.

One source reads every stage of an instance (option ``stages``): one Spark
query, so one micro-batch is one Spark job for all stages and the fixed cost
of a batch (planning, scheduling, a runner process) is paid once, not once per
stage. Offsets per stage and queue, and a bound on records per micro-batch and
stage (``ReadMaxRows``, PySpark >= 4.2). The start position
of every queue is the consumer group's committed offset on the broker (its min
offset if the group never committed); the consumer of a batch commits its end
once the batch's work is durable: the broker, not a Spark checkpoint, is the
authority, so a queue can move to another instance.

A row is a stage queue's ``[start, end)`` range, not a message: the engine's task
pulls the messages itself, which saves two JVM round trips per record
(docs/engine.md). Every assigned queue gets its row on a tick (a stage's
``tick_ms``) even with no new messages, so stateful stages can fire windows
when input stops.

What a stage reads next (idleness, ticks, planned ends, a budget's fair share)
is :class:`~stream_assets.runtime.drive.planning.StagePlanner`'s, shared with the
real-time mode; idle origins are listed in each row's ``idle`` column.

Client settings come from a file the driver writes (option ``settings_file``,
private to the driver's user), never from Spark options, which show up in
plans and logs, and never from the environment of the process Spark plans in.

Example::

    >>> spark.dataSource.register(RocketMQDataSource)  # doctest: +SKIP
    >>> stages = encode_stages({0: StageOptions(topic="orders")})
    >>> df = (spark.readStream.format("rocketmq").option("stages", stages)
    ...       .option("group", "g").option("settings_file", path).load())  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import ArrayType, IntegerType, LongType, StructField, StructType

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.runtime.drive.outage import FAIL_AT_ONCE, OutagePolicy
from stream_assets.runtime.drive.planning import (
    QueueRange,
    StageOptions,
    StagePlanner,
    encode_stages,
)
from stream_assets.settings import RocketMQSettings

__all__ = ["RocketMQDataSource", "encode_stages", "group_ranges"]

RANGE_SCHEMA = StructType(
    [
        StructField("stage", IntegerType()),
        StructField("queue_id", IntegerType()),
        StructField("start", LongType()),
        StructField("end", LongType()),
        StructField("idle", ArrayType(IntegerType())),
    ]
)


@dataclass(frozen=True)
class QueueRanges(InputPartition):
    """Several queues' slices, run one after another by one Spark task.

    A Spark task costs tens of milliseconds however little it does (scheduling,
    a Python worker handshake, Arrow setup); at one task per queue that was
    most of a small micro-batch. Grouping into about as many tasks as there
    are task slots keeps every slot busy at a fraction of the cost.
    """

    ranges: tuple[QueueRange, ...]


@dataclass(frozen=True)
class SourceOptions:
    """The source's options, parsed and checked once."""

    group: str
    settings_file: str
    stages: dict[int, StageOptions]
    #: Per stage: at most this many records per micro-batch.
    max_records_per_batch: int = 100_000
    outage: OutagePolicy = FAIL_AT_ONCE
    #: At most this many Spark tasks per micro-batch (0: one per queue).
    partitions: int = 0

    @classmethod
    def parse(cls, options: dict[str, str]) -> SourceOptions:
        """Parse Spark's string options, raising a clear error for a bad one."""
        for required in ("stages", "group", "settings_file"):
            if not options.get(required):
                raise ValueError(f"rocketmq source: option {required!r} is required")
        try:
            stages = {
                int(index): StageOptions.from_json(data)
                for index, data in json.loads(options["stages"]).items()
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"rocketmq source: option 'stages' must be what encode_stages() writes ({exc!r})"
            ) from exc
        if not stages:
            raise ValueError("rocketmq source: option 'stages' names no stage")
        return cls(
            group=options["group"],
            settings_file=options["settings_file"],
            stages=stages,
            max_records_per_batch=int(options.get("max_records_per_batch", "100000")),
            outage=OutagePolicy.decode(options["outage"])
            if options.get("outage")
            else FAIL_AT_ONCE,
            partitions=int(options.get("partitions", "0")),
        )

    def settings(self) -> RocketMQSettings:
        """The client settings the driver wrote for this query."""
        try:
            text = Path(self.settings_file).read_text()
        except OSError as exc:
            raise ValueError(
                f"rocketmq source: cannot read the client settings file {self.settings_file} "
                f"the instance wrote ({exc}); the instance must run on this machine"
            ) from exc
        return RocketMQSettings.from_revealed_json(text)


class RocketMQDataSource(DataSource):
    """The ``rocketmq`` format."""

    @classmethod
    def name(cls) -> str:
        return "rocketmq"

    def schema(self) -> StructType:
        return RANGE_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return RocketMQStreamReader(SourceOptions.parse(dict(self.options)))


class RocketMQStreamReader(DataSourceStreamReader):
    """Plans micro-batches over every stage's assigned queues; runs in the driver's Python.

    An offset is one :class:`StagePlanner` offset per stage, keyed by the
    stage index (as a string: Spark keeps offsets as JSON).
    """

    def __init__(self, options: SourceOptions) -> None:
        self.opts = options
        self._settings = options.settings()
        self._admin_obj: RocketMQAdmin | None = None
        self._planners = {
            index: StagePlanner(index, stage, options.group, self._get_admin, options.outage)
            for index, stage in sorted(options.stages.items())
        }

    def _get_admin(self) -> RocketMQAdmin:
        # Created lazily and never pickled: sockets do not pickle.
        if self._admin_obj is None:
            self._admin_obj = RocketMQAdmin(self._settings)
        return self._admin_obj

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_admin_obj": None}

    def initialOffset(self) -> dict[str, Any]:
        return {str(i): planner.initial() for i, planner in self._planners.items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.opts.max_records_per_batch)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        budget = None if isinstance(limit, ReadAllAvailable) else getattr(limit, "max_rows", None)
        return {str(i): p.latest(start[str(i)], budget) for i, p in self._planners.items()}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[QueueRanges]:
        ranges = [
            r for i, p in self._planners.items() for r in p.ranges(start[str(i)], end[str(i)])
        ]
        return group_ranges(ranges, self.opts.partitions)

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, QueueRanges)
        for r in partition.ranges:
            yield (r.stage, r.queue_id, r.start, r.end, list(r.idle))

    def commit(self, end: dict[str, Any]) -> None:
        # Offsets are committed by whoever consumes the batch, once its work is
        # durable (Instance._commit); Spark calls this only when it plans the
        # *next* batch, which may never come.
        return None

    def stop(self) -> None:
        if self._admin_obj is not None:
            self._admin_obj.close()


def group_ranges(ranges: list[QueueRange], tasks: int) -> list[QueueRanges]:
    """At most ``tasks`` partitions (0: one per range) holding every range once.

    Largest ranges first, dealt round-robin, so the tasks get similar work.

    >>> parts = group_ranges([QueueRange(q, 0, n) for q, n in enumerate([5, 90, 40, 10])], 2)
    >>> [[r.queue_id for r in p.ranges] for p in parts]
    [[1, 3], [2, 0]]
    """
    ordered = sorted(ranges, key=lambda r: r.end - r.start, reverse=True)
    count = min(len(ordered), tasks or len(ordered))
    return [QueueRanges(tuple(ordered[i::count])) for i in range(count)]
