"""How many runs of each instance index live at once, counted over a whole test.

A run is live when its process is alive and its heartbeat fresh, whatever Dagster's
status of it says: what the supervisor must never double.

Example::

    >>> watch = LiveRunsPerIndex(instance, "wordcount")  # doctest: +SKIP
    >>> watch.start(); ...; watch.stop()  # doctest: +SKIP
    >>> watch.most  # doctest: +SKIP
    1
"""

from __future__ import annotations

import collections
import threading

import dagster as dg

from stream_assets.control.desired_state import heartbeats
from stream_assets.control.liveness import process_alive
from stream_assets.control.registry import INSTANCE_INDEX_TAG
from stream_assets.jobs.supervisor import instance_runs
from stream_assets.settings import SupervisorSettings


class LiveRunsPerIndex(threading.Thread):
    """Counts, once a second, the live runs of each index of ``topology``; ``most`` is the
    highest count seen for any index, ``samples`` how many counts were taken."""

    def __init__(self, instance: dg.DagsterInstance, topology: str) -> None:
        super().__init__(daemon=True)
        self.instance, self.topology = instance, topology
        self.most = self.samples = 0
        self._done = threading.Event()

    def run(self) -> None:
        timeout = SupervisorSettings().heartbeat_timeout_s
        while not self._done.wait(1.0):
            runs = instance_runs(self.instance, self.topology, list(dg.DagsterRunStatus))[:20]
            beats = heartbeats(self.instance, [r.run_id for r in runs])
            live = collections.Counter(
                r.tags[INSTANCE_INDEX_TAG]
                for r in runs
                if (b := beats.get(r.run_id)) is not None
                and b.age() <= timeout
                and process_alive(b.pid, b.ts)
            )
            self.most = max(self.most, *live.values(), 0)
            self.samples += 1

    def stop(self) -> int:
        """Stop counting; the most live runs of one index seen."""
        self._done.set()
        self.join()
        return self.most
