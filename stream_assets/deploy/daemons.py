"""A long-running process of a host, started detached and found again by its pid file.

Every process of the production-shaped deployment (Spark's master and workers,
Dagster's webserver and daemon, the input feeder) outlives the command that
started it, as a service on its own host would; ``down`` and ``status`` find it
through ``<name>.pid`` beside ``<name>.log``. A pid file names the process's
start time too (``/proc/<pid>/stat`` field 22), so a pid recycled after a reboot
or a crash is never taken for the service (nor killed by ``stop``).

Example::

    >>> d = Daemon("webserver", ["dagster-webserver"], Path("/tmp/h"))  # doctest: +SKIP
    >>> d.start(env)  # doctest: +SKIP
    >>> d.pid() is not None  # doctest: +SKIP
    True
    >>> d.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stream_assets.broker.jvm import alive, tail

#: How long a service may take to exit after SIGTERM before it is killed.
STOP_WAIT_S = 60.0


class DeployError(RuntimeError):
    """A host of the deployment could not be brought up or down; the message says why."""


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class Daemon:
    """``argv`` run from ``cwd`` as service ``name``, logging to ``<home>/<name>.log``."""

    name: str
    argv: Sequence[str]
    home: Path
    cwd: Path | None = None

    @property
    def log_file(self) -> Path:
        return self.home / f"{self.name}.log"

    @property
    def pid_file(self) -> Path:
        return self.home / f"{self.name}.pid"

    def pid(self) -> int | None:
        """The service's pid if it runs, else None (a stale or recycled pid file reads None)."""
        try:
            pid_text, ticks = self.pid_file.read_text().split()
            pid = int(pid_text)
        except (FileNotFoundError, ValueError):
            return None
        return pid if alive(pid) and _start_ticks(pid) == ticks else None

    def start(self, env: Mapping[str, str]) -> int:
        """Start it in a session of its own (unless it runs already) and return its pid."""
        running = self.pid()
        if running is not None:
            return running
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            proc = subprocess.Popen(
                list(self.argv),
                cwd=self.cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives the command that started it
            )
        self.pid_file.write_text(f"{proc.pid} {_start_ticks(proc.pid) or ''}")
        return proc.pid

    def check_running(self) -> None:
        """Raise, with the log's last lines, if the service is not running."""
        if self.pid() is None:
            raise DeployError(
                f"{self.name} exited; last lines of {self.log_file}:\n{tail(self.log_file, 30)}"
            )

    def stop(self, wait_s: float = STOP_WAIT_S) -> bool:
        """SIGTERM its process group, SIGKILL it after ``wait_s``; False if it was not running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            # The group too: a webserver's code server, a worker's executor JVMs.
            os.killpg(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        return True


def wait_for(
    condition: Callable[[], bool], timeout_s: float, what: str, *watch: Daemon, poll_s: float = 0.2
) -> float:
    """Poll ``condition()`` every ``poll_s`` until true; raise naming ``what`` (and any
    watched service that died meanwhile, with its log) after ``timeout_s``. Returns the
    seconds it took."""
    started = time.monotonic()
    while not condition():
        for daemon in watch:
            daemon.check_running()
        if time.monotonic() - started > timeout_s:
            raise DeployError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(poll_s)
    return time.monotonic() - started
