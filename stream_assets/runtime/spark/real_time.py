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
from collections.abc import Callable
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
        self._thread.start()
        return self

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
            while not self._stopping.is_set():
                plans = self._plans(self._setup.tasks or max(1, sc.defaultParallelism))
                if not plans:  # no queue assigned: nothing to run until the next change
                    self._stopping.wait()
                    break
                sc.setJobGroup(self._job_group, f"{self.name}: an interval", False)
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

    def _plans(self, slots: int) -> list[IntervalPlan]:
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
                    interval_s=self._setup.interval_s,
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


def _queues(opts: StageOptions) -> tuple[int, ...]:
    if opts.queues is not None:
        return opts.queues
    return tuple(range(len(opts.layouts[opts.topic])))
