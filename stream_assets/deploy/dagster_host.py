"""The Dagster host: the code server, the webserver and the daemon as separate processes.

``dg dev`` runs them in one process tree on SQLite, which suits a laptop. Here, as
on a server: ``DAGSTER_HOME`` holds ``infra/deploy/dagster/dagster.yaml`` (run,
event-log and schedule storage in PostgreSQL, the project's run launcher), the
schema is created once by ``dagster instance migrate`` before any process opens
it, then ``dagster code-server`` (the code location, loaded once), ``dagster-
webserver`` (the UI and GraphQL) and ``dagster-daemon`` (the run queue, the
supervisor and other sensors, schedules, run monitoring) start, each a service of
its own; the last two reach the first over gRPC (infra/deploy/dagster/
workspace.yaml says why it is not theirs to start). Runs are children of the code
server: instance runs (their Spark drivers) run on this host.

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
import yaml
from dagster._core.errors import DagsterUserCodeUnreachableError
from dagster._grpc.client import DagsterGrpcClient
from dagster._serdes import deserialize_value
from dagster_shared.error import SerializableErrorInfo

from stream_assets.deploy.daemons import Daemon, DeployError, wait_for
from stream_assets.deploy.env_files import DEPLOY_DIR

_BIN = Path(sys.executable).parent
#: The code location's module, and its name in Dagster (runs record it in their origin).
DEFINITIONS = "stream_assets.definitions"


class DagsterHost:
    """DAGSTER_HOME under ``home``; a code server on ``host:code_server_port``, a webserver on
    ``host:port`` and a daemon, each run with ``env``."""

    def __init__(
        self,
        home: Path,
        port: int,
        env: Mapping[str, str],
        host: str = "127.0.0.1",
        code_server_port: int = 4266,
    ):
        self.home = home.resolve()
        self.dagster_home = self.home / "dagster_home"
        self.port, self.host, self.code_server_port = port, host, code_server_port
        self.env = {**os.environ, **env, "DAGSTER_HOME": str(self.dagster_home)}
        workspace = str(self.dagster_home / "workspace.yaml")
        self.code_server = Daemon(
            "dagster-code-server",
            code_server_argv(host, code_server_port),
            self.home,
            self.dagster_home,
        )
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
        """Write DAGSTER_HOME, create or upgrade the schema once, start the services that
        do not run yet."""
        self.dagster_home.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(DEPLOY_DIR / "dagster" / "dagster.yaml", self.dagster_home / "dagster.yaml")
        workspace = yaml.safe_load((DEPLOY_DIR / "dagster" / "workspace.yaml").read_text())
        for entry in workspace["load_from"]:
            entry["grpc_server"].update(host=self.host, port=self.code_server_port)
        (self.dagster_home / "workspace.yaml").write_text(yaml.safe_dump(workspace))
        migrate = subprocess.run(
            [str(_BIN / "dagster"), "instance", "migrate"],
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        if migrate.returncode != 0:
            raise DeployError(f"dagster instance migrate failed:\n{migrate.stderr[-3000:]}")
        # The code server first: its import is the slowest start here. Until it listens,
        # the webserver shows the location unavailable and the daemon retries it.
        self.code_server.start(self.env)
        self.webserver.start(self.env)
        self.daemon.start(self.env)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/server_info", timeout=5) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Until the code location is loaded, the webserver answers and the daemon's sensor
        loop has heartbeaten. The code's import is what a loaded machine makes slow (25 s
        at load 32, minutes past 40: docs/operating.md, "A slow machine")."""
        started = time.monotonic()
        wait_for(
            lambda: code_location_loaded(self.host, self.code_server_port),
            timeout_s,
            "the Dagster code server",
            self.code_server,
        )
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
        self.code_server.stop()


def code_server_argv(host: str, port: int, module: str = DEFINITIONS) -> list[str]:
    """``dagster code-server start`` serving ``module`` under the location name runs know
    (a test serves a module that wraps the definitions under the same name)."""
    return [
        *(str(_BIN / "dagster"), "code-server", "start"),
        *("-h", host, "-p", str(port)),
        *("-m", module, "--location-name", DEFINITIONS),
    ]


def code_location_loaded(host: str, port: int) -> bool:
    """Whether the code server on ``host:port`` has loaded its code location (it does not
    listen before); raises :class:`DeployError` with the error if loading failed."""
    client = DagsterGrpcClient(port=port, host=host)
    try:
        answer = deserialize_value(client.list_repositories())
    except DagsterUserCodeUnreachableError:
        return False
    if isinstance(answer, SerializableErrorInfo):
        raise DeployError(
            f"the code location {DEFINITIONS} failed to load (fix it, then start again):\n"
            f"{answer.to_string()[-3000:]}"
        )
    return True
