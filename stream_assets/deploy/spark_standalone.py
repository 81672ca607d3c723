"""The Spark hosts: a standalone master and workers that share no disk.

Each worker stands in for a machine of its own: its own ``SPARK_LOCAL_DIRS``
(``worker-<i>/local``, where executors keep RocksDB state unless
``STREAM_ASSETS_ENGINE_STATE_DIR`` says otherwise) and work directory
(``worker-<i>/work``, each executor's stdout/stderr). Every JVM comes from the
venv's PySpark (``pyspark/bin/spark-class``), the same Spark the drivers run, so
driver and cluster never disagree on a version.

An instance run is one Spark application (its driver runs in the Dagster run's
process) with ``spark.cores.max`` one-core executors; the master spreads each
application over the workers with the most free cores, so instances land on
different workers, and ``workers x worker_cores`` bounds the executors of all
instances together.

Example::

    >>> spark = SparkStandalone(Path(".local/prod-like/spark"), 27077, 28080)  # doctest: +SKIP
    >>> spark.start(); spark.wait_ready()  # doctest: +SKIP
    >>> spark.master_url  # doctest: +SKIP
    'spark://127.0.0.1:27077'
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from stream_assets.deploy.daemons import Daemon, DeployError, wait_for
from stream_assets.deploy.env_files import DEPLOY_DIR, host_env


def pyspark_home() -> Path:
    """The installed pyspark package: it is a Spark distribution (bin/, jars/)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def java_home() -> str:
    """JAVA_HOME from the environment, else the JDK of the ``java`` on PATH."""
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    java = shutil.which("java")
    if java is None:
        raise DeployError("no JAVA_HOME and no java on PATH: install Java 17")
    return str(Path(java).resolve().parent.parent)


def master_json(ui_url: str) -> dict[str, Any] | None:
    """A standalone master's ``/json`` (workers, applications) at its web UI ``ui_url``,
    or None if it does not answer."""
    try:
        with urllib.request.urlopen(f"{ui_url}/json/", timeout=5) as response:
            data: dict[str, Any] = json.load(response)
            return data
    except (OSError, urllib.error.URLError, ValueError):
        return None


class SparkStandalone:
    """A master on ``host:master_port`` (UI on ``ui_port``) and ``workers`` workers."""

    def __init__(
        self,
        home: Path,
        master_port: int,
        ui_port: int,
        workers: int = 2,
        worker_cores: int = 2,
        worker_memory: str = "2g",
        host: str = "127.0.0.1",
        python: str | None = None,
    ) -> None:
        self.home = home.resolve()
        self.master_port, self.ui_port = master_port, ui_port
        self.workers, self.worker_cores, self.worker_memory = workers, worker_cores, worker_memory
        self.host = host
        self.python = python or sys.executable
        spark_class = str(pyspark_home() / "bin" / "spark-class")
        self.master = Daemon(
            "spark-master",
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                host,
                "--port",
                str(master_port),
                "--webui-port",
                str(ui_port),
            ],
            self.home,
            self.home,
        )
        self.worker_daemons = [
            Daemon(
                f"spark-worker-{i}",
                [
                    spark_class,
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    host,
                    "--port",
                    "0",
                    "--webui-port",
                    "0",
                    "--cores",
                    str(worker_cores),
                    "--memory",
                    worker_memory,
                    "--work-dir",
                    str(self.worker_dir(i) / "work"),
                    self.master_url,
                ],
                self.home,
                self.worker_dir(i),
            )
            for i in range(workers)
        ]

    @property
    def master_url(self) -> str:
        return f"spark://{self.host}:{self.master_port}"

    @property
    def master_ui(self) -> str:
        return f"http://{self.host}:{self.ui_port}"

    def worker_dir(self, i: int) -> Path:
        """Worker i's "machine": its local disk and work directory are below it."""
        return self.home / f"worker-{i}"

    def _env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            # The operator's own Spark setup must not leak into the cluster.
            if not k.startswith(("SPARK_", "PYSPARK_"))
        }
        env.update(
            JAVA_HOME=java_home(),
            SPARK_HOME=str(pyspark_home()),
            SPARK_LOCAL_IP=self.host,
            SPARK_DAEMON_MEMORY="256m",
            PYSPARK_PYTHON=self.python,
            # A worker that stops heartbeating is declared lost after 15 s, not 60 s.
            SPARK_MASTER_OPTS="-Dspark.worker.timeout=15",
        )
        return env

    def master_state(self) -> dict[str, Any] | None:
        """The master's ``/json`` (workers, applications), or None if it does not answer."""
        return master_json(self.master_ui)

    def alive_workers(self) -> int:
        state = self.master_state() or {}
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def start(self) -> None:
        """Start the master, then every worker not running yet (idempotent)."""
        env = self._env()
        self.master.start(env)
        wait_for(lambda: self.master_state() is not None, 90, "the Spark master's UI", self.master)
        for i, worker in enumerate(self.worker_daemons):
            for sub in ("local", "work"):
                (self.worker_dir(i) / sub).mkdir(parents=True, exist_ok=True)
            values = {"WORKER_DIR": str(self.worker_dir(i)), "PYTHON": self.python}
            worker.start({**env, **host_env(DEPLOY_DIR / "env" / "spark-worker.env", values)})

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        """Wait until the master lists every worker ALIVE; the seconds it took."""
        return wait_for(
            lambda: self.alive_workers() == self.workers,
            timeout_s,
            f"{self.workers} ALIVE Spark workers",
            self.master,
            *self.worker_daemons,
        )

    def driver_conf(self, cores: int = 1) -> dict[str, str]:
        """What a driver (an instance run) sets to run ``cores`` one-core executors here."""
        return {
            "spark.driver.host": self.host,
            "spark.driver.bindAddress": self.host,
            "spark.executor.memory": "512m",
            "spark.executor.cores": "1",
            "spark.cores.max": str(cores),
            # Hold the first job until every executor registered, so the first batches
            # do not all land on whichever came first.
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "30s",
        }

    def stop(self) -> None:
        """Workers first (their executors with them), then the master."""
        for worker in self.worker_daemons:
            worker.stop()
        self.master.stop()
