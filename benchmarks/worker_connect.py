"""How soon a Python worker Spark starts connects back: plain interpreter vs launcher.

Spark gives the streaming source's runner 10 s from process start to connect
back (``PythonWorkerFactory``, hard-coded), and a stage query whose runner
misses it dies. This plays the JVM's side: a
server socket and a secret, as Spark sets them in the worker's environment.
It starts ``pyspark.sql.streaming.python_streaming_source_runner``

- with the venv's ``python -m`` (baseline, what Spark runs by default), which
  connects after importing pyspark;
- with ``stream-assets-worker-python -m`` (:mod:`stream_assets.runtime.spark.worker_launcher`),
  which connects first and imports after;

and times, from ``Popen``, the authenticated connection (what the 10 s
limit times) and the worker's pid (sent once its imports are done; the JVM
waits for it without a limit). ``--hogs N`` runs N busy-loop processes
throughout, as a loaded machine.

Usage::

    python benchmarks/worker_connect.py [--runs 5] [--hogs 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stream_assets.runtime.spark.worker_launcher import LAUNCHER, frame, read_frame
from tests.integration._load import cpu_hog

RUNNER = "pyspark.sql.streaming.python_streaming_source_runner"
#: Spark's limit on the connection (not on the imports after it).
SPARK_LIMIT_S = 10.0


def start_once(python: str) -> tuple[float, float]:
    """(seconds to the authenticated connection, seconds to the worker's pid)."""
    server = socket.create_server(("127.0.0.1", 0))
    secret = secrets.token_hex(16)
    env = {
        **os.environ,
        "PYTHON_WORKER_FACTORY_PORT": str(server.getsockname()[1]),
        "PYTHON_WORKER_FACTORY_SECRET": secret,
    }
    began = time.perf_counter()
    worker = subprocess.Popen([python, "-m", RUNNER], env=env, stderr=subprocess.DEVNULL)
    try:
        server.settimeout(120)
        conn, _ = server.accept()
        with conn:
            if read_frame(conn).decode() != secret:
                raise RuntimeError("wrong secret")
            connected = time.perf_counter() - began
            conn.sendall(frame(b"ok"))
            conn.settimeout(120)
            (pid,) = struct.unpack("!i", conn.recv(4, socket.MSG_WAITALL))
            if pid != worker.pid:
                raise RuntimeError(f"pid {pid} is not the worker's {worker.pid}")
            return connected, time.perf_counter() - began
    finally:
        worker.kill()
        worker.wait()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hogs", type=int, default=0, help="busy-loop processes alongside")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    python = str(Path(sys.executable))
    launcher = str(Path(sys.executable).parent / LAUNCHER)
    if not os.access(launcher, os.X_OK):
        raise SystemExit(f"{launcher} is missing: install the project (pip install -e .)")
    results: dict[str, dict[str, float]] = {}
    with cpu_hog(args.hogs):
        # Interleaved, so both see the same machine.
        samples: dict[str, list[tuple[float, float]]] = {"python -m": [], LAUNCHER: []}
        for _ in range(args.runs):
            samples["python -m"].append(start_once(python))
            samples[LAUNCHER].append(start_once(launcher))
    for name, runs in samples.items():
        results[name] = {
            "connect_median_s": statistics.median(c for c, _ in runs),
            "connect_max_s": max(c for c, _ in runs),
            "imports_done_median_s": statistics.median(p for _, p in runs),
        }
    base, ours = results["python -m"], results[LAUNCHER]
    ratio = ours["connect_median_s"] / base["connect_median_s"]
    if args.json:
        print(json.dumps({"hogs": args.hogs, "results": results, "connect_ratio": ratio}))
        return
    print(f"{args.runs} starts of {RUNNER} each, {args.hogs} busy-loop processes alongside")
    for name, r in results.items():
        print(
            f"  {name:>28}: connected after {r['connect_median_s']:.3f} s median "
            f"({r['connect_max_s']:.3f} s max; Spark's limit {SPARK_LIMIT_S:.0f} s), "
            f"imports done after {r['imports_done_median_s']:.3f} s"
        )
    print(f"  launcher / baseline, time to connect: {ratio:.3f}")


if __name__ == "__main__":
    main()
