"""CPU load for tests that must hold under a busy machine (slow batches, late heartbeats).

``cpu_hog(n)`` runs ``n`` busy-loop processes for the duration of a ``with``
block. Each one bounds itself (it exits after ``max_s``, 15 minutes by default,
or as soon as its parent is gone), so a test process killed with SIGKILL does
not leave the machine pinned. The context yields once every hog has reported
that it is spinning (a line on its stdout), and kills them all on exit.

Fixture (import it into the test module; pytest collects fixtures only from
conftest.py and the module itself)::

    from tests.integration._load import cpu_load  # noqa: F401

    def test_x(cpu_load: list[int]) -> None: ...  # 4 hogs for this test
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

#: The hog: report readiness, then spin until the deadline or the parent's death
#: (checked every ~million iterations, a few milliseconds of work).
_HOG = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
sys.stdout.write("spinning\\n"); sys.stdout.flush()
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


@contextlib.contextmanager
def cpu_hog(processes: int = 4, max_s: float = 900.0) -> Iterator[list[int]]:
    """Keep ``processes`` CPUs busy inside the block; yields the hogs' pids."""
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(processes):
            hogs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _HOG, str(os.getpid()), str(max_s)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                )
            )
        for hog in hogs:
            assert hog.stdout is not None
            if hog.stdout.readline() != b"spinning\n":
                raise RuntimeError(f"cpu hog {hog.pid} did not start (exit {hog.wait()})")
        yield [hog.pid for hog in hogs]
    finally:
        for hog in hogs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hog.pid, signal.SIGKILL)
        for hog in hogs:
            hog.wait()
            if hog.stdout is not None:
                hog.stdout.close()


def busy_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) the given live processes have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{pid}/stat").read_text()
            fields = raw[raw.rindex(")") + 2 :].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


@pytest.fixture
def cpu_load() -> Iterator[list[int]]:
    """Four busy-loop processes for the duration of the test; yields their pids."""
    with cpu_hog(4) as pids:
        yield pids
