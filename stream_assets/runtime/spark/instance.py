"""A compute instance: one SparkSession, one streaming query for all its stages.

The query reads every stage's input topic through the ``rocketmq`` source (a
row per stage queue range, grouped into about one Spark task per slot) and
hands every micro-batch to ``mapInArrow``, so a Spark task processes each of
its queues in offset order (:mod:`~stream_assets.runtime.spark.task`) and
returns a stats row per queue. One query, not one per stage: a micro-batch is
one Spark job, and its fixed cost (planning, scheduling, the source's runner
process) is paid once for all stages (``EngineSettings.query_per_stage``
gives each stage its own query instead).
What a task needs travels in its pickled context, and the topology's own
modules are shipped to the executors (:mod:`~stream_assets.runtime.drive.user_code`),
so the same instance runs on ``local[*]`` or on a cluster.
Spark's checkpoint is fresh on every start: positions come from the broker's
committed consumer offsets and from the state itself, which is what lets a
queue move to another instance.

Example::

    >>> inst = Instance(wordcount.build(), rocketmq=rocketmq, engine=engine)  # doctest: +SKIP
    >>> inst.start(); inst.await_caught_up(timeout_s=120); inst.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from stream_assets.plan.topology import Stage, Topology, origin_id
from stream_assets.rocketmq.acl import check_topology_credentials
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.rocketmq.provision import provision_topics, upgrade_topology
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.runtime.core.context import STATS_DDL, StageContext
from stream_assets.runtime.drive.broker_watch import BrokerWatch, Outages
from stream_assets.runtime.drive.offset_commits import OffsetCommits
from stream_assets.runtime.drive.outage import TRANSIENT, OutagePolicy, ride_out_outage
from stream_assets.runtime.drive.planning import StageOptions, combine_bounds, encode_stages
from stream_assets.runtime.drive.prometheus import (
    MetricsEndpointError,
    PrometheusExporter,
    endpoint_port,
)
from stream_assets.runtime.drive.queues import TaskContext
from stream_assets.runtime.drive.sink_checks import SinkChecks, start_sink_checks
from stream_assets.runtime.drive.store_handles import release_job_stores
from stream_assets.runtime.drive.user_code import ship_user_code
from stream_assets.runtime.drive.warm_up import warm_queues
from stream_assets.runtime.spark.class_archive import archive_path as class_archive_path
from stream_assets.runtime.spark.class_archive import with_archive
from stream_assets.runtime.spark.query_errors import failure_message
from stream_assets.runtime.spark.query_restart import RestartBudget, restartable
from stream_assets.runtime.spark.real_time import RealTimeQuery, RealTimeSetup
from stream_assets.runtime.spark.source import RocketMQDataSource
from stream_assets.runtime.spark.spark_logging import quiet_spark_conf
from stream_assets.runtime.spark.task import task_fn
from stream_assets.runtime.spark.worker_launcher import worker_python
from stream_assets.settings import EngineSettings, RocketMQSettings, local_dir

Progress = Callable[[str], None]


@dataclass
class StageMetrics:
    """Running totals of one stage, summed over its tasks."""

    batches: int = 0
    #: Queue tasks run (one per queue per batch).
    tasks: int = 0
    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    last_batch_at: float = 0.0
    #: Wall seconds of the slowest micro-batch so far (tasks, commit, bookkeeping).
    max_batch_s: float = 0.0
    watermark: int = -1
    #: Latest (keys, bytes) of each stateful queue's RocksDB.
    state: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: Digests of the client settings tasks reported using (one: the instance's own).
    settings_digests: set[str] = field(default_factory=set)


def _register_source(spark: Any) -> None:
    """Register the ``rocketmq`` source once per session.

    Registering again replaces it, with a warning each start. Spark's registry has
    no public lookup; if this one moves, register as before.
    """
    from py4j.protocol import Py4JError

    try:
        manager = spark._jsparkSession.sessionState().dataSourceManager()
        registered = bool(manager.dataSourceExists(RocketMQDataSource.name()))
    except Py4JError:
        registered = False
    if not registered:
        spark.dataSource.register(RocketMQDataSource)


def _quiet(spark: Any, logger: str, message: str | None = None) -> None:
    """Only errors from ``logger``; with ``message`` (a regex matching a whole message),
    only those messages are dropped and the rest of what ``logger`` says stays.

    Idempotent: every instance start of a process calls it on the same JVM.
    """
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j
    if message is None:
        log4j.core.config.Configurator.setLevel(logger, log4j.Level.ERROR)
        return
    context = log4j.LogManager.getContext(False)
    config = context.getConfiguration()
    logger_config = config.getLoggerConfig(logger)
    if logger_config.getName() != logger:  # inherited from a parent: give it its own
        logger_config = log4j.core.config.LoggerConfig(logger, None, True)
        config.addLogger(logger, logger_config)
    present = logger_config.getFilter()
    if present is not None and message in present.toString():
        return
    result = getattr(log4j.core, "Filter$Result")
    drop = log4j.core.filter.RegexFilter.createFilter(
        message, None, False, result.DENY, result.NEUTRAL
    )
    logger_config.addFilter(drop)
    context.updateLoggers()


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Step(Protocol):
    """A long step under way, as :data:`Busy` yields it: ``say`` tells how far it got."""

    def say(self, text: str) -> None:
        """Replace the step's detail (``warmed ...[3]: 120 keys``), keeping its start."""


