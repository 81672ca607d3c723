"""A real Dagster deployment for tests and benchmarks: DAGSTER_HOME, a topology, a daemon.

The project's instance config in a fresh DAGSTER_HOME, a WordCount registered
under a fresh name (``STREAM_ASSETS_TOPOLOGIES`` points the code location at
``tests.integration._dagster_topologies``), the engine settings as
environment for the runs the daemon launches, the code location's own code
server (``dagster code-server``, as the production-shaped deployment runs it:
its runs are its children) and a running ``dagster-daemon`` (supervisor and
other sensors) that reaches it over gRPC. Everything is undone on exit.

Example::

    >>> with dagster_deployment(tmp, namesrv, STREAM_ASSETS_HEARTBEAT_TIMEOUT_S="20") as d:
    ...     d.instance.get_runs()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import yaml
from dagster._core.scheduler.instigation import InstigatorType, TickStatus

from stream_assets.control.desired_state import DesiredStateStore
from stream_assets.control.registry import REGISTRY, TOPOLOGY_TAG
from stream_assets.deploy.dagster_host import DEFINITIONS, code_location_loaded, code_server_argv
from stream_assets.settings import PROJECT_ROOT
from tests.integration._util import free_port

VENV_BIN = Path(sys.executable).parent


@dataclass
class CodeServer:
    """The code location's ``dagster code-server`` on ``port``, logging to ``log``."""

    port: int
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    #: Every server started, each a session of its own with the run workers it started.
    sessions: list[int] = dataclasses.field(default_factory=list)

    def start(self, module: str = DEFINITIONS) -> None:
        """Start it serving ``module`` (under the location name runs know) and return at
        once: it loads meanwhile (:meth:`wait_loaded`)."""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                code_server_argv("127.0.0.1", self.port, module),
                cwd=PROJECT_ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.sessions.append(self.proc.pid)

    def wait_loaded(self, timeout_s: float = 600.0) -> float:
        """Until its code location is loaded; the seconds that took."""
        began = time.monotonic()
        while not code_location_loaded("127.0.0.1", self.port):
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the code server exited; see {self.log}")
            if time.monotonic() - began > timeout_s:
                raise TimeoutError(f"the code server did not load in {timeout_s:.0f} s")
            time.sleep(0.2)
        return time.monotonic() - began

    def stop(self) -> None:
        """End the server itself, not its session: the run workers it started live on, as
        they do when a deployment's code server restarts."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill_all(self) -> None:
        """End every server's whole session (teardown: the runs were cancelled first)."""
        for session in self.sessions:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(session, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()


@dataclass(frozen=True)
class Deployment:
    """Where the deployment lives, the registered topology's name, the Dagster instance,
    and the code server."""

    home: Path
    name: str
    instance: dg.DagsterInstance
    code_server: CodeServer


@contextlib.contextmanager
def dagster_deployment(
    home: Path, namesrv: str, instance_yaml: str = "", **env: str
) -> Iterator[Deployment]:
    """Set up ``home`` as DAGSTER_HOME and run a daemon over it; ``env`` adds or overrides
    environment variables (engine and supervisor settings) for every process, and
    ``instance_yaml``'s top-level keys replace the project's dagster.yaml's (a fault's
    run launcher)."""
    config = yaml.safe_load((PROJECT_ROOT / "infra" / "dagster" / "dagster.yaml").read_text())
    config.update(yaml.safe_load(instance_yaml) or {})
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    code_port = free_port()
    workspace = home / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - grpc_server:\n      host: 127.0.0.1\n"
        f"      port: {code_port}\n      location_name: {DEFINITIONS}\n"
    )
    run_id = uuid.uuid4().hex[:8]
    variables = {
        "DAGSTER_HOME": str(home),
        "STREAM_ASSETS_TOPOLOGIES": "tests.integration._dagster_topologies",
        "STREAM_ASSETS_TEST_RUN_ID": run_id,
        "STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR": namesrv,
        "STREAM_ASSETS_ENGINE_STATE_DIR": str(home / "state"),
        "STREAM_ASSETS_ENGINE_SHUFFLE_QUEUES": "4",
        "STREAM_ASSETS_ENGINE_SINK_QUEUES": "4",
        "STREAM_ASSETS_ENGINE_TRIGGER_INTERVAL_MS": "300",
        "PYSPARK_PYTHON": sys.executable,
        **env,
    }
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    # This process imported the registry before the env was set: register here too.
    from tests.integration import _dagster_topologies as dt

    name = f"it-dg-{run_id}"
    dt.NAME = name
    REGISTRY[name] = type(dt.REGISTRATIONS[0])(name, dt.build)
    # Create the SQLite storage here, before the daemon opens the same home:
    # two processes initialising it at once can both stamp the alembic version
    # table, and every later open fails (dagster-io/dagster#27390).
    instance = dg.DagsterInstance.get()
    # The daemon launches runs (a test's run launcher is imported there), the code
    # server loads tests' modules: the project on their path.
    process_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")])),
    }
    code_server = CodeServer(code_port, home / "code-server.log", process_env)
    code_server.start()
    log = (home / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [str(VENV_BIN / "dagster-daemon"), "run", "-w", str(workspace)],
        cwd=PROJECT_ROOT,
        env=process_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        code_server.wait_loaded()
        yield Deployment(home, name, instance, code_server)
    finally:
        # Supervision off first, so nothing is relaunched; then the runs are cancelled
        # while the code server, which launched them, can still terminate them; then
        # the daemon and the code server.
        store = DesiredStateStore(instance)
        state = store.get(name)
        if state is not None:
            store.set(name, dataclasses.replace(state, paused=True))
        for run in instance.get_runs(filters=dg.RunsFilter(tags={TOPOLOGY_TAG: name})):
            if not run.is_finished:
                instance.run_coordinator.cancel_run(run.run_id)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
            not r.is_finished
            for r in instance.get_runs(filters=dg.RunsFilter(tags={TOPOLOGY_TAG: name}))
        ):
            time.sleep(0.5)
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
        code_server.kill_all()
        log.close()
        instance.dispose()
        REGISTRY.pop(name, None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tick_times(instance: dg.DagsterInstance, sensor: str, after: float) -> list[float]:
    """When each completed tick of ``sensor`` since ``after`` (epoch seconds) began."""
    times: list[float] = []
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        if state.instigator_name == sensor:
            ticks = instance.get_ticks(
                state.instigator_origin_id,
                state.selector_id,
                after=after,
                statuses=[TickStatus.SUCCESS, TickStatus.SKIPPED],
            )
            times.extend(t.timestamp for t in ticks)
    return times


def sensor_ticks(instance: dg.DagsterInstance, sensor: str, after: float) -> int:
    """Completed ticks of ``sensor`` that began after ``after`` (epoch seconds)."""
    return len(tick_times(instance, sensor, after))
