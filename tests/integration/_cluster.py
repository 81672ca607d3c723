"""A real Spark standalone cluster on this machine: one master, N workers that share no disk.

Why: ``local[2]`` runs every task in one executor with one local disk, so it can
never show that state follows the queue rather than the executor (DESIGN.md
section 3). A standalone cluster whose workers each have their own
``SPARK_LOCAL_DIRS`` (``<root>/worker-<i>/local``) stands in for N machines:
an executor launched by worker i keeps its block manager dirs there, and its
Python workers learn that path from ``SPARK_LOCAL_DIRS`` in their environment,
so anything an engine task derives from its local disk (RocksDB stores) lands
on that worker's "machine" only. ``kill_worker(i)`` is then the loss of
machine i: its JVMs, its Python workers and whatever they held in memory.

Every JVM is started from the venv's PySpark (``<pyspark>/bin/spark-class``),
bound to 127.0.0.1 on free ports, in a session of its own, logging to
``<root>/logs/``; an executor's own stdout/stderr are under
``<root>/worker-<i>/work/<app-id>/<executor-id>/``. Nothing is deleted on
close, so the logs stay for debugging (the path is printed on failure).

What runs per worker (seen on Spark 4.x): the Worker JVM, the executor JVM the
worker launched for an application (CoarseGrainedExecutorBackend; a child of
the worker JVM, same session) and that executor's ``pyspark.daemon`` with its
forked Python workers. The daemon puts itself in a new process group
(``os.setpgid(0, 0)``), so killing the worker's process group is not enough:
``kill_worker`` kills every process of the worker's session, every process
whose cwd is under the worker's directory and every process carrying the
worker's marker variable in its environment, then checks none is left.

A driver connecting to the cluster should use ``cluster.master_url`` as its
master and ``cluster.spark_conf()`` as conf: executors of 512 MiB heap with one
core each and at most two cores per application, i.e. one executor per worker
(``spark.executor.memory=512m``, ``spark.executor.cores=1``,
``spark.cores.max=2``), driver bound to 127.0.0.1, and scheduling held until
both executors registered (``spark.scheduler.minRegisteredResourcesRatio=1``,
at most 30 s) so the first batch does not all land on whichever came first.
The driver's ``PYSPARK_PYTHON`` decides the executors' Python: set it to the
venv's python (``venv_python()``).

Fixtures (a test module imports them to use them; pytest only collects
fixtures from conftest.py and the test module itself)::

    from tests.integration._cluster import spark_cluster  # noqa: F401

``spark_cluster`` is module-scoped: a test that kills a worker should
``start_worker(i)`` it again (and ``wait_ready()``) if later tests of the module
need every worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from stream_assets.deploy.spark_standalone import java_home, master_json, pyspark_home
from tests.integration._util import free_port

HOST = "127.0.0.1"
PROJECT_ROOT = Path(__file__).resolve().parents[2]

#: Set in each worker's environment; inherited by its executor and Python
#: workers, so they can be found even after they re-parent or re-group.
MARKER_ENV = "STREAM_ASSETS_TEST_SPARK_WORKER"


def venv_python() -> str:
    """The project's venv python (executors must run it: DESIGN.md section 8)."""
    candidate = PROJECT_ROOT / ".venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


@dataclass(frozen=True)
class ProcessInfo:
    """One live process of a worker (for kill checks and reports)."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    rss_kib: int
    cmdline: str
    #: Its role among a worker's processes (``worker_processes`` sets it): ``kind``,
    #: or ``python-worker`` for a process forked by a Python daemon.
    role: str = ""

    @property
    def kind(self) -> str:
        """What its command line says: worker-jvm, executor-jvm, python-daemon, other.

        A Python worker forked by the daemon keeps the daemon's command line;
        only its parent tells it apart (see ``role``).
        """
        if "org.apache.spark.deploy.worker.Worker" in self.cmdline:
            return "worker-jvm"
        if "CoarseGrainedExecutorBackend" in self.cmdline:
            return "executor-jvm"
        if "pyspark.daemon" in self.cmdline:
            return "python-daemon"
        return "other"


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, sid) of ``pid``, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may contain spaces and parentheses: fields start after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def _process_info(pid: int) -> ProcessInfo | None:
    stat = _stat(pid)
    if stat is None:
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    except OSError:
        return None
    return ProcessInfo(pid, stat[1], stat[2], stat[3], rss, cmdline.strip())


def _live_pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


@dataclass
class _Daemon:
    """A master or worker JVM we started."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    rpc_port: int
    ui_port: int
    log_file: IO[bytes]
    #: Killed on purpose: its exit is not a failure.
    killed: bool = False

    @property
    def running(self) -> bool:
        return self.popen.poll() is None