class _Unwatched:
    def say(self, text: str) -> None:
        pass


#: Wraps a long step with what it does: ``with busy("starting ...") as step: ...``.
Busy = Callable[[str], AbstractContextManager[Step]]


def _unwatched(_what: str) -> AbstractContextManager[Step]:
    return nullcontext(_Unwatched())


class Instance:
    """Runs a topology's stages over the queues assigned to this instance."""

    def __init__(
        self,
        topology: Topology,
        group: str | None = None,
        *,
        rocketmq: RocketMQSettings,
        engine: EngineSettings,
        assignment: dict[str, list[int]] | None = None,
        generation: int = 0,
        progress: Progress = _print,
        busy: Busy = _unwatched,
        index: int = 0,
    ) -> None:
        #: Which instance of the topology this is: its metrics label and endpoint port.
        self.index = index
        self.group = group or topology.job_id
        # The caller's settings (its entry point read the environment): the engine reads none.
        self.rocketmq = rocketmq
        self.engine = engine
        self.assignment = assignment
        self.generation = generation
        self.progress = progress
        #: Wraps each long step (a query start, a release, a warm-up) so that the
        #: instance run's heartbeat says what it is busy with and since when:
        #: under load one query start can take a minute and more.
        self.busy = busy
        self._adopt(topology)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        #: The running queries, one per entry of ``_query_stages`` (while running).
        self._queries: list[Any] = []
        self._restarts = [RestartBudget() for _ in self._query_stages]
        self._checkpoints = local_dir() / "checkpoints" / topology.job_id / uuid.uuid4().hex[:8]
        self._spark: Any = None
        #: Every source, shuffle and state topic's layout (queue index -> broker, id).
        self._layouts: dict[str, TopicLayout] = {}
        #: The group's offsets as this instance commits them (waiting ones, lost ones).
        self.offsets = OffsetCommits(lambda: self._admin, self.group, progress)
        # One control-plane client for the instance's life: offsets are
        # committed after every batch and lag is polled often.
        self._admin_obj: RocketMQAdmin | None = None
        #: Answers the broker's checks of exactly-once sink messages (None: no such sink).
        self._sink_checks: SinkChecks | None = None
        self._source_queues: dict[str, tuple[int, ...]] = {}
        #: Who commits state: recorded with every changelog write of this instance.
        self.writer = f"{topology.job_id}:g{generation}:{uuid.uuid4().hex[:12]}"
        self._broker_watch = BrokerWatch(self._probe_master)
        #: How every step of this instance waits for an unreachable broker (settings).
        self.outage_policy = OutagePolicy(
            engine.broker_outage_s, engine.broker_backoff_max_s, rocketmq.status_command
        )

    def _adopt(self, topology: Topology) -> None:
        """Run ``topology``: as built, then as the job's record names its topics."""
        self.topology = topology
        self.metrics: dict[int, StageMetrics] = {s.index: StageMetrics() for s in topology.stages}
        #: The same numbers for Prometheus, per queue: fed where ``metrics`` is (:meth:`_record`).
        self.prometheus = PrometheusExporter(topology, self.index, self.generation)
        #: The stages each Spark query runs: all in one, or one query per stage.
        # Real-time mode runs every stage at once whatever query_per_stage says: no stage's
        # batch waits for another's there.
        per_stage = self.engine.query_per_stage and self.engine.mode == "micro-batch"
        self._query_stages: list[tuple[Stage, ...]] = (
            [(s,) for s in topology.stages] if per_stage else [topology.stages]
        )

    @property
    def _admin(self) -> RocketMQAdmin:
        if self._admin_obj is None:
            self._admin_obj = RocketMQAdmin(self.rocketmq)
        return self._admin_obj

    # -- topics ------------------------------------------------------------

    def upgrade(self) -> None:
        """Compare the topology with what the job ran last: carry its state over under the
        topics it had, or raise :class:`~stream_assets.plan.upgrade.UpgradeRefusedError`
        saying what changed and what to do (:mod:`~stream_assets.plan.upgrade`)."""
        plan = upgrade_topology(self._admin, self.topology, self.progress)
        self._adopt(plan.topology)

    def prepare_topics(self) -> None:
        """Check the source exists; create shuffle, state, sink, dead-letter topics if missing."""
        topics = provision_topics(self._admin, self.topology, self.engine, self.progress)
        self._layouts = topics.layouts
        self._source_queues = topics.source_queues

    # -- lifecycle ---------------------------------------------------------

    def _session(self) -> Any:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = self._get_or_create(self._spark_conf())
        if self.engine.worker_preconnect:
            # Before the data source is registered: its Python workers (the source runner
            # among them, which Spark gives 10 s to connect back) run what it captures.
            spark.sparkContext.pythonExec = worker_python(spark.sparkContext.pythonExec)
        spark.sparkContext.setLogLevel("WARN")
        # Repeats on every slow batch; the instance reports batch durations itself
        # (StageMetrics.max_batch_s).
        _quiet(spark, "org.apache.spark.sql.execution.streaming.runtime.ProcessingTimeExecutor")
        # Every query stop logs it twice when no job of the query runs, the normal case
        # between micro-batches; any other DAGScheduler warning still shows.
        _quiet(spark, "org.apache.spark.scheduler.DAGScheduler", "Failed to cancel job group .*")
        if self.engine.mode == "micro-batch":
            # Registering starts Spark's Python planner processes (~1 CPU-second on a
            # cold start); the real-time mode plans in its own tasks.
            _register_source(spark)
        return spark

    def _spark_conf(self) -> dict[str, str]:
        # Quiet: no console progress bars, known harmless Java stack traces folded
        # (the run's log is this process's stderr).
        conf = quiet_spark_conf(
            {
                "spark.master": self.engine.spark_master,
                "spark.app.name": f"stream-assets-{self.topology.job_id}",
                "spark.ui.enabled": "false",
                "spark.sql.shuffle.partitions": "2",
                "spark.python.worker.reuse": "true",
                "spark.sql.streaming.stopTimeout": "60s",
                # Streaming queries cannot use it; left on, Spark warns once per query.
                "spark.sql.adaptive.enabled": "false",
                "spark.driver.memory": self.engine.driver_memory,
                **self.engine.spark_conf,
            }
        )
        if self.engine.jvm_class_archive:
            conf = with_archive(conf, class_archive_path())
        return conf

    def _get_or_create(self, conf: dict[str, str]) -> Any:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
        if spark is None:
            builder = SparkSession.builder
            for key, value in conf.items():
                builder = builder.config(key, value)
            return builder.getOrCreate()
        # Another instance of this process started it. The builder would log "Using an
        # existing Spark session" on every start; static settings (master, memory)
        # cannot change on it anyway, runtime SQL ones are set as the builder would.
        for key, value in conf.items():
            if spark.conf.isModifiable(key):
                spark.conf.set(key, value)
        if spark.sparkContext.master != self.engine.spark_master:
            self.progress(
                f"reusing this process's SparkSession on {spark.sparkContext.master}; "
                f"spark_master {self.engine.spark_master} needs a new process"
            )
        return spark

    def start(self, run_queries: bool = True) -> None:
        """Create missing topics, start the SparkSession, the query and the
        Prometheus endpoint (:meth:`serve_metrics`).

        ``run_queries=False`` only warms up (topics, SparkSession, shipped code):
        an instance that takes queues over later, with :meth:`reassign`.
        """
        self.upgrade()
        self.check_credentials()
        self.prepare_topics()
        if self._sink_checks is None:
            self._sink_checks = start_sink_checks(
                self.topology, self.rocketmq, self._admin, self.group
            )
        self._spark = self._session()
        shipped = ship_user_code(self._spark.sparkContext, self.topology)
        if shipped:
            self.progress(f"shipping topology modules to the executors: {', '.join(shipped)}")
        self._write_settings_file()
        try:
            if run_queries:
                self._start_queries()
        except BaseException:
            # Also Dagster's interrupt: the settings file (credentials) never outlives a start.
            for query in self._queries:
                query.stop()
            self._queries.clear()
            shutil.rmtree(self._checkpoints, ignore_errors=True)
            raise
        self.serve_metrics()

    def serve_metrics(self) -> str | None:
        """Start this instance's Prometheus endpoint (:meth:`start` does); its URL, or None.

        The port is the topology's base port plus :attr:`index`
        (:func:`~stream_assets.runtime.drive.prometheus.endpoint_port`). A port that
        cannot be had is logged with what to set, and the instance runs on
        without the endpoint: losing its metrics must not stop the data.
        """
        if self.prometheus.url is not None:
            return self.prometheus.url
        try:
            port = endpoint_port(self.engine, self.topology.job_id, self.index)
            if port is None:
                return None
            url = self.prometheus.serve(self.engine.metrics_host, port)
        except MetricsEndpointError as exc:
            self.progress(f"warning: {exc}")
            return None
        self.progress(f"Prometheus metrics of {self.topology.job_id} instance {self.index}: {url}")
        return url

    @property
    def metrics_url(self) -> str | None:
        """Where this instance's Prometheus metrics are served (None: not served)."""
        return self.prometheus.url

    def check_credentials(self) -> None:
        """Fail fast, before Spark starts, if the brokers refuse this instance's user.

        Raises :class:`~stream_assets.rocketmq.errors.CredentialsRefusedError`
        naming the user, the operation and the settings to fix.
        """
        check_topology_credentials(self._admin, self.topology, self.group)

    def _start_queries(self) -> None:
        self._stopping.clear()
        for position in range(len(self._query_stages)):
            self._queries.append(self._start_query_retrying(position))
        queries = "one query" if len(self._queries) == 1 else f"{len(self._queries)} queries"
        self.progress(
            f"instance of {self.topology.job_id} (generation {self.generation}) running "
            f"{len(self.topology.stages)} stages in {queries} on {self.engine.spark_master}"
        )

    def last_batch_at(self) -> float:
        """When a micro-batch last completed (epoch s; 0: none yet)."""
        return max((m.last_batch_at for m in self.metrics.values()), default=0.0)

    @property
    def running(self) -> bool:
        """Whether the queries run (not between a release and a takeover)."""
        return bool(self._queries)

    def warm_up(self, gained: dict[str, list[int]]) -> int:
        """Bring the local state of queues this instance is about to gain up to date.

        Only where the state root is known here (``engine.state_dir``); with
        executor-local state, the first batch on each executor does it.
        Returns the number of stores that caught up or restored.
        """
        if not self.engine.state_dir:
            return 0
        pairs = [(topic, q) for topic, queues in sorted(gained.items()) for q in queues]
        reader = QueueReader(self._admin, f"{self.group}-warm")
        try:
            with self.busy(f"warming up the stores of {len(pairs)} queues") as step:

                def progress(line: str) -> None:
                    self.progress(line)
                    step.say(line)  # the scale job shows it while it waits

                done = warm_queues(
                    self.topology, pairs, self.engine.state_dir, self._admin, reader, progress
                )
        finally:
            reader.close()
        return len(done)

    def reassign(self, assignment: dict[str, list[int]], generation: int) -> None:
        """Take a new assignment in place (RemoveSplit + NewSplit), keeping the SparkSession.

        The batch in flight finishes (its checkpoint), the queries stop and this
        process's stores are handed back; then the queries start again over
        the new queues, as the new generation (which fences the old owners).
        """
        if self._queries:
            self.stop_queries()
        self.assignment = assignment
        self.generation = generation
        with self._lock:
            # Stores handed back are another instance's now: their size is no longer ours.
            for stage in self.topology.stages:
                kept = self._queues_of(stage.input_topic)
                state = self.metrics[stage.index].state
                if kept is not None:
                    for queue in set(state) - set(kept):
                        del state[queue]
            self.prometheus.reassigned(generation, assignment)
        self.writer = f"{self.topology.job_id}:g{generation}:{uuid.uuid4().hex[:12]}"
        self._start_queries()

    @property
    def _settings_file(self) -> str:
        return str(self._checkpoints / "client-settings.json")

    def _write_settings_file(self) -> None:
        """The client settings for the source's planner (Spark options show up in logs).

        Readable by this user only; removed when the instance stops.
        """
        self._checkpoints.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self._settings_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.rocketmq.revealed_json())

    def _queues_of(self, topic: str) -> list[int] | None:
        return None if self.assignment is None else sorted(self.assignment.get(topic, []))

    def _stage_options(self, stage: Stage) -> StageOptions:
        """What the source reads for ``stage``: its queues, ticks and origins."""
        queues = self._queues_of(stage.input_topic)
        read_topics = [
            stage.input_topic,
            *(self.topology.stages[u].input_topic for u in stage.upstreams),
        ]
        opts = StageOptions(
            topic=stage.input_topic,
            queues=None if queues is None else tuple(queues),
            planned_group=self._planned_group if stage.source is not None and stage.exits else None,
            layouts={t: self._layouts[t] for t in read_topics},
        )
        head = stage.head
        if head is None or not head.waits_for_time:
            return opts
        # What waits for the watermark can fire when input stops (idle timeout):
        # give the stage a batch now and then, and let the planner judge the
        # origins' idleness by their offsets.
        return dataclasses.replace(
            opts,
            tick_ms=min(self.engine.tick_ms, max(100, head.idle_timeout_ms // 2)),
            origin_topics=tuple(
                (self.topology.stages[up].input_topic, origin_id(up, 0)) for up in stage.upstreams
            ),
            idle_timeout_ms=head.idle_timeout_ms,
        )

    def _task_context(self, stage: Stage) -> TaskContext:
        """What every task of ``stage`` gets, pickled: its plan, the engine numbers, the client."""
        return TaskContext(
            stage=StageContext.of(
                self.topology,
                stage.index,
                shuffle_queues=self.engine.shuffle_queues,
                snapshot_every=self.engine.snapshot_every,
                pre_combine=self.engine.pre_combine,
                combine_from=self._combine_from(stage) if stage.source is not None else (),
                source_queues=self._source_queues,
                generation=self.generation,
                writer=self.writer,
                max_message_size=self.rocketmq.max_message_size,
            ),
            rocketmq=self.rocketmq,
            group=self.group,
            layouts={
                t: self._layouts[t]
                for t in (stage.input_topic, stage.state_topic, *(e.topic for e in stage.exits))
                if t is not None
            },
            state_dir=str(self.engine.state_dir) if self.engine.state_dir else None,
            outage=self.outage_policy,
        )

    def _start_query(self, stages: tuple[Stage, ...]) -> Any:
        if self.engine.mode == "real-time":
            return self._start_real_time(stages)
        reader = (
            self._spark.readStream.format("rocketmq")
            .option("stages", encode_stages({s.index: self._stage_options(s) for s in stages}))
            .option("group", self.group)
            .option("settings_file", self._settings_file)
            .option("max_records_per_batch", str(self.engine.max_records_per_batch))
            .option("outage", self.outage_policy.encode())
            .option("partitions", str(self._spark.sparkContext.defaultParallelism))
        )
        contexts = {s.index: self._task_context(s) for s in stages}
        name = "-".join(str(s.index) for s in stages)
        # A fresh checkpoint per start: a restarted query must not resume from the
        # previous assignment's offsets (positions come from the broker).
        checkpoint = self._checkpoints / f"query-{name}-{uuid.uuid4().hex[:8]}"
        return (
            reader.load()
            .writeStream.foreachBatch(self._batch_fn(stages, contexts))
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime=f"{self.engine.trigger_interval_ms} milliseconds")
            .queryName(f"{self.topology.job_id}-stages-{name}-{uuid.uuid4().hex[:6]}")
            .start()
        )

    def _start_real_time(self, stages: tuple[Stage, ...]) -> RealTimeQuery:
        """The real-time mode's stand-in for a query (:mod:`.real_time`)."""
        setup = RealTimeSetup(
            group=self.group,
            planned_group=self._planned_group,
            interval_s=self.engine.interval_ms / 1000,
            step_max_records=self.engine.step_max_records,
            idle_poll_s=self.engine.idle_poll_ms / 1000,
            held_send_bytes=self.engine.held_send_bytes,
            outage=self.outage_policy,
            tasks=self.engine.real_time_tasks,
            on_rows=self._steps_done,
            admin=lambda: self._admin,
            progress=self.progress,
        )
        name = f"{self.topology.job_id}-real-time-{uuid.uuid4().hex[:6]}"
        return RealTimeQuery(
            self._spark,
            name,
            {s.index: self._task_context(s) for s in stages},
            {s.index: self._stage_options(s) for s in stages},
            setup,
        ).start()

    def _steps_done(self, rows: list[dict[str, Any]]) -> None:
        """One real-time step's rows, as they arrive: commit, then count (as a batch's)."""
        self._commit_riding_out(rows, "")
        for stage in sorted({int(r["stage"]) for r in rows}):
            mine = [r for r in rows if int(r["stage"]) == stage]
            self._record(stage, mine, max(float(r["seconds"]) for r in mine))

    @property
    def _planned_group(self) -> str:
        """The group whose offsets are the ends of stage 0's batches, stored as planned."""
        return f"{self.group}-planned"

    def _combine_from(self, stage: Stage) -> tuple[tuple[int, int], ...]:
        """Per source queue, the offset from which stage 0 may pre-combine
        (:func:`~stream_assets.runtime.drive.planning.combine_bounds`)."""
        topic = stage.input_topic
        return combine_bounds(
            self._admin, topic, self._layouts[topic], self.group, self._planned_group
        )

    def _batch_fn(
        self, stages: tuple[Stage, ...], contexts: dict[int, TaskContext]
    ) -> Callable[[Any, int], None]:
        what = _stages_named(stages)

        def run_batch(df: Any, batch_id: int) -> None:
            if self._stopping.is_set():
                # Skipped, not failed: nothing runs and nothing is committed to the
                # broker, whose offsets are the only ones a later start reads (this
                # query's Spark checkpoint is thrown away), so the batch runs again
                # then. Raising instead would log a Spark stack trace on every stop.
                return
            began = time.monotonic()
            try:
                rows = [r.asDict() for r in df.mapInArrow(task_fn(contexts), STATS_DDL).collect()]
            except Exception:
                if self._stopping.is_set():
                    # Cancelled by our own stop (its wait for the batch ran out): skipped
                    # as above. Raised, Spark matches the long Python traceback with a
                    # regex that overflows its thread's stack, and prints ~1 000 frames.
                    return
                raise
            self._commit_riding_out(rows, what)
            seconds = time.monotonic() - began
            for stage in stages:
                self._record(stage.index, [r for r in rows if r["stage"] == stage.index], seconds)

        return run_batch

    def _commit_riding_out(self, rows: list[dict[str, Any]], what: str) -> None:
        """:meth:`_commit`, retried while the broker is unreachable (``what``: the stages)."""
        ride_out_outage(
            lambda: self._commit(rows),
            policy=self.outage_policy,
            what=" ".join(filter(None, [self.topology.job_id, what])) + ": offset commit",
            log=self.progress,
        )

    def _commit(self, rows: list[dict[str, Any]]) -> None:
        """Store each queue's batch end as the group's offset: the work is durable now
        (a real-time step's held messages keep it where they began, ``held_from``).

        Spark's own source commit would come only when the next batch is
        planned, i.e. never for the last batch before a quiet period. A broker
        group whose master is down (its slave still serves reads) cannot store
        offsets: they wait, and go with the first commit after it is back; a
        start in between replays from the older offset, which the shuffle's
        de-duplication and the sinks' deterministic keys absorb.
        """
        stages = self.topology.stages
        self.offsets.commit(
            {
                self._layouts[stages[int(row["stage"])].input_topic].queue(
                    int(row["queue_id"])
                ): _commit_offset(row)
                for row in rows
            }
        )

    def commit_waiting(self) -> int:
        """Commit the offsets a broker group could not store when their batch ended
        (nothing else commits them while no new input arrives); returns how many
        still wait."""
        return self.offsets.commit_waiting()

    def _record(self, stage: int, rows: list[dict[str, Any]], seconds: float) -> None:
        with self._lock:
            m = self.metrics[stage]
            m.batches += 1
            m.max_batch_s = max(m.max_batch_s, seconds)
            m.last_batch_at = time.time()
            m.tasks += len(rows)
            for row in rows:
                m.settings_digests.add(str(row.pop("settings_digest", "")))
                if row.get("state_keys") or row.get("state_bytes"):
                    m.state[int(row["queue_id"])] = (
                        int(row["state_keys"]),
                        int(row["state_bytes"]),
                    )
                for key, value in row.items():
                    if key in (
                        "stage",
                        "queue_id",
                        "end_offset",
                        "held_from",
                        "watermark",
                        "state_keys",
                        "state_bytes",
                    ):
                        continue
                    m.totals[key] += value
                m.watermark = max(m.watermark, int(row.get("watermark", -1)))
            # Under the same lock, from the same rows: Prometheus and the Dagster
            # observations (which read ``metrics``) never count different batches.
            self.prometheus.record_batch(stage, rows, seconds)

    def lag_by_queue(self) -> dict[str, dict[int, int]]:
        """Messages not yet committed, per stage input topic and assigned queue."""
        out: dict[str, dict[int, int]] = {}
        admin = self._admin
        for stage in self.topology.stages:
            layout = self._layouts.get(stage.input_topic) or TopicLayout.of(
                admin.queues(stage.input_topic)
            )
            wanted = self._queues_of(stage.input_topic)
            indices = range(len(layout)) if wanted is None else wanted
            queues = [layout.queue(i) for i in indices]
            # Committed offsets before the ends: the lag may overstate, never understate,
            # so 0 means everything the queue held was committed.
            committed = self.offsets.group_offsets(stage.input_topic, queues)
            ranges = admin.topic_offsets(stage.input_topic, queues)
            per_queue: dict[int, int] = {}
            for q in queues:
                floor = committed[q]
                if floor is None:
                    floor = ranges[q].min_offset
                per_queue[layout.index(q)] = max(0, ranges[q].max_offset - floor)
            out[stage.input_topic] = per_queue
        self.prometheus.record_lag(out)
        return out

    def broker_outages(self) -> Outages:
        """The broker groups this instance uses that have no master answering, since
        when, and what changed since the last look (:mod:`.broker_watch`)."""
        one_queue: dict[str, MessageQueue] = {}
        # The stages' inputs (source and shuffle topics): what this instance's group reads
        # and commits, so asking its offset there needs no grant it lacks; state and sink
        # queues are spread over the same groups.
        inputs = {stage.input_topic for stage in self.topology.stages}
        for topic, layout in self._layouts.items():
            if topic not in inputs:
                continue
            for index in range(len(layout)):
                queue = layout.queue(index)
                one_queue.setdefault(queue.broker_name, queue)
        return self._broker_watch.look(one_queue)

    def _probe_master(self, queue: MessageQueue) -> None:
        self._admin.group_offsets(self.group, queue.topic, [queue], from_master=True)

    def lag(self) -> dict[str, int]:
        """Messages not yet committed, per stage input topic (over assigned queues)."""
        return {topic: sum(q.values()) for topic, q in self.lag_by_queue().items()}

    def state_size(self) -> tuple[int, int]:
        """Keys and bytes of the RocksDB state this instance last reported, all queues."""
        with self._lock:
            sizes = [v for m in self.metrics.values() for v in m.state.values()]
        return sum(k for k, _ in sizes), sum(b for _, b in sizes)

    def check_failed(self) -> None:
        """Raise if a query died (with Spark's error).

        A query that died only because Spark's Python worker did not start in
        time (a busy machine) is started again instead, within a budget
        (:mod:`~stream_assets.runtime.spark.query_restart`).
        """
        if self._stopping.is_set():
            return
        for position, query in enumerate(self._queries):
            exc = query.exception()
            if exc is None:
                continue
            if restartable(exc) and self._restart_allowed(position, exc):
                query.stop()
                self._queries[position] = self._start_query_retrying(position)
                continue
            raise RuntimeError(f"query {query.name} failed: {failure_message(exc)}") from None

    def _start_query_retrying(self, position: int) -> Any:
        """:meth:`_start_query`, again while Spark's Python worker fails to start in time.

        Starting a query runs the data source's planner in a new Python worker,
        under the same 10 s connect-back limit as the query's own runner.
        """
        stages = self._query_stages[position]
        attempt = 0
        while True:
            attempt += 1
            again = f" (attempt {attempt})" if attempt > 1 else ""
            try:
                with self.busy(f"starting the query of {_stages_named(stages)}{again}"):
                    return self._start_query(stages)
            except Exception as exc:  # Py4J and Spark errors have no common base here
                if not (restartable(exc) and self._restart_allowed(position, exc)):
                    raise

    def _restart_allowed(self, position: int, exc: object) -> bool:
        """Take one restart of query ``position`` from its budget, saying why."""
        if not self._restarts[position].allow(time.monotonic()):
            return False
        stages = self._query_stages[position]
        for stage in stages:
            self.prometheus.record_restart(stage.index)
        first_line = (str(exc).strip().splitlines() or [""])[0]
        self.progress(
            f"{_stages_named(stages)}: Spark's Python worker did not start in time "
            f"({first_line}); starting the query again"
        )
        return True

    def await_caught_up(self, timeout_s: float, poll_s: float = 0.5) -> dict[str, int]:
        """Wait until every stage has committed everything currently in its input."""
        deadline = time.monotonic() + timeout_s
        quiet_rounds = 0
        while True:
            self.check_failed()
            try:
                self.commit_waiting()
                lag: dict[str, int] = self.lag()
            except TRANSIENT as exc:  # a restarting broker: not caught up yet
                lag = {f"unknown ({exc})": 1}
            # Stage 0 may have just sent to the shuffle: zero twice in a row.
            quiet_rounds = quiet_rounds + 1 if all(v == 0 for v in lag.values()) else 0
            if quiet_rounds == 2:
                return lag
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.topology.job_id}: still lagging after {timeout_s}s: {lag}"
                )
            time.sleep(poll_s)

    def stop_sources(self) -> None:
        """Stop reading the source topics and go on reading this instance's shuffle queues:
        the first step of a drain (the batch in flight finishes first)."""
        keyed: dict[str, list[int]] = {}
        for stage in self.topology.stages:
            queues = self._queues_of(stage.input_topic)
            if stage.source is not None:
                keyed[stage.input_topic] = []
            else:
                every = list(range(len(self._layouts[stage.input_topic])))
                keyed[stage.input_topic] = every if queues is None else queues
        self.reassign(keyed, self.generation)

    def shuffle_backlog(self) -> int:
        """Messages of the topology's shuffle topics its group has not committed, over every
        queue (every instance's), as the broker has them now."""
        admin, backlog = self._admin, 0
        for topic in self.topology.shuffle_topics:
            layout = self._layouts.get(topic) or TopicLayout.of(admin.queues(topic))
            queues = [layout.queue(i) for i in range(len(layout))]
            committed = admin.group_offsets(self.group, topic, queues)
            ranges = admin.topic_offsets(topic, queues)
            for q in queues:
                floor = committed[q]
                backlog += max(
                    0, ranges[q].max_offset - (ranges[q].min_offset if floor is None else floor)
                )
        return backlog

    def await_shuffles_consumed(
        self,
        timeout_s: float,
        others_stopped: Callable[[], bool] = lambda: True,
        poll_s: float = 0.5,
    ) -> int:
        """After :meth:`stop_sources`: wait until ``others_stopped()`` (no instance of the
        topology reads a source any more) and every shuffle topic is consumed, twice in a
        row; returns what is left unread (0, or the backlog when ``timeout_s`` ran out:
        it stays in the shuffle topics for the next start)."""
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while True:
            self.check_failed()
            try:
                self.commit_waiting()
                backlog = self.shuffle_backlog()
            except TRANSIENT:  # a restarting broker: not drained yet
                backlog = -1
            quiet = quiet + 1 if backlog == 0 and others_stopped() else 0
            if quiet == 2 or time.monotonic() > deadline:
                return max(backlog, 0) if quiet == 2 else max(backlog, 1)
            time.sleep(poll_s)

    def stop_queries(self, timeout_s: float = 120.0) -> None:
        """Finish the batch in flight, then stop the queries (final checkpoint)."""
        with self.busy("finishing the batch in flight and stopping the queries"):
            self._stop_queries(timeout_s)

    def _stop_queries(self, timeout_s: float) -> None:
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for query in self._queries:
            while (
                query.isActive
                and query.status.get("isTriggerActive")
                and (time.monotonic() < deadline)
            ):
                time.sleep(0.05)
            query.stop()
        self._queries.clear()
        try:
            left = self.commit_waiting()
            self.offsets.forget()
        except TRANSIENT as exc:
            left = self.offsets.waiting
            self.progress(f"offsets still waiting at the stop: {exc}")
        if left:
            # Not lost: the next start replays from the older offsets (de-duplicated).
            self.progress(f"{left} queues' offsets could not be committed at the stop")
        if self.engine.state_dir:
            # Python workers keep stores open between batches (and outlive the
            # queries while the SparkSession stays): hand them back, so the
            # queues' next owner, a restore or a wipe can have them.
            release_job_stores(self.engine.state_dir, self.topology.job_id)
        for path in self._checkpoints.glob("query-*"):
            shutil.rmtree(path, ignore_errors=True)

    def stop(self, timeout_s: float = 120.0) -> None:
        """Finish the batch in flight, then stop (final checkpoint)."""
        self.stop_queries(timeout_s)
        # After the last batch counted; frees the port for this process's next instance.
        self.prometheus.close()
        shutil.rmtree(self._checkpoints, ignore_errors=True)
        self.progress(f"instance of {self.topology.job_id} stopped")

    def close(self) -> None:
        """Stop the queries and the SparkSession."""
        if self._queries:
            self.stop()
        # A warm-up instance (no queries) wrote the settings file too.
        shutil.rmtree(self._checkpoints, ignore_errors=True)
        self.prometheus.close()
        if self._sink_checks is not None:
            self._sink_checks.close()
            self._sink_checks = None
        if self._admin_obj is not None:
            self._admin_obj.close()
            self._admin_obj = None
        if self._spark is not None:
            self._spark.stop()
            self._spark = None


def _commit_offset(row: dict[str, Any]) -> int:
    """A stats row's offset to commit: its end, or where its held messages began."""
    held = int(row.get("held_from", -1))
    return held if held >= 0 else int(row["end_offset"])


def _stages_named(stages: tuple[Stage, ...]) -> str:
    """``stage 0`` or ``stages 0, 1``: how logs and heartbeats name a query.

    >>> _stages_named(())
    'no stage'
    """
    if not stages:
        return "no stage"
    if len(stages) == 1:
        return f"stage {stages[0].index}"
    return "stages " + ", ".join(str(s.index) for s in stages)
