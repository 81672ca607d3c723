"""Is a run's process alive, and how to end a hung one: process probes on this host.

The supervisor judges an instance run by its process *and* its heartbeat. A
heartbeat alone cannot tell a run that is still starting (Spark takes tens of
seconds) from one whose process was killed; a pid alone cannot tell a healthy
process from a hung one. These helpers answer the process half, for processes
on the machine the caller runs on (the supervisor sensor runs in the code
server, the process Dagster's default run launcher starts run workers from).

A pid can be reused by an unrelated process once the original exits, and
signalling that one would be a disaster; :func:`process_alive` therefore takes
the time the pid was last *known* to be the run's (its heartbeat or Dagster's
"Started process for run" event) and, where ``/proc`` exists, treats a process
that started after that time as someone else.

Example::

    >>> import os, time
    >>> process_alive(os.getpid(), seen_at=time.time())
    True
    >>> process_alive(0)
    False
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

#: Slack on a process start time computed from /proc (boot time has a one-second
#: resolution there, so a start time can read up to a second early).
_START_SLACK_S = 2.0


def this_host() -> str:
    """The host name heartbeats record (``socket.gethostname()``)."""
    return socket.gethostname()


@dataclass(frozen=True)
class RunProcess:
    """Where a run's process is: ``pid`` on ``host``, known to be the run's at ``seen_at``.

    ``host`` is empty when the process is on a machine this one cannot name
    (a pid from a run launcher that starts runs elsewhere).

    Example::

        >>> RunProcess(4242, "node-1", 100.0, "heartbeat").describe()
        'process 4242 on node-1'
    """

    pid: int
    host: str
    seen_at: float
    source: str  # "heartbeat" or "engine event": where the pid came from

    @property
    def local(self) -> bool:
        """Whether the process is on this machine (so it can be probed and signalled)."""
        return self.pid > 0 and self.host == this_host()

    def describe(self) -> str:
        """``process 4242 on node-1``."""
        return f"process {self.pid} on {self.host or 'another host'}"


@cache
def _boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def _proc_stat(pid: int) -> tuple[str, float | None] | None:
    """(state letter, start time as epoch seconds) from /proc, or None if unavailable."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return ("X", None)  # no such process (any more)
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    state = fields[0]
    boot = _boot_time()
    if boot is None or len(fields) < 20:
        return (state, None)
    ticks = os.sysconf("SC_CLK_TCK")
    return (state, boot + int(fields[19]) / ticks)


def process_alive(pid: int, seen_at: float | None = None) -> bool:
    """Whether ``pid`` is a live process on this machine (and, given ``seen_at``, the same one).

    A zombie (exited, not yet reaped by its parent) is not alive. With
    ``seen_at`` (epoch seconds at which the pid was known to be the run's) and
    ``/proc``, a process that started after it is a reused pid: not alive.

    Example::

        >>> import subprocess
        >>> child = subprocess.Popen(["sleep", "30"])
        >>> process_alive(child.pid), process_alive(child.pid, seen_at=0.0)
        (True, False)
        >>> child.kill(); _ = child.wait(); process_alive(child.pid)
        False
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    except OSError as exc:  # pragma: no cover - other platforms' oddities
        if exc.errno == errno.ESRCH:
            return False
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc: the signal check is all there is
    state, started = stat
    if state in ("Z", "X", "x"):
        return False
    return not (seen_at is not None and started is not None and started > seen_at + _START_SLACK_S)


def terminate(
    processes: Iterable[RunProcess],
    grace_s: float,
    say: Callable[[str], None] = lambda _line: None,
    kill_wait_s: float = 5.0,
) -> dict[int, bool]:
    """SIGTERM every (local) process, SIGKILL those still alive after ``grace_s``.

    Returns, per pid, whether the process is gone. The caller's own process
    (and its parent) is never signalled: a heartbeat written by the
    supervisor's process itself (a test) must not make it kill itself.

    Example::

        >>> import subprocess, time
        >>> child = subprocess.Popen(["sleep", "30"])
        >>> terminate([RunProcess(child.pid, this_host(), time.time(), "test")], 1.0)
        {...: True}
        >>> child.wait() == -signal.SIGTERM
        True
    """
    targets = {p.pid: p for p in processes if p.local}
    result: dict[int, bool] = {}
    for pid, proc in list(targets.items()):
        if pid in (os.getpid(), os.getppid(), 1):
            say(f"not signalling {proc.describe()}: it is the supervisor's own process")
            result[pid] = False
            del targets[pid]
            continue
        if not process_alive(pid, proc.seen_at):
            result[pid] = True
            del targets[pid]
            continue
        _signal(pid, signal.SIGTERM, say)
    pending = _wait_gone(targets, grace_s)
    for pid in pending:
        say(f"{targets[pid].describe()} ignored SIGTERM for {grace_s:.0f} s: SIGKILL")
        _signal(pid, signal.SIGKILL, say)
    still = _wait_gone({p: targets[p] for p in pending}, kill_wait_s)
    for pid in targets:
        result[pid] = pid not in still
    return result


def _signal(pid: int, signum: signal.Signals, say: Callable[[str], None]) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:
        say(f"no permission to send {signum.name} to process {pid} (another user's process)")


def _wait_gone(targets: dict[int, RunProcess], timeout_s: float) -> set[int]:
    """Poll until every process in ``targets`` is gone or ``timeout_s`` passes; the survivors."""
    deadline = time.monotonic() + timeout_s
    alive = {pid for pid, p in targets.items() if process_alive(pid, p.seen_at)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {pid for pid in alive if process_alive(pid, targets[pid].seen_at)}
    return alive
