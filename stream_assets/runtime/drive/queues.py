"""One step of one queue, as every driver runs it: what it needs, and the call.

Everything a task needs travels in the pickled :class:`TaskContext`: the plan
of its stage, the engine numbers, and the whole client configuration
(credentials as ``SecretStr``). Nothing here reads the executor's environment
for settings. The one thing a task takes from the machine it runs on is
*where its local disk is* (Spark's local directory), because the state of a
queue must be on the machine that runs it.

A stateful queue's step runs :func:`~stream_assets.runtime.core.keyed.attempt.run_stateful_batch`
(a source queue whose stage has exactly-once sinks, its twin
:func:`~stream_assets.runtime.core.stage0.exactly_once.run_positioned_source_batch`),
which first proves the local RocksDB current against the state topic (one
offset query). A queue may run on any executor, so a queue that moved, or
whose executor fell behind another's writes, restores from the state topic
(latest snapshot + tail) before it applies anything. The changelog's
compare-and-append then guarantees that no two executors or instances ever
both extend a queue's history.

Spark-free: the micro-batch adapter (:func:`stream_assets.runtime.spark.task.task_fn`)
and a real-time task (:mod:`stream_assets.runtime.drive.interval`) both call
:func:`run_range`.

Example::

    >>> stats = run_range(ctx, QueueRange(3, 120, 180, stage=1), lines)  # doctest: +SKIP
    >>> stats.records_in  # doctest: +SKIP
    60
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from stream_assets.plan.names import sink_transaction_group
from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.batch_producer import BatchProducer
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.rocketmq.tags import TagFilter
from stream_assets.rocketmq.transactions import TransactionalSender
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.core.keyed.attempt import QueuePorts, run_stateful_batch
from stream_assets.runtime.core.send_buffer import SendBuffer, Transport
from stream_assets.runtime.core.stage0.exactly_once import run_positioned_source_batch
from stream_assets.runtime.core.stage0.stateless import run_source_batch, run_source_batches
from stream_assets.runtime.drive.clients import admin_for, producer_for, reader_for
from stream_assets.runtime.drive.outage import FAIL_AT_ONCE, OutagePolicy, ride_out_outage
from stream_assets.runtime.drive.planning import QueueRange
from stream_assets.runtime.drive.printing import Lines, run_printing
from stream_assets.runtime.drive.store_handles import HANDLES
from stream_assets.settings import RocketMQSettings

#: Spark's per-application directories under a configured local dir.
_SPARK_APP_DIR = re.compile(r"^(blockmgr|spark|executor)-[0-9a-f-]{8,}$")


@dataclass(frozen=True)
class TaskContext:
    """A stage context plus what a Spark task needs to reach the broker and its disk."""

    stage: StageContext
    rocketmq: RocketMQSettings
    group: str
    #: The stage's input, state and shuffle topics' layouts: queue index -> (broker, id).
    layouts: dict[str, TopicLayout]
    #: None: the executor's own local directory (see :func:`executor_state_root`).
    state_dir: str | None = None
    #: How a task waits while the broker is unreachable (runtime/drive/outage.py).
    outage: OutagePolicy = FAIL_AT_ONCE

    def input_queue(self, queue_id: int) -> MessageQueue:
        """The stage's input queue of index ``queue_id``."""
        return self.layouts[self.stage.stage.input_topic].queue(queue_id)

    def state_queue(self, queue_id: int) -> MessageQueue:
        """The state topic's queue paired with input queue ``queue_id`` (same index)."""
        assert self.stage.stage.state_topic is not None
        return self.layouts[self.stage.stage.state_topic].queue(queue_id)

    def producer(self) -> BatchProducer:
        """This process's producer, sending by the stage's layouts."""
        producer = producer_for(self.rocketmq)
        producer.pin(self.layouts.values())
        return producer

    def state_root(self) -> Path:
        """Where this task keeps RocksDB state: the configured dir, else executor-local."""
        return Path(self.state_dir) if self.state_dir else executor_state_root()


def executor_state_root() -> Path:
    """``stream-assets-state`` under this executor's configured Spark local directory.

    Spark hands a Python worker its per-application block-manager directory in
    ``SPARK_LOCAL_DIRS``; the state goes beside the application directories
    (in the directory the worker was configured with), so it outlives one
    application and a restarted instance on the same machine need not restore.
    """
    first = (os.environ.get("SPARK_LOCAL_DIRS") or tempfile.gettempdir()).split(",")[0]
    root = Path(first)
    while _SPARK_APP_DIR.match(root.name):
        root = root.parent
    return root / "stream-assets-state"


def run_stateless_queue(
    ctx: TaskContext, queue_id: int, start: int, end: int, transport: Transport | None = None
) -> TaskStats:
    """Process offsets ``start`` .. ``end`` of source queue ``queue_id``, sending
    through ``transport`` (default: the producer, every send waited for)."""
    settings = ctx.rocketmq
    source = ctx.stage.stage.source
    tags = TagFilter.parse(None if source is None else source.tags)
    records = reader_for(settings, ctx.group).read(ctx.input_queue(queue_id), start, end, tags)
    sender = SendBuffer(transport or ctx.producer())
    stats = run_source_batch(ctx.stage, queue_id, start, end, records, sender)
    stats.settings_digest = settings.digest()
    return stats