class SparkCluster:
    """A standalone master on 127.0.0.1 and ``workers`` workers, each its own "machine".

    Example::

        with SparkCluster(tmp_path) as cluster:
            cluster.wait_ready(timeout_s=120)
            conf = cluster.spark_conf()   # plus master cluster.master_url
            cluster.kill_worker(0)
            cluster.wait_ready(workers=1)
    """

    def __init__(
        self,
        root: Path,
        workers: int = 2,
        worker_cores: int = 1,
        worker_memory: str = "1g",
        executor_memory: str = "512m",
        daemon_memory: str = "256m",
        python: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.workers = workers
        self.worker_cores = worker_cores
        self.worker_memory = worker_memory
        self.executor_memory = executor_memory
        self.daemon_memory = daemon_memory
        self.python = python or venv_python()
        self._spark_class = pyspark_home() / "bin" / "spark-class"
        self._master: _Daemon | None = None
        self._workers: dict[int, _Daemon] = {}
        self._started_at = 0.0
        #: Seconds from start() to milestones ("master up", "N workers alive"), for reports.
        self.timings: dict[str, float] = {}

    # -- paths and conf ------------------------------------------------------

    @property
    def log_dir(self) -> Path:
        """Where the master and worker JVMs log."""
        return self.root / "logs"

    def worker_dir(self, i: int) -> Path:
        """Worker i's base directory: everything of that "machine" is below it."""
        return self.root / f"worker-{i}"

    def local_dir(self, i: int) -> Path:
        """Worker i's SPARK_LOCAL_DIRS: its executor's disk."""
        return self.worker_dir(i) / "local"

    @property
    def master_url(self) -> str:
        """``spark://127.0.0.1:<port>``."""
        if self._master is None:
            raise RuntimeError("the cluster is not started")
        return f"spark://{HOST}:{self._master.rpc_port}"

    @property
    def master_pid(self) -> int:
        """The master JVM's pid."""
        if self._master is None:
            raise RuntimeError("the cluster is not started")
        return self._master.popen.pid

    @property
    def master_ui(self) -> str:
        """The master's web UI (``/json`` lists workers and applications)."""
        if self._master is None:
            raise RuntimeError("the cluster is not started")
        return f"http://{HOST}:{self._master.ui_port}"

    def spark_conf(self) -> dict[str, str]:
        """The conf a driver connecting to this cluster should use (master: ``master_url``)."""
        return {
            "spark.driver.host": HOST,
            "spark.driver.bindAddress": HOST,
            "spark.executor.memory": self.executor_memory,
            "spark.executor.cores": "1",
            "spark.cores.max": str(self.workers),
            "spark.ui.showConsoleProgress": "false",
            # Hold the first job until every executor is there: otherwise the
            # first one to register takes every task of the first batches.
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "30s",
        }

    # -- lifecycle -----------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            # A developer's own Spark setup must not leak into the cluster.
            if not k.startswith(("SPARK_", "PYSPARK_")) and k != MARKER_ENV
        }
        conf_dir = self.root / "conf"
        conf_dir.mkdir(parents=True, exist_ok=True)
        env.update(
            JAVA_HOME=java_home(),
            SPARK_HOME=str(pyspark_home()),
            SPARK_CONF_DIR=str(conf_dir),
            SPARK_LOCAL_IP=HOST,
            SPARK_DAEMON_MEMORY=self.daemon_memory,
            PYSPARK_PYTHON=self.python,
        )
        return env

    def _launch(
        self, name: str, args: list[str], env: dict[str, str], cwd: Path, rpc: int, ui: int
    ) -> _Daemon:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        log_file = log.open("ab")
        popen = subprocess.Popen(
            [str(self._spark_class), *args],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # Own session and process group: killable with all its children.
            start_new_session=True,
        )
        return _Daemon(name, popen, log, rpc, ui, log_file)

    def start(self) -> SparkCluster:
        """Start the master, wait until its UI answers, then start every worker."""
        if self._master is not None:
            raise RuntimeError("already started")
        self.root.mkdir(parents=True, exist_ok=True)
        self._started_at = time.monotonic()
        env = self._env()
        # A worker that misses heartbeats is declared dead after this; a killed
        # worker is normally noticed at once (its RPC connection drops).
        env["SPARK_MASTER_OPTS"] = "-Dspark.worker.timeout=15"
        rpc, ui = free_port(), free_port()
        self._master = self._launch(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                HOST,
                "--port",
                str(rpc),
                "--webui-port",
                str(ui),
            ],
            env,
            self.root,
            rpc,
            ui,
        )
        self._wait(lambda: self._master_json() is not None, 60, "the master's web UI")
        self.timings["master up"] = time.monotonic() - self._started_at
        for i in range(self.workers):
            self.start_worker(i)
        return self

    def start_worker(self, i: int) -> None:
        """Start worker i (again, after ``kill_worker(i)``); same directories, new ports."""
        if i in self._workers and self._workers[i].running:
            raise RuntimeError(f"worker {i} is running")
        base = self.worker_dir(i)
        for sub in ("local", "work"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        env = self._env()
        env.update(
            SPARK_LOCAL_DIRS=str(self.local_dir(i)),
            SPARK_WORKER_DIR=str(base / "work"),
            SPARK_WORKER_CORES=str(self.worker_cores),
            SPARK_WORKER_MEMORY=self.worker_memory,
            **{MARKER_ENV: str(base)},
        )
        rpc, ui = free_port(), free_port()
        self._workers[i] = self._launch(
            f"worker-{i}",
            [
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                HOST,
                "--port",
                str(rpc),
                "--webui-port",
                str(ui),
                "--cores",
                str(self.worker_cores),
                "--memory",
                self.worker_memory,
                "--work-dir",
                str(base / "work"),
                self.master_url,
            ],
            env,
            base,
            rpc,
            ui,
        )

    def __enter__(self) -> SparkCluster:
        try:
            return self.start()
        except BaseException:
            self.close(failed=True)  # __exit__ does not run for a failed __enter__
            raise

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(failed=exc_type is not None)

    # -- master state ----------------------------------------------------------

    def _master_json(self) -> dict[str, Any] | None:
        return None if self._master is None else master_json(self.master_ui)

    def master_state(self) -> dict[str, Any]:
        """The master's ``/json`` (workers, applications); raises if it does not answer."""
        data = self._master_json()
        if data is None:
            raise self._failure("the master's web UI does not answer")
        return data

    def alive_workers(self) -> list[dict[str, Any]]:
        """The master's ALIVE workers (its /json entries, plus ``index``: our worker number)."""
        by_port = {d.rpc_port: i for i, d in self._workers.items()}
        alive = []
        for worker in self.master_state().get("workers", []):
            if worker.get("state") == "ALIVE":
                alive.append({**worker, "index": by_port.get(int(worker.get("port", -1)))})
        return alive

    def wait_ready(self, workers: int | None = None, timeout_s: float = 120.0) -> float:
        """Wait until the master reports exactly ``workers`` (default: all) ALIVE workers.

        Returns the seconds waited. Fails early if a JVM we started exited.
        """
        want = self.workers if workers is None else workers
        began = time.monotonic()

        def ready() -> bool:
            data = self._master_json()
            alive = [w for w in (data or {}).get("workers", []) if w.get("state") == "ALIVE"]
            return data is not None and len(alive) == want

        self._wait(ready, timeout_s, f"{want} ALIVE workers")
        self.timings.setdefault(f"{want} workers alive", time.monotonic() - self._started_at)
        return time.monotonic() - began

    def _wait(self, condition: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            dead = [
                d.name
                for d in (self._master, *self._workers.values())
                if d is not None and not d.running and not d.killed
            ]
            if dead:
                raise self._failure(f"{', '.join(dead)} exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise self._failure(f"timed out after {timeout_s}s waiting for {what}")
            time.sleep(0.2)

    def _failure(self, message: str) -> RuntimeError:
        tails = []
        for daemon in (self._master, *self._workers.values()):
            if daemon is not None and daemon.log.exists():
                lines = daemon.log.read_text(errors="replace").splitlines()[-15:]
                tails.append(f"--- {daemon.log} (last lines)\n" + "\n".join(lines))
        return RuntimeError(f"{message}; logs under {self.root}\n" + "\n".join(tails))

    # -- processes -------------------------------------------------------------

    def worker_processes(self, i: int) -> list[ProcessInfo]:
        """Every live process of worker i: its JVM, its executors and their Python workers."""
        base = str(self.worker_dir(i))
        daemon = self._workers.get(i)
        # The session id is the worker JVM's pid only while that JVM lives:
        # after it died the number may be reused.
        sid = daemon.popen.pid if daemon is not None and daemon.running else None
        found = []
        for pid in _live_pids():
            stat = _stat(pid)
            if pid == os.getpid() or stat is None or stat[0] in ("Z", "X"):
                continue
            if stat[3] == sid or _under(pid, base):
                info = _process_info(pid)
                if info is not None:
                    found.append(info)
        daemons = {p.pid for p in found if p.kind == "python-daemon"}
        return sorted(
            (
                dataclasses.replace(p, role="python-worker" if p.ppid in daemons else p.kind)
                for p in found
            ),
            key=lambda p: p.pid,
        )

    def kill_worker(self, i: int, timeout_s: float = 30.0) -> list[ProcessInfo]:
        """SIGKILL worker i and everything it launched, as a lost machine; returns what it killed.

        Raises if a process of that worker is still alive after ``timeout_s``.
        """
        daemon = self._workers[i]
        victims = self.worker_processes(i)
        daemon.killed = True
        # The group first (worker JVM + executor JVMs), then the stragglers
        # found by session/cwd/env (the Python daemon leaves the group).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(daemon.popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.worker_processes(i)
            for proc in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.popen.wait(timeout=0.1)  # reaps our child, the worker JVM
            if not left and not daemon.running:
                break
            if time.monotonic() > deadline:
                raise self._failure(f"worker {i}: processes survive SIGKILL: {left}")
            if left:
                time.sleep(0.02)  # let the kernel finish tearing them down
        daemon.log_file.close()
        return victims

    def close(self, failed: bool = False) -> None:
        """Kill every worker (with its executors) and the master; keep the logs."""
        for i, daemon in list(self._workers.items()):
            if daemon.running or self.worker_processes(i):
                try:
                    self.kill_worker(i)
                except RuntimeError as exc:  # still close the rest
                    print(exc, file=sys.stderr)
        if self._master is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._master.popen.pid, signal.SIGKILL)
            self._master.popen.wait(timeout=30)
            self._master.log_file.close()
            self._master = None
        if failed:
            print(f"spark cluster logs: {self.root}", file=sys.stderr)


def _under(pid: int, base: str) -> bool:
    """Does ``pid`` run in ``base`` (cwd) or carry worker ``base``'s marker variable?"""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
        if cwd == base or cwd.startswith(base + "/"):
            return True
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{MARKER_ENV}={base}".encode() in environ.split(b"\0")


@pytest.fixture(scope="module")
def spark_cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[SparkCluster]:
    """A started two-worker standalone cluster, every worker registered; closed after the module.

    Its logs stay under pytest's temp dir; the path is printed if a test failed.
    """
    failed_before = request.session.testsfailed
    cluster = SparkCluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        cluster.start()
        cluster.wait_ready(timeout_s=120)
    except BaseException:
        cluster.close(failed=True)
        raise
    yield cluster
    cluster.close(failed=request.session.testsfailed > failed_before)
