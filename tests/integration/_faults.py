"""Faults injected into a driver process, for tests of what the runtime survives.

``late_source_runner_python(dir, times)`` writes a Python for
:class:`DriverProcess` (``python=``) in which importing the streaming-source
runner's module takes longer than Spark's hard-coded 10 s connect-back limit,
for the first ``times`` runners: as on a machine under heavy load, where the
imports are what is slow. It is the injected fault itself, not a wait for
anything. The runner is a process of the driver, so the fault is the same
whichever master runs the tasks.

- ``launcher=False``: Spark's workers run the plain interpreter, which imports
  before it connects: each held runner misses the limit (the query restarts).
- ``launcher=True``: they run ``stream-assets-worker-python``, which connects
  first: a held runner is late with its imports only, which Spark waits for.

:class:`UnreachableCodeServerLauncher` makes Dagster's run launches fail as
they do when its code server does not answer in time.

``kill_before_an_end_site(dir, at)`` writes a ``sitecustomize`` for the
``PYTHONPATH`` of an instance's process: the ``at``-th exactly-once step of that
process tree (its tasks included) to have landed its delta kills the whole tree
with SIGKILL before it ends its transaction, the one point a kill from outside
hits by chance only.

Example::

    >>> python, held = late_source_runner_python(tmp_path, times=2)  # doctest: +SKIP
    >>> DriverProcess(spec, python=str(python))  # doctest: +SKIP
    >>> held_back(held)  # runners held back so far  # doctest: +SKIP
    2
"""

from __future__ import annotations

import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagster._config.config_schema import UserConfigSchema
from dagster._core.errors import DagsterUserCodeUnreachableError
from dagster._core.launcher import LaunchRunContext
from dagster._serdes.config_class import ConfigurableClassData

from stream_assets.control.run_launcher import SingleWorkerRunLauncher
from stream_assets.runtime.spark.worker_launcher import LAUNCHER
from tests.integration._cluster import venv_python

#: Longer than Spark's connect-back limit for a new Python worker (10 s).
HOLD_S = 13

_RUNNER = "pyspark.sql.streaming.python_streaming_source_runner"

# Python imports sitecustomize at start-up, from PYTHONPATH first: this one only
# adds an import finder, which holds the runner module's lookup (the lookup that
# `-m` makes before running it) and then lets the real finders find it.
_SITECUSTOMIZE = """
import os, sys, time

class _HoldRunner:
    held = False

    def find_spec(self, name, path=None, target=None):
        if name == {runner!r} and not _HoldRunner.held:
            _HoldRunner.held = True
            for i in range(1, {times} + 1):
                try:
                    os.mkdir(os.path.join({held!r}, str(i)))
                except FileExistsError:
                    continue
                time.sleep({hold})
                break
        return None

sys.meta_path.insert(0, _HoldRunner())
"""

_WRAPPER = """#!/bin/sh
export PYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}"
exec "{python}" "$@"
"""

# Imported at every start of a Python of the instance's tree (the driver, Spark's
# daemon and its workers): the kill must happen in the task, between its state
# commit and its end, so it is counted across processes in a locked file.
_KILL_BEFORE_END = """
import fcntl, os, signal

from stream_assets.runtime.core import sink_transactions as _tx

_end = _tx.ExactlyOnceSinks.end


def _counted_end(self):
    if self.transaction.prepared:  # a step with results: its delta landed
        fd = os.open({counter!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        ended = int(os.read(fd, 32) or b"0") + 1
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, str(ended).encode())
        if ended == {at}:
            os.fsync(fd)
            os.killpg(os.getsid(0), signal.SIGKILL)  # the driver and its JVM
            os.killpg(os.getpgrp(), signal.SIGKILL)  # Spark's daemon and its workers
        os.close(fd)
    return _end(self)


_tx.ExactlyOnceSinks.end = _counted_end
"""


def kill_before_an_end_site(directory: Path, at: int) -> tuple[Path, Path]:
    """A directory to put first on an instance process's ``PYTHONPATH``, and the file
    that counts the steps before the kill (it reads ``at`` once the kill came).

    The process must lead a session of its own (``start_new_session=True``): the kill
    takes the whole session."""
    site, counter = directory / "site", directory / "ended"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_KILL_BEFORE_END.format(counter=str(counter), at=at))
    return site, counter


#: What the instance logs when it starts such a query again.
RESTART_LINE = "did not start in time"


def late_source_runner_python(
    directory: Path, times: int = 1, launcher: bool = False
) -> tuple[Path, Path]:
    """The wrapper's path, and the directory that records each runner it held back."""
    held, site = directory / "held", directory / "site"
    held.mkdir(parents=True, exist_ok=True)
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        _SITECUSTOMIZE.format(runner=_RUNNER, times=times, held=str(held), hold=HOLD_S)
    )
    python = venv_python()
    target = str(Path(python).parent / LAUNCHER) if launcher else python
    wrapper = directory / "python"
    wrapper.write_text(_WRAPPER.format(site=site, python=target))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper, held


def held_back(held: Path) -> int:
    """How many runners the wrapper has held back so far."""
    return sum(1 for _ in held.iterdir())


class UnreachableCodeServerLauncher(SingleWorkerRunLauncher):
    """The project's run launcher, whose launches fail as when the code server times out.

    The file ``fault_file`` holds a script, one letter a call to the code server to
    start a run's worker, taken from its front: ``R`` raises the error Dagster's
    gRPC client raises on DEADLINE_EXCEEDED without asking the server (a server too
    busy to answer); ``S`` asks the server, which spawns the worker, and raises that
    error once it did, while the call goes on (the reply that comes too late). An
    empty script launches as usual. It runs where Dagster's run queue launches runs (the daemon),
    configured in the deployment's ``dagster.yaml``::

        run_launcher:
          module: tests.integration._faults
          class: UnreachableCodeServerLauncher
          config: {fault_file: /tmp/.../refuse}
    """

    def __init__(self, fault_file: str, inst_data: ConfigurableClassData | None = None) -> None:
        super().__init__(inst_data=inst_data)
        self._fault = Path(fault_file)

    @classmethod
    def config_type(cls) -> UserConfigSchema:
        return {"fault_file": str}

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]
    ) -> UnreachableCodeServerLauncher:
        return cls(fault_file=config_value["fault_file"], inst_data=inst_data)

    def start_worker(self, context: LaunchRunContext) -> None:
        script = self._fault.read_text().strip() if self._fault.exists() else ""
        if script:
            self._fault.write_text(script[1:])
        if script[:1] == "S":
            # The call goes on, as a real one does past its deadline: the server spawns
            # the worker, which loads the code; the caller gives up meanwhile.
            threading.Thread(target=super().start_worker, args=(context,), daemon=True).start()
            deadline = time.monotonic() + 120
            while not self.worker_running(context) and time.monotonic() < deadline:
                time.sleep(0.1)
        elif script[:1] != "R":
            super().start_worker(context)
        if script[:1] in ("R", "S"):
            raise DagsterUserCodeUnreachableError(
                "Could not reach user code server. gRPC Error code: DEADLINE_EXCEEDED "
                "(injected by tests.integration._faults)"
            )
