"""The Python Spark starts for its workers: it connects back first, imports after.

Spark gives a Python worker it starts without its daemon (the streaming
source's runner, on the driver) 10 s to connect back. The limit is hard-coded
in ``PythonWorkerFactory`` and times only the accept: once the worker is
connected and authenticated, the JVM waits for it as long as it takes. A plain
``python -m <worker module>`` connects only after importing pyspark, pyarrow
and the rest, which takes longer than 10 s on a machine under heavy load (CI:
load average ~20 on 2 cores). The stage query then dies while INITIALIZING,
and every attempt to start it again can miss the limit the same way.

``stream-assets-worker-python`` is a console script of this package, so it is
installed beside the venv's ``python`` on every machine that has the venv.
The instance gives it to Spark as the workers' Python (:func:`worker_python`).
Before it imports anything but the standard library, it connects and
authenticates. Only then does it run the worker module, and that module finds
the connection already made. Anything that is not such a worker runs
unchanged (the executors' ``pyspark.daemon``, which Spark does not time this
way). No library does this. The wire steps mirror
``pyspark.util.local_connect_and_auth``, and the hand-over replaces the
connect made by ``pyspark.worker_util.get_sock_file_to_executor``, through
which pyspark's worker modules connect (checked on 4.3; a version that
connected otherwise would hang its first query start, and the tests with it).

Example::

    >>> worker_python("/opt/venv/bin/python")  # doctest: +SKIP
    '/opt/venv/bin/stream-assets-worker-python'
    >>> worker_python("python3")  # a bare name is left alone
    'python3'
"""

# Standard library only, and nothing else at import time: every import before
# the connection is made counts against Spark's 10 s.
from __future__ import annotations

import os
import runpy
import socket
import struct
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

#: The console script's name (``[project.scripts]`` in pyproject.toml).
LAUNCHER = "stream-assets-worker-python"

_PORT = "PYTHON_WORKER_FACTORY_PORT"
_SOCK_PATH = "PYTHON_WORKER_FACTORY_SOCK_PATH"
_SECRET = "PYTHON_WORKER_FACTORY_SECRET"


def worker_python(python: str) -> str:
    """The launcher installed beside the interpreter ``python``, else ``python`` itself.

    Idempotent (the launcher's own path gives the launcher). A bare name, or a
    wrapper in a directory without the launcher, is used as given.
    """
    if not os.path.isabs(python):
        return python
    launcher = os.path.join(os.path.dirname(python), LAUNCHER)
    return launcher if os.access(launcher, os.X_OK) else python


def _conn_info(env: Mapping[str, str]) -> str | int | None:
    """Where Spark waits for this worker, as pyspark's worker modules compute it."""
    if _SOCK_PATH in env:
        return env[_SOCK_PATH]
    return int(env[_PORT]) if _PORT in env else None


def frame(data: bytes) -> bytes:
    """``data`` as Spark's socket auth sends it: a 4-byte big-endian length, then the bytes."""
    return struct.pack("!i", len(data)) + data


def read_frame(sock: socket.socket) -> bytes:
    """One :func:`frame` from ``sock``."""

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"connection closed after {len(data)} of {n} bytes")
            data += chunk
        return data

    (length,) = struct.unpack("!i", exactly(4))
    return exactly(length)


def connect_back(env: Mapping[str, str]) -> tuple[socket.socket, str | int] | None:
    """Connect and authenticate to the JVM that started this worker; None if none waits.

    The socket is left as pyspark leaves it: timeout ``SPARK_AUTH_SOCKET_TIMEOUT``.
    """
    conn_info = _conn_info(env)
    if conn_info is None:
        return None
    timeout = int(env.get("SPARK_AUTH_SOCKET_TIMEOUT", "15"))
    secret = env.get(_SECRET)
    if isinstance(conn_info, str) and secret is None:  # a Unix socket: no secret
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(conn_info)
        return sock, conn_info
    if secret is None:
        raise RuntimeError(f"Spark set {_PORT} but not {_SECRET}: cannot authenticate")
    host = "::1" if env.get("SPARK_PREFER_IPV6", "false").lower() == "true" else "127.0.0.1"
    sock = socket.create_connection((host, int(conn_info)), timeout=timeout)
    try:
        # Spark's SocketAuthHelper: the worker sends the secret, Spark answers "ok".
        sock.sendall(frame(secret.encode()))
        if read_frame(sock) != b"ok":
            raise ConnectionError("Spark refused the worker's secret")
    except BaseException:
        sock.close()
        raise
    return sock, conn_info


def hand_over(sock: socket.socket, conn_info: str | int) -> None:
    """Make the worker module's first connect to ``conn_info`` return ``sock``.

    Any other connection (a broadcast's, say) is made as before.
    """
    import pyspark.worker_util as worker_util  # the slow imports, now that Spark waits

    # The name worker_util imported from pyspark.util, which its connect calls.
    namespace = vars(worker_util)
    original = namespace["local_connect_and_auth"]
    pending = [sock]
    buffer = int(os.environ.get("SPARK_BUFFER_SIZE", "65536"))

    def connect(info: str | int | None, secret: str | None) -> tuple[Any, ...]:
        if pending and info == conn_info:
            made = pending.pop()
            return made.makefile("rwb", buffer), made
        return tuple(original(info, secret))

    namespace["local_connect_and_auth"] = connect


def main(argv: list[str] | None = None) -> None:
    """``stream-assets-worker-python -m <module> [args]``: what Spark runs for a worker."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "-m":
        # Spark starts workers as `-m <module>`; anything else is the interpreter's to run.
        os.execv(sys.executable, [sys.executable, *args])
    module, rest = args[1], args[2:]
    connection = connect_back(os.environ)
    if connection is not None:
        hand_over(*connection)
    # As `python -m` does: the working directory first on the path (a console
    # script puts its own bin directory there), the module's args after it.
    sys.path[0] = os.getcwd()
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