def run_source_queues(
    ctx: TaskContext, ranges: list[QueueRange], lines: Lines | None, transport: Transport
) -> list[TaskStats]:
    """Several ranges of a stateless source stage as one step (a real-time task's), their
    pre-combined partials merged across the queues where they can be
    (:func:`~stream_assets.runtime.core.stage0.stateless.run_source_batches`); riding out
    a broker outage, with what it prints added to ``lines``. The stats per range."""
    settings = ctx.rocketmq
    source = ctx.stage.stage.source
    tags = TagFilter.parse(None if source is None else source.tags)

    def step() -> list[TaskStats]:
        reader = reader_for(settings, ctx.group)
        parts = (
            (
                r.queue_id,
                r.start,
                r.end,
                reader.read(ctx.input_queue(r.queue_id), r.start, r.end, tags),
            )
            for r in ranges
        )
        stats = run_source_batches(ctx.stage, parts, SendBuffer(transport))
        digest = settings.digest()
        for one in stats:
            one.settings_digest = digest
        return stats

    queues = ",".join(str(r.queue_id) for r in ranges)
    done: list[TaskStats] = ride_out_outage(
        partial(run_printing, step, lines),
        policy=ctx.outage,
        what=f"{ctx.stage.job_id} stage {ctx.stage.stage.index} queues {queues}",
    )
    return done


def run_stateful_queue(
    ctx: TaskContext, queue_id: int, start: int, end: int, idle: tuple[int, ...]
) -> TaskStats:
    """One batch of a stateful queue (:func:`.attempt.run_stateful_batch`):
    its store on this executor's disk, kept open between batches by the Python worker.

    >>> run_stateful_queue(ctx, 3, 120, 180, idle=()).restores  # doctest: +SKIP
    0
    """
    stats = run_stateful_batch(ctx.stage, queue_id, start, end, _queue_ports(ctx, queue_id), idle)
    stats.settings_digest = ctx.rocketmq.digest()
    return stats


def run_positioned_source_queue(ctx: TaskContext, queue_id: int, start: int, end: int) -> TaskStats:
    """One step of a source queue whose stage has exactly-once sinks
    (:func:`.exactly_once.run_positioned_source_batch`): its position in a store on this
    executor's disk, as a stateful queue's state."""
    source = ctx.stage.stage.source
    assert source is not None
    tags = TagFilter.parse(source.tags)
    stats = run_positioned_source_batch(
        ctx.stage, queue_id, start, end, _queue_ports(ctx, queue_id), tags
    )
    stats.settings_digest = ctx.rocketmq.digest()
    return stats


def _queue_ports(ctx: TaskContext, queue_id: int) -> QueuePorts:
    """What a step of a queue with a state topic runs against: the store named after the
    stage's head (its source for a positioned stage), the broker's clients."""
    stage = ctx.stage.stage
    head = stage.head or stage.source
    assert head is not None and stage.state_topic is not None
    settings = ctx.rocketmq
    producer = ctx.producer()
    return QueuePorts(
        store=partial(HANDLES.use, ctx.state_root(), ctx.stage.job_id, head.op_id, queue_id),
        admin=admin_for(settings),
        reader=reader_for(settings, ctx.group),
        # The queues from the context (no route lookup): one offset query when current.
        state_queue=ctx.state_queue(queue_id),
        input_queue=ctx.input_queue(queue_id),
        sender=lambda tx: SendBuffer(producer, transaction=tx),
        sink_port=(
            TransactionalSender(producer, sink_transaction_group(ctx.stage.job_id))
            if stage.exactly_once_topics
            else None
        ),
    )


def run_range(
    ctx: TaskContext, r: QueueRange, lines: Lines | None, transport: Transport | None = None
) -> TaskStats:
    """Offsets ``r.start`` .. ``r.end`` of ``r``'s queue, riding out a broker outage,
    with what it prints added to ``lines``; a source stage's sends go through
    ``transport`` where given (a real-time task's held sends), except a positioned
    stage's: its sends must all be stored before its delta.

    A queue's step commits all or nothing: repeating it is a replay. Captured
    per attempt: only the attempt that succeeded reaches ``lines``.
    """
    if ctx.stage.stage.stateful:
        step = partial(run_stateful_queue, ctx, r.queue_id, r.start, r.end, r.idle)
    elif ctx.stage.stage.positioned:
        step = partial(run_positioned_source_queue, ctx, r.queue_id, r.start, r.end)
    else:
        step = partial(run_stateless_queue, ctx, r.queue_id, r.start, r.end, transport)
    stats: TaskStats = ride_out_outage(
        partial(run_printing, step, lines),
        policy=ctx.outage,
        what=f"{ctx.stage.job_id} stage {ctx.stage.stage.index} queue {r.queue_id}",
    )
    return stats
