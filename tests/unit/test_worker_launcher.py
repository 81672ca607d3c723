"""The worker launcher connects back before the worker module runs, and hands the connection over.

The test plays the JVM's side (a server socket and a secret in the worker's
environment, as ``PythonWorkerFactory`` sets them) and starts the installed
``stream-assets-worker-python`` as Spark would, ``-m <module>``.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stream_assets.runtime.spark.worker_launcher import LAUNCHER, frame, read_frame, worker_python

INSTALLED = Path(sys.executable).parent / LAUNCHER

#: A worker module that waits for a line on stdin before anything else (the
#: test's stand-in for slow imports), then connects as every pyspark worker does.
HELD_WORKER = """
import sys
sys.stdin.readline()
from pyspark.worker_util import get_sock_file_to_executor
with get_sock_file_to_executor(timeout=None) as sock_file:
    sock_file.write(b"ran " + " ".join(sys.argv[1:]).encode())
    sock_file.flush()
"""


@pytest.fixture()
def jvm() -> Iterator[tuple[socket.socket, str]]:
    """A listening socket and the secret a worker must send."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(60)
    yield server, secrets.token_hex(8)
    server.close()


def _start(
    args: list[str], cwd: Path, env: dict[str, str], stdin: int | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(INSTALLED), *args],
        cwd=cwd,
        env={**os.environ, **env},
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_the_launcher_is_installed_beside_the_interpreter() -> None:
    assert os.access(INSTALLED, os.X_OK), f"{INSTALLED} is missing: pip install -e . creates it"
    assert worker_python(sys.executable) == str(INSTALLED)


def test_the_launcher_connects_before_the_module_runs_and_the_module_gets_that_connection(
    jvm: tuple[socket.socket, str], tmp_path: Path
) -> None:
    server, secret = jvm
    (tmp_path / "held_worker.py").write_text(HELD_WORKER)
    env = {
        "PYTHON_WORKER_FACTORY_PORT": str(server.getsockname()[1]),
        "PYTHON_WORKER_FACTORY_SECRET": secret,
    }
    worker = _start(["-m", "held_worker", "a", "b"], tmp_path, env, stdin=subprocess.PIPE)
    try:
        # The module is still held on stdin, yet the worker is connected and authenticated.
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            assert read_frame(conn).decode() == secret
            conn.sendall(frame(b"ok"))
            assert worker.poll() is None
            assert worker.stdin is not None
            worker.stdin.write(b"go\n")
            worker.stdin.close()
            # Then the module's own connect returns this connection: its pid, its data.
            (pid,) = struct.unpack("!i", conn.recv(4, socket.MSG_WAITALL))
            assert pid == worker.pid
            assert conn.recv(len(b"ran a b"), socket.MSG_WAITALL) == b"ran a b"
        assert worker.wait(60) == 0, worker.stderr.read() if worker.stderr else ""
    finally:
        worker.kill()
        worker.wait()


def test_a_refused_secret_fails_the_worker_with_a_clear_error(
    jvm: tuple[socket.socket, str], tmp_path: Path
) -> None:
    server, secret = jvm
    env = {
        "PYTHON_WORKER_FACTORY_PORT": str(server.getsockname()[1]),
        "PYTHON_WORKER_FACTORY_SECRET": secret,
    }
    worker = _start(["-m", "never_imported"], tmp_path, env)
    conn, _ = server.accept()
    with conn:
        read_frame(conn)
        conn.sendall(frame(b"no"))
        _, err = worker.communicate(timeout=60)
    assert worker.returncode != 0
    assert b"Spark refused the worker's secret" in err


def test_without_spark_waiting_the_module_runs_as_with_python_m(tmp_path: Path) -> None:
    """The executors' ``pyspark.daemon`` case: nothing to connect to, the module just runs."""
    (tmp_path / "plain.py").write_text(
        "import os, sys\nprint(__name__, sys.argv[1:], sys.path[0] == os.getcwd())\n"
    )
    worker = _start(["-m", "plain", "x"], tmp_path, {})
    out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert out.decode().split("\n")[0] == "__main__ ['x'] True"


def test_anything_but_a_module_start_is_the_interpreters_to_run(tmp_path: Path) -> None:
    worker = _start(["-c", "print(6 * 7)"], tmp_path, {})
    out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert out.decode().strip() == "42"


def test_worker_python_picks_the_launcher_beside_the_interpreter(tmp_path: Path) -> None:
    venv, bare = tmp_path / "venv" / "bin", tmp_path / "wrapper"
    venv.mkdir(parents=True)
    bare.mkdir()
    (venv / LAUNCHER).write_text("#!/bin/sh\n")
    (venv / LAUNCHER).chmod(0o755)
    assert worker_python(str(venv / "python")) == str(venv / LAUNCHER)
    assert worker_python(str(venv / LAUNCHER)) == str(venv / LAUNCHER)
    assert worker_python(str(bare / "python")) == str(bare / "python")
    assert worker_python("python3") == "python3"
    (venv / LAUNCHER).chmod(0o644)  # not executable: not a launcher
    assert worker_python(str(venv / "python")) == str(venv / "python")
