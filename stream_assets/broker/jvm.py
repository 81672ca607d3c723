"""What every local RocketMQ JVM shares: classpath, config files, spawn, pid files, ports.

:class:`~stream_assets.broker.local.LocalBroker` (one name server + one broker)
and :class:`~stream_assets.broker.cluster.LocalCluster` (one name server +
several broker groups) both run the official ``rocketmq-namesrv`` and
``rocketmq-broker`` jars, resolved by Maven through ``infra/rocketmq/pom.xml``,
one JVM per node, each in a session of its own with a pid file beside it.

Example::

    >>> cp = resolve_classpath(Path(".local/rocketmq"), "5.3.3", print)  # doctest: +SKIP
    >>> proc = spawn_jvm(JvmSpec("namesrv", NAMESRV_MAIN, "256m", conf, home, log, pid_file),
    ...                  cp, print)  # doctest: +SKIP
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.settings import PROJECT_ROOT

POM = PROJECT_ROOT / "infra" / "rocketmq" / "pom.xml"
NAMESRV_MAIN = "org.apache.rocketmq.namesrv.NamesrvStartup"
BROKER_MAIN = "org.apache.rocketmq.broker.BrokerStartup"
#: How long a JVM may take to exit after SIGTERM before it is killed.
STOP_WAIT_S = 60.0

Progress = Callable[[str], None]


class BrokerStartError(RocketMQError):
    """A local RocketMQ JVM could not be started; the message says why."""


def print_progress(message: str) -> None:
    """The default progress sink: one line on stderr."""
    print(message, file=sys.stderr, flush=True)


def broker_tuning(
    *, max_message_size: int, commitlog_file_size: int, auto_create_topics: bool
) -> dict[str, object]:
    """The broker.conf keys every local broker gets, so they all behave alike."""
    return {
        "autoCreateTopicEnable": str(auto_create_topics).lower(),
        "autoCreateSubscriptionGroup": "true",
        "mappedFileSizeCommitLog": commitlog_file_size,
        "maxMessageSize": max_message_size,
        "flushConsumerOffsetInterval": 1000,
        # A pull returns at most 32 messages / 256 KiB by default (8 / 64 KiB
        # from disk): one round trip per 32 small messages capped every
        # reader. Raised so one pull can carry a whole reader batch.
        "maxTransferCountOnMessageInMemory": 1024,
        "maxTransferBytesOnMessageInMemory": 4 * 1024 * 1024,
        "maxTransferCountOnMessageInDisk": 1024,
        "maxTransferBytesOnMessageInDisk": 4 * 1024 * 1024,
        # A half message whose producer died is resolved by the broker's check-back
        # (exactly-once sinks): asked after 6 s (the default timeout, kept above the
        # 3 s op-record batching, or committed ones get checked), every 5 s instead
        # of every 30 s. A message still unresolved after transactionCheckMax checks
        # is discarded: 720 lets its resolver be away for an hour, not 7 minutes.
        "transactionTimeOut": 6000,
        "transactionCheckInterval": 5000,
        "transactionCheckMax": 720,
    }


def resolve_classpath(home: Path, version: str, progress: Progress) -> str:
    """The namesrv + broker classpath, resolved once per version through Maven.

    Cached in ``home/classpath-<version>.txt`` while every jar it lists exists.
    """
    cp_file = home / f"classpath-{version}.txt"
    if cp_file.exists():
        cp = cp_file.read_text().strip()
        if cp and all(Path(p).exists() for p in cp.split(os.pathsep)):
            return cp
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerStartError("Maven (mvn) is not on PATH; it resolves the RocketMQ jars")
    home.mkdir(parents=True, exist_ok=True)
    progress(
        f"resolving Apache RocketMQ {version} (namesrv + broker) from Maven "
        "Central; the first run downloads about 100 MB"
    )
    tmp = cp_file.with_suffix(".tmp")
    cmd = [
        mvn,
        "-B",
        "-f",
        str(POM),
        "dependency:build-classpath",
        f"-Drocketmq.version={version}",
        f"-Dmdep.outputFile={tmp}",
    ]
    downloaded = 0
    tail: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = [*tail[-30:], line.rstrip()]
            if "Downloaded from" in line:
                downloaded += 1
                if downloaded % 20 == 0:
                    progress(f"  ... {downloaded} artifacts downloaded")
    if proc.returncode != 0 or not tmp.exists():
        raise BrokerStartError(
            "Maven could not resolve the RocketMQ artifacts:\n" + "\n".join(tail)
        )
    if downloaded:
        progress(f"  resolved ({downloaded} artifacts downloaded)")
    tmp.replace(cp_file)
    return cp_file.read_text().strip()


def write_conf(path: Path, values: Mapping[str, object]) -> Path:
    """Write a RocketMQ ``key=value`` config file (booleans as ``true``/``false``).

    Readable by its owner only: with ACL on, it holds the initial admin's password
    and the brokers' inner credentials.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{k}={_conf_value(v)}\n" for k, v in values.items()))
    os.chmod(path, 0o600)  # a file written before by an older version keeps its mode
    return path


