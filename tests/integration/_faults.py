"""Faults injected into a driver process, for tests of what the runtime survives.

``late_source_runner_python(dir)`` writes a Python for :class:`DriverProcess`
(``python=``) whose first streaming-source runner connects back later than
Spark's hard-coded 10 s limit, as on a machine under heavy load: the
injected fault itself, not a wait for anything. The runner is a process of
the driver, so the fault is the same whichever master runs the tasks.

Example::

    >>> python, held = late_source_runner_python(tmp_path)  # doctest: +SKIP
    >>> DriverProcess(spec, python=str(python))  # doctest: +SKIP
    >>> held.exists()  # True once a runner was held back  # doctest: +SKIP
"""

from __future__ import annotations

import stat
from pathlib import Path

from tests.integration._cluster import venv_python

#: Longer than Spark's connect-back limit for a new Python worker (10 s).
HOLD_S = 13

_WRAPPER = """#!/bin/sh
# The first streaming source runner of this driver connects back too late.
case " $* " in
  *python_streaming_source_runner*)
    if mkdir "{mark}" 2>/dev/null; then sleep {hold}; fi ;;
esac
exec "{python}" "$@"
"""

#: What the instance logs when it starts such a query again.
RESTART_LINE = "did not start in time"


def late_source_runner_python(directory: Path) -> tuple[Path, Path]:
    """The wrapper's path, and the marker that exists once it held a runner back."""
    directory.mkdir(parents=True, exist_ok=True)
    mark = directory / "held-once"
    wrapper = directory / "python"
    wrapper.write_text(_WRAPPER.format(mark=mark, hold=HOLD_S, python=venv_python()))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper, mark
