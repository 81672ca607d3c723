"""The local Apache RocketMQ: namesrv + broker JVMs from Maven Central artifacts.

Maven resolves (and checksum-verifies) the pinned ``rocketmq-namesrv`` and
``rocketmq-broker`` jars through ``infra/rocketmq/pom.xml``; the two JVMs run
from that classpath with data, logs and pid files under one directory
(``.local/rocketmq`` by default). ``start`` returns only once the broker is
registered and a route query for it answers; it is idempotent; ``stop`` sends
SIGTERM so both flush and persist (consumer offsets included) before exiting.

Example::

    >>> broker = LocalBroker(BrokerSettings())  # doctest: +SKIP
    >>> broker.start()  # doctest: +SKIP
    >>> broker.status().serving  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.settings import PROJECT_ROOT, BrokerSettings, RocketMQSettings

POM = PROJECT_ROOT / "infra" / "rocketmq" / "pom.xml"
CLUSTER = "DefaultCluster"
BROKER_NAME = "broker-a"
_NAMESRV_MAIN = "org.apache.rocketmq.namesrv.NamesrvStartup"
_BROKER_MAIN = "org.apache.rocketmq.broker.BrokerStartup"
_STOP_WAIT_S = 60.0

Progress = Callable[[str], None]


class BrokerStartError(RocketMQError):
    """The local broker could not be started; the message says why."""


@dataclass(frozen=True)
class BrokerStatus:
    """What is running: pids (None if not running) and whether it serves."""

    namesrv_pid: int | None
    broker_pid: int | None
    serving: bool
    namesrv_addr: str

    def describe(self) -> str:
        """One line for a person."""
        if self.serving:
            return (
                f"running: namesrv pid {self.namesrv_pid} at {self.namesrv_addr}, "
                f"broker pid {self.broker_pid}"
            )
        parts = [
            f"namesrv {'pid ' + str(self.namesrv_pid) if self.namesrv_pid else 'stopped'}",
            f"broker {'pid ' + str(self.broker_pid) if self.broker_pid else 'stopped'}",
        ]
        return "not serving: " + ", ".join(parts)


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class LocalBroker:
    """Start, stop and inspect the project-local namesrv + broker."""

    def __init__(self, settings: BrokerSettings | None = None, progress: Progress = _print) -> None:
        self.settings = settings or BrokerSettings()
        self.home = self.settings.resolved_home()
        self.progress = progress

    # -- paths -------------------------------------------------------------

    def _pid_file(self, role: str) -> Path:
        return self.home / "run" / f"{role}.pid"

    def _log_file(self, role: str) -> Path:
        return self.home / "logs" / f"{role}.out"

    def client_settings(self) -> RocketMQSettings:
        """Client settings that point at this broker's name server."""
        return RocketMQSettings(namesrv_addr=self.settings.namesrv_addr)

    # -- classpath ---------------------------------------------------------

    def classpath(self) -> str:
        """The namesrv + broker classpath, resolved once per version through Maven."""
        cp_file = self.home / f"classpath-{self.settings.version}.txt"
        if cp_file.exists():
            cp = cp_file.read_text().strip()
            if cp and all(Path(p).exists() for p in cp.split(os.pathsep)):
                return cp
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerStartError("Maven (mvn) is not on PATH; it resolves the RocketMQ jars")
        self.home.mkdir(parents=True, exist_ok=True)
        self.progress(
            f"resolving Apache RocketMQ {self.settings.version} (namesrv + broker) from Maven "
            "Central; the first run downloads about 100 MB"
        )
        tmp = cp_file.with_suffix(".tmp")
        cmd = [
            mvn,
            "-B",
            "-f",
            str(POM),
            "dependency:build-classpath",
            f"-Drocketmq.version={self.settings.version}",
            f"-Dmdep.outputFile={tmp}",
        ]
        downloaded = 0
        tail: list[str] = []
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail = [*tail[-30:], line.rstrip()]
                if "Downloaded from" in line:
                    downloaded += 1
                    if downloaded % 20 == 0:
                        self.progress(f"  ... {downloaded} artifacts downloaded")
        if proc.returncode != 0 or not tmp.exists():
            raise BrokerStartError(
                "Maven could not resolve the RocketMQ artifacts:\n" + "\n".join(tail)
            )
        if downloaded:
            self.progress(f"  resolved ({downloaded} artifacts downloaded)")
        tmp.replace(cp_file)
        return cp_file.read_text().strip()

    # -- status ------------------------------------------------------------

    def _pid(self, role: str) -> int | None:
        try:
            pid = int(self._pid_file(role).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _alive(pid) and _is_rocketmq(pid) else None

    def _serving(self) -> bool:
        settings = self.client_settings().model_copy(update={"request_timeout_s": 2.0})
        try:
            with RocketMQAdmin(settings) as admin:
                brokers = admin.master_brokers(CLUSTER)
                if BROKER_NAME not in brokers:
                    return False
                # The broker registers a topic named after itself.
                return BROKER_NAME in admin.route(BROKER_NAME).brokers
        except (RocketMQError, ValueError):
            return False

    def status(self) -> BrokerStatus:
        """Which JVMs run and whether the broker answers route queries."""
        return BrokerStatus(
            self._pid("namesrv"),
            self._pid("broker"),
            self._serving(),
            self.settings.namesrv_addr,
        )

    # -- start / stop ------------------------------------------------------

    def start(self) -> BrokerStatus:
        """Start whatever is not running and wait until the broker serves."""
        status = self.status()
        if status.serving:
            self.progress(f"RocketMQ already {status.describe()}")
            return status
        # Check every port before spawning anything: a taken broker port must
        # not leave a freshly started name server behind.
        if status.namesrv_pid is None:
            self._check_port_free(self.settings.namesrv_port, "name server")
        if status.broker_pid is None:
            for what, port in self.settings.broker_ports.items():
                self._check_port_free(port, what)
        cp = self.classpath()
        for sub in ("store", "logs", "run", "conf"):
            (self.home / sub).mkdir(parents=True, exist_ok=True)
        spawned: dict[str, subprocess.Popen[bytes]] = {}
        if status.namesrv_pid is None:
            spawned["namesrv"] = self._spawn(
                "namesrv", _NAMESRV_MAIN, cp, self.settings.namesrv_heap, self._namesrv_conf()
            )
        if status.broker_pid is None:
            spawned["broker"] = self._spawn(
                "broker", _BROKER_MAIN, cp, self.settings.broker_heap, self._broker_conf()
            )
        return self._wait_serving(spawned)

    def stop(self) -> None:
        """SIGTERM the broker then the name server, and wait for both to exit."""
        for role in ("broker", "namesrv"):
            pid = self._pid(role)
            if pid is None:
                self._pid_file(role).unlink(missing_ok=True)
                continue
            self.progress(f"stopping {role} (pid {pid})")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + _STOP_WAIT_S
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                self.progress(f"{role} did not exit in {_STOP_WAIT_S:.0f}s; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self._pid_file(role).unlink(missing_ok=True)

    def _check_port_free(self, port: int, what: str) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.settings.host, port))
            except OSError as exc:
                raise BrokerStartError(
                    f"port {port} ({what}) on {self.settings.host} is already in use by another "
                    f"process ({exc.strerror}); stop that process or choose other ports with "
                    "STREAM_ASSETS_BROKER_NAMESRV_PORT / STREAM_ASSETS_BROKER_BROKER_PORT"
                ) from exc

    def _namesrv_conf(self) -> Path:
        return self._write_conf(
            "namesrv.conf",
            {"listenPort": self.settings.namesrv_port, "bindAddress": self.settings.host},
        )

    def _broker_conf(self) -> Path:
        store = self.home / "store"
        return self._write_conf(
            "broker.conf",
            {
                "brokerClusterName": CLUSTER,
                "brokerName": BROKER_NAME,
                "brokerId": 0,
                "namesrvAddr": self.settings.namesrv_addr,
                "listenPort": self.settings.broker_port,
                "bindAddress": self.settings.host,
                "brokerIP1": self.settings.host,
                "storePathRootDir": store,
                "storePathCommitLog": store / "commitlog",
                "autoCreateTopicEnable": str(self.settings.auto_create_topics).lower(),
                "autoCreateSubscriptionGroup": "true",
                "mappedFileSizeCommitLog": self.settings.commitlog_file_size,
                "maxMessageSize": self.settings.max_message_size,
                "flushConsumerOffsetInterval": 1000,
                # A pull returns at most 32 messages / 256 KiB by default (8 / 64 KiB
                # from disk): one round trip per 32 small messages capped every
                # reader. Raised so one pull can carry a whole reader batch.
                "maxTransferCountOnMessageInMemory": 1024,
                "maxTransferBytesOnMessageInMemory": 4 * 1024 * 1024,
                "maxTransferCountOnMessageInDisk": 1024,
                "maxTransferBytesOnMessageInDisk": 4 * 1024 * 1024,
            },
        )

    def _write_conf(self, name: str, values: dict[str, object]) -> Path:
        path = self.home / "conf" / name
        path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        return path

    def _spawn(
        self, role: str, main: str, cp: str, heap: str, conf: Path
    ) -> subprocess.Popen[bytes]:
        java = (
            str(Path(os.environ["JAVA_HOME"]) / "bin" / "java")
            if "JAVA_HOME" in os.environ
            else "java"
        )
        cmd = [
            java,
            f"-Xms{heap}",
            f"-Xmx{heap}",
            "-XX:+UseG1GC",
            f"-Duser.home={self.home}",  # RocketMQ logs to ${user.home}/logs/rocketmqlogs
            "-Dlogback.statusListenerClass=ch.qos.logback.core.status.NopStatusListener",
            "-cp",
            cp,
            main,
            "-c",
            str(conf),
        ]
        env = {**os.environ, "ROCKETMQ_HOME": str(self.home)}
        self.progress(f"starting {role} ({main.rsplit('.', 1)[-1]}, heap {heap})")
        with self._log_file(role).open("ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # survives the CLI that started it
            )
        self._pid_file(role).write_text(str(proc.pid))
        return proc

    def _wait_serving(self, spawned: dict[str, subprocess.Popen[bytes]]) -> BrokerStatus:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            for role in ("namesrv", "broker"):
                # A JVM we just spawned is judged by its process handle: its
                # /proc cmdline reads empty for a moment after exec, which the
                # pid-file check (made for stale files) would take for "gone".
                proc = spawned.get(role)
                exited = proc.poll() is not None if proc else self._pid(role) is None
                if exited:
                    raise BrokerStartError(
                        f"the {role} JVM exited during start; last lines of "
                        f"{self._log_file(role)}:\n{_tail(self._log_file(role))}"
                    )
            if self._serving():
                status = self.status()
                self.progress(f"RocketMQ {status.describe()}")
                return status
            time.sleep(0.25)
        raise BrokerStartError(
            f"the broker did not serve within {self.settings.start_timeout_s:.0f}s; see "
            f"{self._log_file('broker')} and {self.home / 'logs' / 'rocketmqlogs'}"
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not alive for us.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _is_rocketmq(pid: int) -> bool:
    """Guards against a recycled pid in a stale pid file."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"org.apache.rocketmq" in f.read()
    except OSError:
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