def _conf_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_port_free(host: str, port: int, what: str, hint: str) -> None:
    """Raise :class:`BrokerStartError` naming ``port`` if another process listens on it.

    ``hint`` says how to choose other ports.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise BrokerStartError(
                f"port {port} ({what}) on {host} is already in use by another "
                f"process ({exc.strerror}); stop that process or {hint}" + _ephemeral_hint(port)
            ) from exc


def ephemeral_ports() -> range | None:
    """The ports this machine hands to outgoing connections, or None if it cannot tell.

    A fixed listening port in this range can be taken at any moment by some
    client's local end (Spark, py4j, a gRPC call), so a broker started on one
    fails now and then for no reason of its own: keep fixed ports below it.
    """
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except (OSError, ValueError):
        return None
    return range(int(low), int(high) + 1)


def _ephemeral_hint(port: int) -> str:
    ports = ephemeral_ports()
    if ports is None or port not in ports:
        return ""
    return (
        f" (port {port} lies in this machine's ephemeral range {ports.start}-{ports.stop - 1}, "
        "where outgoing connections take their local ports: choose one below "
        f"{ports.start})"
    )


@dataclass(frozen=True)
class JvmSpec:
    """One RocketMQ JVM: its main class, heap, config file and where it keeps things.

    ``user_home`` becomes the JVM's ``user.home`` and ``ROCKETMQ_HOME``:
    RocketMQ writes its own logs to ``${user.home}/logs/rocketmqlogs``.
    """

    role: str
    main: str
    heap: str
    conf: Path
    user_home: Path
    log_file: Path
    pid_file: Path


def spawn_jvm(spec: JvmSpec, cp: str, progress: Progress) -> subprocess.Popen[bytes]:
    """Start ``spec`` in a session of its own (it outlives its starter) and write its pid file."""
    java = (
        str(Path(os.environ["JAVA_HOME"]) / "bin" / "java") if "JAVA_HOME" in os.environ else "java"
    )
    cmd = [
        java,
        f"-Xms{spec.heap}",
        f"-Xmx{spec.heap}",
        "-XX:+UseG1GC",
        f"-Duser.home={spec.user_home}",  # RocketMQ logs to ${user.home}/logs/rocketmqlogs
        # RocketMQ shades logback: the unshaded class name is not on its classpath.
        "-Dlogback.statusListenerClass="
        "org.apache.rocketmq.logging.ch.qos.logback.core.status.NopStatusListener",
        # The controller's hessian serializer reflects into java.lang (JDK 17 refuses,
        # with eight harmless stack traces, without it).
        "--add-opens",
        "java.base/java.lang=ALL-UNNAMED",
        "-cp",
        cp,
        spec.main,
        "-c",
        str(spec.conf),
    ]
    env = {**os.environ, "ROCKETMQ_HOME": str(spec.user_home)}
    progress(f"starting {spec.role} ({spec.main.rsplit('.', 1)[-1]}, heap {spec.heap})")
    spec.log_file.parent.mkdir(parents=True, exist_ok=True)
    spec.pid_file.parent.mkdir(parents=True, exist_ok=True)
    with spec.log_file.open("ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # survives the CLI that started it
        )
    spec.pid_file.write_text(str(proc.pid))
    return proc


def read_pid(pid_file: Path) -> int | None:
    """The pid in ``pid_file`` if that process lives and is a RocketMQ JVM, else None."""
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if alive(pid) and is_rocketmq(pid) else None


def exited(proc: subprocess.Popen[bytes] | None, pid_file: Path) -> bool:
    """Whether a JVM being started has exited.

    A JVM just spawned is judged by its process handle: its /proc cmdline
    reads empty for a moment after exec, which the pid-file check (made for
    stale files) would take for "gone".
    """
    return proc.poll() is not None if proc else read_pid(pid_file) is None


def terminate(pids: Mapping[str, int], progress: Progress, wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM every ``role -> pid`` at once, wait for all, SIGKILL any left after ``wait_s``."""
    for role, pid in pids.items():
        progress(f"stopping {role} (pid {pid})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for role, pid in pids.items():
        if alive(pid):
            progress(f"{role} did not exit in {wait_s:.0f}s; killing it")
            kill(pid)


def kill(pid: int, wait_s: float = 30.0) -> None:
    """SIGKILL ``pid`` and wait (bounded by ``wait_s``) until it is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while alive(pid):
        if time.monotonic() > deadline:
            raise RocketMQError(f"pid {pid} still runs {wait_s:.0f}s after SIGKILL")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def is_rocketmq(pid: int) -> bool:
    """Guards against a recycled pid in a stale pid file."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"org.apache.rocketmq" in f.read()
    except OSError:
        return False


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` (VmRSS), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of ``path`` (for error messages)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
