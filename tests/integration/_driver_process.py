"""Run one stream_assets ``Instance`` as a driver process of its own, controlled over stdio.

A test process may already hold a local SparkSession (one per JVM), so an
instance that must talk to another master (``SparkCluster``) or must be
killable as a whole runs here, with its own driver JVM::

    python -m tests.integration._driver_process SPEC.json

SPEC.json::

    {"topology": "pkg.module:attribute",   # a StreamBuilder, a Topology, or a
                                             # function returning either
     "topology_args": [], "topology_kwargs": {},        # optional, for a function
     "sys_path": ["/dir/of/user/module"],  # optional, prepended on this driver only
     "rocketmq": {"namesrv_addr": "127.0.0.1:19876", "access_key": "..."},
     "engine": {"spark_master": "spark://...", "spark_conf": {...}, "state_dir": "..."},
     "group": null, "assignment": {"topic": [0, 1]}, "generation": 0}   # optional

Settings come from the spec only: ``STREAM_ASSETS_ROCKETMQ_*`` and
``STREAM_ASSETS_ENGINE_*`` variables are dropped from this process's
environment before they are built, so a test's environment cannot leak in.
``sys_path`` entries are deliberately not exported to executors: user code
must travel from the driver (DESIGN.md section 3).

Protocol: one JSON object per stdout line. After ``instance.start()`` it writes
``{"event": "started"}``. A line ``await_caught_up [timeout_s]`` on stdin
answers ``{"event": "caught_up", "lag": {...}}`` (or ``"not_caught_up"``). A
line ``stop`` or the end of stdin stops the instance gracefully (the batch in
flight finishes), closes its SparkSession, writes ``{"event": "stopped",
"metrics": {"<stage>": {"batches": n, "totals": {...}, ...}}}`` and exits 0.
Any error writes ``{"event": "error", "error": "..."}`` and exits 1. Anything
else written to stdout (user code, the JVM) is sent to stderr instead.

The client side is :class:`DriverProcess`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from tests.integration._cluster import PROJECT_ROOT, venv_python

# -- the driver side ---------------------------------------------------------------


def _claim_stdout() -> IO[str]:
    """A private handle on the real stdout for events; fd 1 and sys.stdout go to stderr."""
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the driver JVM (launched later) inherits fd 1 too
    sys.stdout = sys.stderr
    return events


def _emit(events: IO[str], event: str, **fields: Any) -> None:
    events.write(json.dumps({"event": event, **fields}, default=str) + "\n")
    events.flush()


def _plain(value: Any) -> Any:
    """JSON-able copy: dataclasses and dicts (any mapping, keys as str), sequences as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _settings(cls: Any, values: Mapping[str, Any]) -> Any:
    """``cls`` (a pydantic BaseSettings) from ``values`` only, never from the environment."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    if prefix:
        for key in [k for k in os.environ if k.upper().startswith(prefix)]:
            del os.environ[key]
    return cls(_env_file=None, _secrets_dir=None, **values)


def _topology(spec: Mapping[str, Any]) -> Any:
    from stream_assets.dsl.builder import StreamBuilder
    from stream_assets.plan.topology import Topology

    module_name, _, attr_path = str(spec["topology"]).partition(":")
    if not attr_path:
        raise ValueError(f"topology {spec['topology']!r}: expected 'module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    if not isinstance(obj, Topology | StreamBuilder) and callable(obj):
        obj = obj(*spec.get("topology_args", []), **spec.get("topology_kwargs", {}))
    if isinstance(obj, StreamBuilder):
        obj = obj.build()
    if not isinstance(obj, Topology):
        raise TypeError(f"{spec['topology']} gave {type(obj).__name__}, not a Topology")
    return obj


def _instance(spec: Mapping[str, Any]) -> Any:
    from stream_assets.runtime.spark.instance import Instance
    from stream_assets.settings import EngineSettings, RocketMQSettings

    # Later entries of sys_path end up behind earlier ones, as on PYTHONPATH.
    for entry in reversed(spec.get("sys_path", [])):
        sys.path.insert(0, str(entry))
    return Instance(
        _topology(spec),
        group=spec.get("group"),
        rocketmq=_settings(RocketMQSettings, spec.get("rocketmq", {})),
        engine=_settings(EngineSettings, spec.get("engine", {})),
        assignment=spec.get("assignment"),
        generation=int(spec.get("generation", 0)),
    )


def _read_commands(commands: queue.Queue[str]) -> None:
    for line in sys.stdin:
        commands.put(line.strip())
    commands.put("stop")  # end of stdin: the controlling test is gone


def main(argv: list[str]) -> int:
    """Run the instance of the spec at ``argv[0]``; see the module docstring."""
    events = _claim_stdout()
    instance: Any = None
    try:
        spec = json.loads(Path(argv[0]).read_text())
        instance = _instance(spec)
        instance.start()
        _emit(events, "started", pid=os.getpid())
        commands: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_read_commands, args=(commands,), daemon=True).start()
        while True:
            try:
                command = commands.get(timeout=0.5)
            except queue.Empty:
                instance.check_failed()  # a dead query ends the process, not a hang
                continue
            verb, _, arg = command.partition(" ")
            if verb == "stop":
                break
            if verb == "await_caught_up":
                try:
                    lag = instance.await_caught_up(float(arg or 120))
                    _emit(events, "caught_up", lag=lag)
                except TimeoutError as exc:
                    _emit(events, "not_caught_up", error=str(exc))
            elif verb:
                _emit(events, "unknown_command", command=command)
        instance.stop()
        metrics = _plain(instance.metrics)
        instance.close()
        instance = None
        _emit(events, "stopped", metrics=metrics)
        return 0
    except BaseException as exc:  # KeyboardInterrupt from PySpark's SIGINT handler too
        traceback.print_exc()
        _emit(events, "error", error=f"{type(exc).__name__}: {exc}")
        if instance is not None:
            with contextlib.suppress(BaseException):
                instance.close()
        return 1


# -- the test side -----------------------------------------------------------------


class DriverProcessError(RuntimeError):
    """The driver process failed, or did not answer in time; carries its stderr tail."""


def _json_default(value: Any) -> Any:
    # SecretStr and Path values of a spec built from settings objects.
    if hasattr(value, "get_secret_value"):
        return value.get_secret_value()
    return str(value)


class DriverProcess:
    """Client of one ``_driver_process`` (its own session: ``kill()`` takes its JVM too).

    Example::

        spec = {"topology": "stream_assets.examples.wordcount:build", ...}
        with DriverProcess(spec) as driver:  # starts it; kills it if still running at exit
            driver.wait_started(120)
            ...
            metrics = driver.stop(120)["metrics"]
    """

    def __init__(
        self, spec: Mapping[str, Any], log_dir: Path | None = None, python: str | None = None
    ) -> None:
        self.spec = dict(spec)
        self.python = python or venv_python()
        self._dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="driver-"))
        self.stderr_path = self._dir / "driver.stderr.log"
        self._popen: subprocess.Popen[str] | None = None
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._spec_path: Path | None = None

    @property
    def pid(self) -> int:
        """The driver's pid (also its process group and session id)."""
        if self._popen is None:
            raise RuntimeError("not started")
        return self._popen.pid

    def start(self) -> DriverProcess:
        """Launch the driver (returns at once; see ``wait_started``). Once only."""
        if self._popen is not None:
            raise RuntimeError("this driver process was started already (the with block starts it)")
        self._dir.mkdir(parents=True, exist_ok=True)
        # The spec may hold credentials: a private file, removed once read.
        fd, name = tempfile.mkstemp(prefix="spec-", suffix=".json", dir=self._dir)
        with os.fdopen(fd, "w") as f:
            json.dump(self.spec, f, default=_json_default)
        self._spec_path = Path(name)
        env = dict(os.environ)
        env["PYSPARK_PYTHON"] = self.python
        # The driver JVM otherwise picks the host's first non-loopback address.
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
        env["PYTHONUNBUFFERED"] = "1"
        with self.stderr_path.open("ab") as stderr:
            self._popen = subprocess.Popen(
                [self.python, "-m", "tests.integration._driver_process", name],
                cwd=PROJECT_ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=True,
            )
        threading.Thread(target=self._read_events, daemon=True).start()
        return self

    def _read_events(self) -> None:
        assert self._popen is not None and self._popen.stdout is not None
        for line in self._popen.stdout:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    self._events.put(event)
        self._events.put(None)

    def stderr_tail(self, lines: int = 60) -> str:
        """The last lines the driver wrote to stderr (Spark, the instance, tracebacks)."""
        if not self.stderr_path.exists():
            return ""
        return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-lines:])

    def _error(self, message: str) -> DriverProcessError:
        return DriverProcessError(
            f"driver {self.spec.get('topology')}: {message}\n"
            f"--- stderr tail ({self.stderr_path}):\n{self.stderr_tail()}"
        )

    def _wait_event(self, *names: str, timeout_s: float) -> dict[str, Any]:
        """The next event named one of ``names``; raises on an error event, exit or timeout."""
        try:
            while True:
                event = self._events.get(timeout=timeout_s)
                if event is None:
                    code = self._popen.wait() if self._popen is not None else None
                    self._events.put(None)  # later waits see the end too
                    raise self._error(f"exited with {code} before {'/'.join(names)}")
                if event.get("event") == "error":
                    raise self._error(f"failed: {event.get('error')}")
                if event.get("event") in names:
                    return event
        except queue.Empty:
            raise self._error(f"no {'/'.join(names)} event within {timeout_s}s") from None

    def _send(self, line: str) -> None:
        if self._popen is None or self._popen.stdin is None or self._popen.stdin.closed:
            raise RuntimeError("not running")
        try:
            self._popen.stdin.write(line + "\n")
            self._popen.stdin.flush()
        except BrokenPipeError:
            raise self._error(f"gone before {line!r}") from None

    def wait_started(self, timeout_s: float = 180.0) -> dict[str, Any]:
        """Wait for the ``started`` event (the instance's queries run)."""
        try:
            return self._wait_event("started", timeout_s=timeout_s)
        finally:
            self._forget_spec()

    def await_caught_up(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Ask the instance to wait until its lag is zero; the ``caught_up`` event."""
        self._send(f"await_caught_up {timeout_s}")
        event = self._wait_event("caught_up", "not_caught_up", timeout_s=timeout_s + 30)
        if event["event"] != "caught_up":
            raise self._error(str(event.get("error")))
        return event

    def stop(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Stop gracefully; returns the ``stopped`` event (with ``metrics``). Kills on timeout."""
        assert self._popen is not None and self._popen.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            self._popen.stdin.write("stop\n")
            self._popen.stdin.close()
        try:
            event = self._wait_event("stopped", timeout_s=timeout_s)
            code = self._popen.wait(timeout=30)
        except (DriverProcessError, subprocess.TimeoutExpired):
            self.kill()
            raise
        if code != 0:
            raise self._error(f"exited with {code} after stopping")
        return event

    def kill(self) -> None:
        """SIGKILL the driver and its JVM (its whole session/process group)."""
        if self._popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signal.SIGKILL)
        self._popen.wait()
        self._forget_spec()

    def _forget_spec(self) -> None:
        if self._spec_path is not None:
            self._spec_path.unlink(missing_ok=True)
            self._spec_path = None

    def __enter__(self) -> DriverProcess:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._popen is not None and self._popen.poll() is None:
            self.kill()
        self._forget_spec()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
