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

Example::

    >>> python, held = late_source_runner_python(tmp_path, times=2)  # doctest: +SKIP
    >>> DriverProcess(spec, python=str(python))  # doctest: +SKIP
    >>> held_back(held)  # runners held back so far  # doctest: +SKIP
    2
"""

from __future__ import annotations

import stat
from pathlib import Path

from stream_assets.runtime.worker_launcher import LAUNCHER
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
