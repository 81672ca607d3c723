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

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from stream_assets.broker import jvm
from stream_assets.broker.jvm import POM as POM
from stream_assets.broker.jvm import BrokerStartError as BrokerStartError
from stream_assets.broker.jvm import Progress as Progress
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.settings import BrokerSettings, RocketMQSettings

CLUSTER = "DefaultCluster"
BROKER_NAME = "broker-a"
_PORT_HINT = (
    "choose other ports with STREAM_ASSETS_BROKER_NAMESRV_PORT / STREAM_ASSETS_BROKER_BROKER_PORT"
)


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


class LocalBroker:
    """Start, stop and inspect the project-local namesrv + broker."""

    def __init__(
        self, settings: BrokerSettings | None = None, progress: Progress = jvm.print_progress
    ) -> None:
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
        return jvm.resolve_classpath(self.home, self.settings.version, self.progress)

    # -- status ------------------------------------------------------------

    def _pid(self, role: str) -> int | None:
        return jvm.read_pid(self._pid_file(role))

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
                "namesrv", jvm.NAMESRV_MAIN, cp, self.settings.namesrv_heap, self._namesrv_conf()
            )
        if status.broker_pid is None:
            spawned["broker"] = self._spawn(
                "broker", jvm.BROKER_MAIN, cp, self.settings.broker_heap, self._broker_conf()
            )
        return self._wait_serving(spawned)

    def stop(self) -> None:
        """SIGTERM the broker then the name server, and wait for both to exit."""
        for role in ("broker", "namesrv"):
            pid = self._pid(role)
            if pid is None:
                self._pid_file(role).unlink(missing_ok=True)
                continue
            jvm.terminate({role: pid}, self.progress)
            self._pid_file(role).unlink(missing_ok=True)

    def _check_port_free(self, port: int, what: str) -> None:
        jvm.check_port_free(self.settings.host, port, what, _PORT_HINT)

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
                **jvm.broker_tuning(
                    max_message_size=self.settings.max_message_size,
                    commitlog_file_size=self.settings.commitlog_file_size,
                    auto_create_topics=self.settings.auto_create_topics,
                ),
            },
        )

    def _write_conf(self, name: str, values: dict[str, object]) -> Path:
        return jvm.write_conf(self.home / "conf" / name, values)

    def _spawn(
        self, role: str, main: str, cp: str, heap: str, conf: Path
    ) -> subprocess.Popen[bytes]:
        spec = jvm.JvmSpec(
            role, main, heap, conf, self.home, self._log_file(role), self._pid_file(role)
        )
        return jvm.spawn_jvm(spec, cp, self.progress)

    def _wait_serving(self, spawned: dict[str, subprocess.Popen[bytes]]) -> BrokerStatus:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            for role in ("namesrv", "broker"):
                if jvm.exited(spawned.get(role), self._pid_file(role)):
                    raise BrokerStartError(
                        f"the {role} JVM exited during start; last lines of "
                        f"{self._log_file(role)}:\n{jvm.tail(self._log_file(role))}"
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
