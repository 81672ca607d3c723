"""The real-time mode on Spark: an instance's stages as long-running tasks, an interval a job.

Spark's own Real-time Mode refuses Python sources and Python operators
(docs/notes/real-time-mode.md), so the instance runs its own: one Spark job
per interval (``EngineSettings.interval_ms``) whose tasks, as many as the
cluster has task slots, each take a share of every stage's queues and run
:func:`~stream_assets.runtime.drive.interval.run_interval` on them. All
stages run at once, so a keyed stage reads what stage 0 shuffled moments
after it was sent. The job is a checkpoint interval, not a unit of latency:
tasks commit every step through the instance (:mod:`~stream_assets.runtime.drive.channel`),
and the next interval deals the queues again from where the last one ended
(an executor that joined gets work; one that left loses none).

:class:`RealTimeQuery` looks to :class:`~stream_assets.runtime.spark.instance.Instance`
like the Structured Streaming query it runs in micro-batch mode (``stop``,
``exception``, ``isActive``, ``status``, ``name``), so stop, rebalance,
failure and restart handling are the instance's, unchanged. A stop reaches
every task at once and waits for its step in flight, not for its interval.

Example::

    >>> query = RealTimeQuery(spark, "wc-stages-0-1", contexts, options, setup)  # doctest: +SKIP
    >>> query.start(); ...; query.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import uuid
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.runtime.drive.channel import ChannelServer
from stream_assets.runtime.drive.interval import PLANNED, IntervalPlan, run_interval
from stream_assets.runtime.drive.outage import OutagePolicy
from stream_assets.runtime.drive.planning import StageOptions, StagePlanner, position_key
from stream_assets.runtime.drive.queues import TaskContext


@dataclass(frozen=True)
class RealTimeSetup:
    """What every interval of an instance's real-time query shares."""

    group: str
    planned_group: str
    interval_s: float
    step_max_records: int
    idle_poll_s: float
    #: Bytes a task may hold for a broker group without a master (held_sends.py).
    held_send_bytes: int
    outage: OutagePolicy
    #: Tasks per interval (0: the application's task slots).
    tasks: int
    #: Each step's stats rows, on the channel's thread (commit, then count).
    on_rows: Callable[[list[dict[str, Any]]], None]
    admin: Callable[[], RocketMQAdmin]
    #: Where a line for the user goes (the instance's progress).
    progress: Callable[[str], None] = print


#: While an application's task slots cannot hold a task of every real-time query it
#: runs, the queries take turns in intervals this short: a query waits for a slot at
#: most about this long instead of a whole interval.
TURN_INTERVAL_S = 2.0


