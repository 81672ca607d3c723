"""Smoke test of the two-"machine" Spark standalone harness (tests/integration/_cluster.py).

A driver in a subprocess (the test process may already hold a local
SparkSession) runs a 4-partition job whose tasks report their
``SPARK_LOCAL_DIRS`` and pid: both workers' disks must show up. Then worker 0
is killed like a lost machine: none of its processes may survive, the master
must report one ALIVE worker, and a new job must still complete, on worker 1
only. Synchronisation is by events: the master's /json, the driver's output
lines, the driver's executor count.

Run as ``python -m tests.integration.test_cluster_harness MASTER CONF_JSON``,
this module is that driver.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration._cluster import (  # noqa: F401 - spark_cluster is a fixture
    PROJECT_ROOT,
    SparkCluster,
    spark_cluster,
    venv_python,
)

pytestmark = pytest.mark.integration


# -- the driver (subprocess) ---------------------------------------------------------


def _where(_: int) -> tuple[str | None, int]:
    return os.environ.get("SPARK_LOCAL_DIRS"), os.getpid()


def _driver(master: str, conf: dict[str, str]) -> None:
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName("cluster-harness-smoke")
        .config("spark.ui.enabled", "false")
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    sc = spark.sparkContext
    sc.setLogLevel("WARN")

    def executors() -> int:
        return len(sc._jsc.sc().statusTracker().getExecutorInfos()) - 1  # minus the driver

    def report(job: int) -> None:
        began = time.monotonic()
        tasks = sc.parallelize(range(4), 4).map(_where).collect()
        line = {
            "job": job,
            "executors": executors(),
            "tasks": tasks,
            "seconds": time.monotonic() - began,
        }
        print(json.dumps(line), flush=True)

    report(1)
    sys.stdin.readline()  # meanwhile the test kills worker 0
    deadline = time.monotonic() + 60
    while executors() != 1:  # the lost executor is noticed when its connection drops
        if time.monotonic() > deadline:
            raise SystemExit(f"driver still sees {executors()} executors")
        time.sleep(0.1)
    report(2)
    spark.stop()


# -- the test ------------------------------------------------------------------------


def _lines(stream: Any) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _next_json(lines: queue.Queue[str | None], timeout_s: float, stderr: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            tail = "\n".join(stderr.read_text(errors="replace").splitlines()[-40:])
            raise AssertionError(f"no result from the driver; its stderr ({stderr}):\n{tail}")
        if line.startswith("{"):
            return json.loads(line)


def _worker_of(local_dirs: str | None, cluster: SparkCluster) -> int:
    """Which worker's disk a task ran on (its executor's block manager dir is below it)."""
    assert local_dirs, "the task saw no SPARK_LOCAL_DIRS"
    owners = {
        i
        for i in range(cluster.workers)
        if all(Path(d).is_relative_to(cluster.local_dir(i)) for d in local_dirs.split(","))
    }
    assert len(owners) == 1, f"{local_dirs} is not under exactly one worker's local dir"
    return owners.pop()


def test_two_workers_two_disks_and_losing_one(
    spark_cluster: SparkCluster,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    cluster = spark_cluster
    timings: dict[str, float] = {}
    stderr = tmp_path / "driver.stderr.log"
    began = time.monotonic()
    with stderr.open("wb") as err:
        driver = subprocess.Popen(
            [
                venv_python(),
                "-m",
                "tests.integration.test_cluster_harness",
                cluster.master_url,
                json.dumps(cluster.spark_conf()),
            ],
            cwd=PROJECT_ROOT,
            env={**os.environ, "PYSPARK_PYTHON": venv_python()},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    try:
        assert driver.stdout is not None and driver.stdin is not None
        lines = _lines(driver.stdout)

        first = _next_json(lines, 90, stderr)
        timings["driver start + job 1"] = time.monotonic() - began
        assert first["executors"] == 2
        by_worker: dict[int, set[int]] = {0: set(), 1: set()}
        for local_dirs, pid in first["tasks"]:
            by_worker[_worker_of(local_dirs, cluster)].add(pid)
        assert by_worker[0] and by_worker[1], f"tasks ran on one worker only: {first['tasks']}"

        before = {i: cluster.worker_processes(i) for i in (0, 1)}
        for i, procs in before.items():
            print(
                f"worker {i}: "
                + "; ".join(
                    f"{p.role} pid={p.pid} ppid={p.ppid} pgid={p.pgid} sid={p.sid} "
                    f"rss={p.rss_kib // 1024}MiB"
                    for p in procs
                )
            )
            roles = {p.role for p in procs}
            assert {"worker-jvm", "executor-jvm", "python-daemon", "python-worker"} <= roles, procs
            # The Python workers that ran the tasks are among what kill_worker would sweep.
            assert by_worker[i] <= {p.pid for p in procs}

        t = time.monotonic()
        killed = cluster.kill_worker(0)
        timings["kill worker 0"] = time.monotonic() - t
        assert {p.pid for p in killed} == {p.pid for p in before[0]}
        assert cluster.worker_processes(0) == []
        for proc in before[0]:
            stat = Path(f"/proc/{proc.pid}/stat")
            assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"

        t = time.monotonic()
        cluster.wait_ready(workers=1, timeout_s=30)
        timings["master notices the loss"] = time.monotonic() - t
        assert [w["index"] for w in cluster.alive_workers()] == [1]
        assert {p.pid for p in cluster.worker_processes(1)} >= {
            p.pid for p in before[1] if p.role != "python-worker"
        }, "worker 1 lost processes when worker 0 was killed"

        t = time.monotonic()
        driver.stdin.write("go\n")
        driver.stdin.flush()
        second = _next_json(lines, 60, stderr)
        timings["job 2 on the survivor"] = time.monotonic() - t
        assert second["executors"] == 1
        assert {_worker_of(d, cluster) for d, _ in second["tasks"]} == {1}
        driver.stdin.close()
        assert driver.wait(timeout=60) == 0

        # Leave the module's cluster whole again (and show a worker comes back).
        t = time.monotonic()
        cluster.start_worker(0)
        cluster.wait_ready(timeout_s=60)
        timings["worker 0 restarted"] = time.monotonic() - t
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, 9)
            driver.wait()
        print("cluster: " + ", ".join(f"{k} {v:.1f}s" for k, v in cluster.timings.items()))
        print("test: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))


if __name__ == "__main__":
    _driver(sys.argv[1], json.loads(sys.argv[2]))
