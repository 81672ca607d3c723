"""The Dagster host: the webserver and the daemon as separate processes over one code location.

``dg dev`` runs both in one process tree on SQLite, which suits a laptop. Here, as
on a server: ``DAGSTER_HOME`` holds ``infra/deploy/dagster/dagster.yaml`` (run,
event-log and schedule storage in PostgreSQL, the default run launcher), the
schema is created once by ``dagster instance migrate`` before either process
opens it, then ``dagster-webserver`` (the UI and GraphQL) and ``dagster-daemon``
(the run queue, the supervisor and other sensors, schedules, run monitoring)
start, each a service of its own. Each launches runs from a code server of its
own, as children: instance runs (their Spark drivers) run on this host.

Example::

    >>> dagster = DagsterHost(home, 3300, env)  # doctest: +SKIP
    >>> dagster.start(); dagster.wait_ready()  # doctest: +SKIP
    >>> dagster.instance().get_runs()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from stream_assets.deploy.daemons import Daemon, DeployError, wait_for
from stream_assets.deploy.env_files import DEPLOY_DIR

_BIN = Path(sys.executable).parent


class DagsterHost:
    """DAGSTER_HOME under ``home``, a webserver on ``host:port`` and a daemon, with ``env``."""

    def __init__(self, home: Path, port: int, env: Mapping[str, str], host: str = "127.0.0.1"):
        self.home = home.resolve()
        self.dagster_home = self.home / "dagster_home"
        self.port, self.host = port, host
        self.env = {**os.environ, **env, "DAGSTER_HOME": str(self.dagster_home)}
        workspace = str(self.dagster_home / "workspace.yaml")
        self.webserver = Daemon(
            "dagster-webserver",
            [str(_BIN / "dagster-webserver"), "-h", host, "-p", str(port), "-w", workspace],
            self.home,
            self.dagster_home,
        )
        self.daemon = Daemon(
            "dagster-daemon",
            [str(_BIN / "dagster-daemon"), "run", "-w", workspace],
            self.home,
            self.dagster_home,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Write DAGSTER_HOME, create or upgrade the schema once, start both services."""
        self.dagster_home.mkdir(parents=True, exist_ok=True)
        for name in ("dagster.yaml", "workspace.yaml"):
            shutil.copyfile(DEPLOY_DIR / "dagster" / name, self.dagster_home / name)
        migrate = subprocess.run(
            [str(_BIN / "dagster"), "instance", "migrate"],
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        if migrate.returncode != 0:
            raise DeployError(f"dagster instance migrate failed:\n{migrate.stderr[-3000:]}")
        self.webserver.start(self.env)
        self.daemon.start(self.env)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/server_info", timeout=5) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout_s: float = 180.0) -> float:
        """Until the webserver answers and the daemon's sensor loop has heartbeaten."""
        started = time.monotonic()
        wait_for(self._answers, timeout_s, "the Dagster webserver", self.webserver)
        with self.instance() as instance:

            def sensor_daemon_beats() -> bool:
                return "SENSOR" in instance.get_daemon_heartbeats()

            wait_for(sensor_daemon_beats, timeout_s, "the Dagster daemon's sensors", self.daemon)
        return time.monotonic() - started

    @contextmanager
    def environment(self) -> Iterator[None]:
        """This host's environment in this process, for what reads its config from there
        (the storage's ``{env: ...}`` values, the engine's settings), and only meanwhile."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    @contextmanager
    def instance(self) -> Iterator[dg.DagsterInstance]:
        """This deployment's Dagster instance (its Postgres storage), in this process."""
        with self.environment():
            instance = dg.DagsterInstance.from_config(str(self.dagster_home))
        with instance:
            yield instance

    def stop(self) -> None:
        self.daemon.stop()
        self.webserver.stop()