def task_share(slots: int, queries: int, tasks: int = 0) -> tuple[int, bool]:
    """How many long-running tasks one of ``queries`` real-time queries of one Spark
    application runs per interval (``tasks``: the setting, 0 for a fair share of the
    ``slots``), and whether the queries must take turns for slots.

    A long-running task holds its slot for the whole interval, so queries that each
    took every slot would run one at a time, an interval each.

    >>> task_share(slots=8, queries=1)
    (8, False)
    >>> task_share(slots=8, queries=3)
    (2, False)
    >>> task_share(slots=2, queries=3)
    (1, True)
    >>> task_share(slots=4, queries=2, tasks=3)
    (3, True)
    """
    share = tasks or max(1, slots // max(1, queries))
    return share, share * queries > slots


class _Sharing:
    """The real-time queries running on each Spark application of this process.

    Registering or leaving deals every other query's queues anew at its next step
    (:meth:`RealTimeQuery.redeal`): a newcomer gets slots within a step, not an
    interval, and the rest grow back when one stops.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queries: dict[int, list[RealTimeQuery]] = {}

    def join(self, app: int, query: RealTimeQuery) -> None:
        with self._lock:
            others = list(self._queries.get(app, []))
            self._queries.setdefault(app, []).append(query)
        for other in others:
            other.redeal()

    def leave(self, app: int, query: RealTimeQuery) -> None:
        with self._lock:
            mine = self._queries.get(app, [])
            if query not in mine:
                return
            mine.remove(query)
            others = list(mine)
        for other in others:
            other.redeal()

    def count(self, app: int) -> int:
        with self._lock:
            return max(1, len(self._queries.get(app, [])))


_SHARING = _Sharing()


def _print_text(text: str) -> None:
    # stdout gone (a pipe whose reader left): the text is lost, the data is not.
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.write(text)
        sys.stdout.flush()


class RealTimeQuery:
    """Runs intervals until stopped; shaped like a Structured Streaming query."""

    def __init__(
        self,
        spark: Any,
        name: str,
        contexts: dict[int, TaskContext],
        options: dict[int, StageOptions],
        setup: RealTimeSetup,
    ) -> None:
        self.name = name
        self._spark = spark
        self._contexts, self._options, self._setup = contexts, options, setup
        self._job_group = f"{name}-{uuid.uuid4().hex[:8]}"
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._positions: dict[int, dict[str, Any]] = {}
        self._server: ChannelServer | None = None
        self._thread = threading.Thread(target=self._run, name=f"real-time {name}", daemon=True)
        #: Held while an interval's tasks are told to run or to stop, so that a stop
        #: cannot fall between the two (its tasks would run their whole interval).
        self._lock = threading.Lock()
        self._app = 0  # the Spark application, once started (see _SHARING)
        self._taking_turns = False
        #: Structured Streaming's query status, as :meth:`Instance._stop_queries` reads it:
        #: a stop never waits for an interval to end, the tasks end it.
        self.status = {"isTriggerActive": False}

    def start(self) -> RealTimeQuery:
        """Plan the first positions (the group's committed offsets) and run."""
        for index, opts in self._options.items():
            planner = StagePlanner(
                index,
                opts,
                self._setup.group,
                self._setup.admin,
                self._setup.outage,
            )
            self._positions[index] = planner.initial()
        host = self._spark.sparkContext.getConf().get("spark.driver.host", "127.0.0.1")
        self._server = ChannelServer(host, self._setup.on_rows, _print_text)
        self._app = id(self._spark.sparkContext)
        _SHARING.join(self._app, self)
        self._thread.start()
        return self

    def redeal(self) -> None:
        """End this interval after each task's step in flight and deal the queues anew
        (another query of this application started or stopped)."""
        with self._lock:
            if self._server is not None and not self._stopping.is_set():
                self._server.request_stop()

    @property
    def isActive(self) -> bool:
        return self._thread.is_alive()

    def exception(self) -> BaseException | None:
        """Why the query stopped by itself (a job failed, a commit failed), else None."""
        if self._server is not None and self._server.error is not None:
            return self._server.error
        return self._error

    def stop(self, timeout_s: float = 120.0) -> None:
        """Every task ends after its step in flight; the interval's job then ends."""
        with self._lock:
            self._stopping.set()
            if self._server is not None:
                self._server.request_stop()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            self._spark.sparkContext.cancelJobGroup(self._job_group)
            self._thread.join(timeout=30)
        if self._server is not None:
            self._server.close()

    def _run(self) -> None:
        sc = self._spark.sparkContext
        try:
            while True:
                with self._lock:
                    if self._stopping.is_set():
                        break
                    assert self._server is not None
                    self._server.resume()  # an interval ended early by a redeal
                slots = task_slots(sc)
                plans = self._plans(*self._share(slots))
                if not plans:  # no queue assigned: nothing to run until the next change
                    self._stopping.wait()
                    break
                sc.setJobGroup(self._job_group, f"{self.name}: an interval", False)
                with watch_interval(lambda: self._shape(sc), (slots, 0), self.redeal):
                    ends = sc.parallelize(plans, len(plans)).map(run_interval).collect()
                for end in ends:
                    for index, at in end.items():
                        merged = self._positions[index]
                        merged["q"] = {**merged["q"], **at["q"]}
                        merged["tick"] = max(int(merged.get("tick", 0)), int(at.get("tick", 0)))
                        planned = merged.setdefault(PLANNED, {})
                        for key, end in at.get(PLANNED, {}).items():
                            planned[key] = max(int(end), int(planned.get(key, -1)))
        except BaseException as exc:
            if not self._stopping.is_set():
                self._error = exc
        finally:
            _SHARING.leave(self._app, self)

    def _shape(self, sc: Any) -> tuple[int, int]:
        """The application's task slots, and how many tasks of this query's running
        interval failed (each one Spark runs again, once a slot is free)."""
        tracker = sc.statusTracker()
        active = set(tracker.getActiveJobsIds())
        failed = 0
        for job_id in tracker.getJobIdsForGroup(self._job_group):
            job = tracker.getJobInfo(job_id) if job_id in active else None
            for stage_id in job.stageIds if job is not None else ():
                stage = tracker.getStageInfo(stage_id)
                failed += stage.numFailedTasks if stage is not None else 0
        return task_slots(sc), failed

    def _share(self, slots: int) -> tuple[int, float]:
        """This interval's tasks and length, beside the application's other queries."""
        queries = _SHARING.count(self._app)
        tasks, turns = task_share(slots, queries, self._setup.tasks)
        if turns and not self._taking_turns:
            self._setup.progress(
                f"warning: {queries} real-time instances share this Spark application's "
                f"{slots} task slots, and each of their long-running tasks holds one for "
                f"an interval: they take turns in {TURN_INTERVAL_S:.0f}-second intervals, "
                "so results can wait that long. Give the application more slots (e.g. "
                "spark_master 'local[N]', spark.cores.max) or run those instances in "
                "micro-batch mode."
            )
        self._taking_turns = turns
        interval_s = self._setup.interval_s
        return tasks, min(interval_s, TURN_INTERVAL_S) if turns else interval_s

    def _plans(self, slots: int, interval_s: float) -> list[IntervalPlan]:
        """Every stage's queues dealt over at most ``slots`` tasks, stages interleaved."""
        pairs = [
            (index, queue)
            for index, opts in sorted(self._options.items())
            for queue in _queues(opts)
        ]
        count = min(slots, len(pairs))
        # Dealt round-robin in stage order, one count running on across stages: each
        # task gets queues of every stage that has as many queues as there are tasks.
        shares: list[dict[int, list[int]]] = [{} for _ in range(count)]
        for n, (index, queue) in enumerate(pairs):
            shares[n % count].setdefault(index, []).append(queue)
        assert self._server is not None
        plans = []
        for mine in shares:
            options = {
                i: dataclasses.replace(self._options[i], queues=tuple(qs)) for i, qs in mine.items()
            }
            plans.append(
                IntervalPlan(
                    contexts={i: self._contexts[i] for i in mine},
                    options=options,
                    positions={i: self._own_positions(i, options[i]) for i in mine},
                    group=self._setup.group,
                    planned_group=self._setup.planned_group,
                    interval_s=interval_s,
                    step_max_records=self._setup.step_max_records,
                    idle_poll_s=self._setup.idle_poll_s,
                    held_send_bytes=self._setup.held_send_bytes,
                    channel=(self._server.address, self._server.token),
                )
            )
        return plans

    def _own_positions(self, index: int, opts: StageOptions) -> dict[str, Any]:
        layout = opts.layouts[opts.topic]
        at = self._positions[index]
        keys = {position_key(layout.queue(q)) for q in _queues(opts)}
        return {**at, "q": {k: v for k, v in at["q"].items() if k in keys}}


def task_slots(sc: Any) -> int:
    """The tasks the application's executors can run at once now, at least 1.

    Spark's own count (``SparkContext.maxNumConcurrentTasks``, which a lost executor
    lowers at once), not ``defaultParallelism``: on a cluster that one is never under
    2, so on two one-core workers with one lost the plan kept two tasks for one slot,
    and the second task's queues waited for a whole interval. Where that count is out
    of reach (another Spark), ``defaultParallelism``.
    """
    try:
        jvm = sc._jsc.sc()
        count = jvm.maxNumConcurrentTasks(jvm.resourceProfileManager().defaultResourceProfile())
    except Exception:  # py4j: a Spark without the method
        count = sc.defaultParallelism
    return max(1, int(count))


#: How often the driver looks at an interval's shape (task slots, failed tasks).
WATCH_EVERY_S = 1.0


@contextlib.contextmanager
def watch_interval(
    read: Callable[[], Hashable],
    planned: Hashable,
    on_change: Callable[[], None],
    every_s: float = WATCH_EVERY_S,
) -> Iterator[None]:
    """While the block runs, call ``on_change`` once if ``read()`` moves away from
    ``planned``: the application's task slots the interval was dealt for, and none of
    its tasks failed.

    An executor that joined gets queues within a second, not at the interval's end.
    One that left, or a task that failed, frees every slot after the steps in flight,
    so the task Spark runs again finds a slot at once instead of waiting for the
    interval's end (a lost worker's queues paused for up to an interval).

    >>> changed = threading.Event()
    >>> shapes = iter([(4, 0), (4, 0), (4, 1)])
    >>> with watch_interval(lambda: next(shapes, (4, 1)), (4, 0), changed.set, every_s=0.01):
    ...     changed.wait(10)
    True
    """
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every_s):
            try:
                now = read()
            except Exception:  # the context is stopping: the interval ends anyway
                return
            if now != planned:
                on_change()
                return

    watcher = threading.Thread(target=watch, name="real-time interval watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _queues(opts: StageOptions) -> tuple[int, ...]:
    if opts.queues is not None:
        return opts.queues
    return tuple(range(len(opts.layouts[opts.topic])))
