"""Faults injected into a driver process, for tests of what the runtime survives.

``late_source_runner_python(dir, times)`` writes a Python for
:class:`DriverProcess` (``python=``) whose first ``times`` streaming-source
runners connect back later than Spark's hard-coded 10 s limit, as on a
machine under heavy load: the injected fault itself, not a wait for
anything. The runner is a process of the driver, so the fault is the same
whichever master runs the tasks.

Example::

    >>> python, held = late_source_runner_python(tmp_path, times=2)  # doctest: +SKIP
    >>> DriverProcess(spec, python=str(python))  # doctest: +SKIP
    >>> held_back(held)  # runners held back so far  # doctest: +SKIP
    2
"""

from __future__ import annotations

import stat
from pathlib import Path

from tests.integration._cluster import venv_python

#: Longer than Spark's connect-back limit for a new Python worker (10 s).
HOLD_S = 13

_WRAPPER = """#!/bin/sh
# The first {times} streaming source runners of this driver connect back too late.
case " $* " in
  *python_streaming_source_runner*)
    i=1
    while [ "$i" -le {times} ]; do
      if mkdir "{held}/$i" 2>/dev/null; then sleep {hold}; break; fi
      i=$((i + 1))
    done ;;
esac
exec "{python}" "$@"
"""

#: What the instance logs when it starts such a query again.
RESTART_LINE = "did not start in time"


def late_source_runner_python(directory: Path, times: int = 1) -> tuple[Path, Path]:
    """The wrapper's path, and the directory that records each runner it held back."""
    held = directory / "held"
    held.mkdir(parents=True, exist_ok=True)
    wrapper = directory / "python"
    wrapper.write_text(_WRAPPER.format(held=held, times=times, hold=HOLD_S, python=venv_python()))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper, held


def held_back(held: Path) -> int:
    """How many runners the wrapper has held back so far."""
    return sum(1 for _ in held.iterdir())
