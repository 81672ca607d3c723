"""Which stage-query failures an instance restarts the query for, and how often.

Spark gives every new Python worker it spawns without the daemon (the
streaming source's runner) 10 s to connect back, hard-coded in
``PythonWorkerFactory``. On a machine under heavy load the interpreter's
imports alone can take longer, and the query dies while INITIALIZING, having
read and written nothing. The worker launcher
(:mod:`~stream_assets.runtime.spark.worker_launcher`) connects before it imports,
which takes most of that time out of the limit; a restart is for a worker that
is late even so, or started without the launcher. Starting it again is safe at
any time: positions come from the broker's committed offsets and the state
(a replayed batch is de-duplicated by origin, as after any crash). Other
failures (a fenced generation, a bug) are not retried: they end the instance.

Example::

    >>> budget = RestartBudget(max_restarts=2, window_s=60.0)
    >>> [budget.allow(now) for now in (0.0, 1.0, 2.0, 61.5)]
    [True, True, False, True]
    >>> restartable(RuntimeError("Python worker failed to connect back."))
    True
    >>> restartable(RuntimeError("generation 3 fenced by generation 4"))
    False
"""

from __future__ import annotations

from collections import deque

#: Spark's messages for a Python worker that did not connect back in time.
_WORKER_START_FAILURES = (
    "Python worker failed to connect back",
    "Timed out while waiting for the Python worker to connect back",
)


def restartable(exc: BaseException | object) -> bool:
    """Whether a stage query that died of ``exc`` may simply be started again."""
    text = str(exc)
    return any(marker in text for marker in _WORKER_START_FAILURES)


class RestartBudget:
    """At most ``max_restarts`` restarts in any ``window_s`` seconds.

    A worker that cannot start for most of ten minutes (each failed attempt
    takes Spark's 10 s limit, so 30 of them fill half the window) means the
    machine cannot host the instance: the failure then surfaces (and
    supervision backs off) instead of the query restarting forever. Until
    then restarting in place is far cheaper than a relaunch, which needs a new
    JVM and SparkSession on the same busy machine (at a load average of 20
    on 2 cores, two or more failed attempts in a row are common).
    """

    def __init__(self, max_restarts: int = 30, window_s: float = 600.0) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """Take one restart at ``now`` (monotonic seconds) if the budget has one left."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True
