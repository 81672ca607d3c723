"""An instance run's heartbeat: beaten by its own thread, so work can never starve it.

Two questions the supervisor asks of a live run, answered separately:

- **is the process alive and not wedged?** The heartbeat thread beats every
  ``heartbeat_interval_s`` whatever the run loop is doing. A beat older than
  the supervisor's ``heartbeat_timeout_s`` means the process cannot run
  Python at all (frozen, stopped, wedged): hung.
- **is the run making progress?** Every beat also carries when the run loop
  last went round (``loop_at``), what it is busy with if it is in a long step
  (``busy``, ``busy_since``: "starting the query of stage 1"), and when a
  micro-batch last completed (``batch_at``). A loop that has not gone round
  for the supervisor's ``stall_timeout_s`` is hung; a slow query start or a
  long batch on a busy machine is not (the loop does not wait for batches, and
  a start is one step well within that bound).

Before, the loop that restarted queries was also the one that beat, so a
query start slower than the heartbeat timeout (70 s on an overloaded machine)
got its own healthy instance killed as hung in the middle of a rebalance.

Example::

    >>> heart = Heart(context, config)  # doctest: +SKIP
    >>> heart.follower = follower  # doctest: +SKIP
    >>> heart.start()  # beats from now on, every heartbeat_interval_s  # doctest: +SKIP
    >>> with heart.busy("starting the query of stage 1"):  # doctest: +SKIP
    ...     start_it()
    >>> heart.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import dagster as dg

from stream_assets.control.desired_state import record_heartbeat
from stream_assets.control.rebalance import Progress, RebalanceFollower

if TYPE_CHECKING:
    from stream_assets.jobs.instance_job import InstanceConfig


class _Step:
    """A step under way in :meth:`Heart.busy`: its detail can change, its start does not."""

    def __init__(self, heart: Heart, what: str, since: float) -> None:
        self._heart, self.what, self.since = heart, what, since

    def say(self, text: str) -> None:
        """Show ``<what>: <text>`` as the step's description from now on."""
        self._heart._busy = (f"{self.what}: {text}", self.since)


class Heart:
    """This run's heartbeat: its sign of life to the supervisor, and its rebalance answers.

    Beaten by its own thread (:meth:`start`), and at once by the run loop when
    the rebalance progress changed (:meth:`progressed`), so the scale job learns
    of a step without waiting an interval.
    """

    def __init__(self, context: dg.OpExecutionContext, config: InstanceConfig) -> None:
        self._context = context
        self._config = config
        #: Set once the run follows rebalances; until then no heartbeat says "starting".
        self.follower: RebalanceFollower | None = None
        #: Lag by topic and queue, as of the last refresh (None: unknown).
        self.lag: dict[str, dict[int, int]] | None = None
        #: When a micro-batch last completed (epoch s; 0: none yet), read at each beat.
        self.batch_at: Callable[[], float] = lambda: 0.0
        #: Draining for a stop: the sources are no longer read (the other runs wait for it).
        self.draining = False
        #: Broker groups the instance waits for, since when (epoch s), as of the last look.
        self.waiting: dict[str, float] = {}
        self._sent: Progress | None = None
        self._loop_at = time.time()
        self._busy: tuple[str, float] | None = None
        # One beat at a time: a beat snapshotted before a newer one must not be
        # written after it (the scale job would see the progress go back).
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def progressed(self) -> bool:
        """Whether there is rebalance progress no beat has sent yet (answer it at once)."""
        follower = self.follower
        return follower is not None and self._sent != follower.progress

    def looped(self) -> None:
        """Say that the run loop went round (its progress, beside the beat's liveness)."""
        self._loop_at = time.time()

    @contextmanager
    def busy(self, what: str) -> Iterator[_Step]:
        """Say what a long step of the run loop is doing while it does it.

        Nested steps show the innermost; the outer one shows again after it.
        The step yielded can say how far it got.

        Example::

            >>> heart = Heart(None, None)  # type: ignore[arg-type]
            >>> with heart.busy("warming up the stores of 2 queues") as step:
            ...     step.say("warmed state[3]: 120 keys")
            ...     heart.doing()[0]
            'warming up the stores of 2 queues: warmed state[3]: 120 keys'
            >>> heart.doing() is None
            True
        """
        outer = self._busy
        step = _Step(self, what, time.time())
        self._busy = (what, step.since)
        try:
            yield step
        finally:
            self._busy = outer

    def doing(self) -> tuple[str, float] | None:
        """The long step under way and since when (epoch s), or None."""
        return self._busy

    def beat(self) -> None:
        """Record a heartbeat with the rebalance progress, activity and the last known lag."""
        follower = self.follower
        if follower is None:
            return
        with self._lock:
            progress = follower.progress  # replaced whole by the follower, never torn
            busy, busy_since = self._busy or ("", 0.0)
            record_heartbeat(
                self._context.instance,
                self._config.topology,
                follower.generation,
                self._config.instance_index,
                self._context.run_id,
                lag={t: sum(q.values()) for t, q in (self.lag or {}).items()},
                warmed=progress.warmed,
                released=progress.released,
                released_at=progress.released_at,
                running=progress.running,
                running_at=progress.running_at,
                loop_at=self._loop_at,
                busy=busy,
                busy_since=busy_since,
                batch_at=self.batch_at(),
                draining=self.draining,
                waiting=self.waiting,
            )
            self._sent = progress

    def start(self) -> None:
        """Beat from a thread of its own every ``heartbeat_interval_s`` until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="instance-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeat thread (the run is ending)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while not self._stopped.wait(self._config.heartbeat_interval_s):
            try:
                self.beat()
            except Exception as exc:  # storage busy or unreachable: say so once, keep beating
                if not self._failing:
                    self._context.log.warning(f"heartbeat not recorded, retrying: {exc}")
                self._failing = True
            else:
                self._failing = False
