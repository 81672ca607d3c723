"""Peak memory of a whole instance process tree, and its cold start.

WordCount over ``--lines`` pre-produced lines (``limits.wordcount_bodies``,
``--lines-per-message`` a message, ``--queues`` queues) runs in a fresh child
process (this script with ``--child``): a new Python interpreter, a new
SparkSession, nothing warm. The parent

- samples the resident memory of the child's whole process tree every
  ``--sample-ms`` (from ``/proc``): the Python driver, the Spark driver JVM,
  the Python workers (``pyspark.daemon pyspark.worker`` and its forks) and the
  Python data-source planner processes (``pyspark.sql.worker.*``,
  ``python_streaming_source_runner``); prints the peak of the summed RSS
  (target <= 1.5 GB) split by kind at that moment, each kind's own peak, and
  the peak PSS (shared pages divided among the processes sharing them: forked
  workers share much of the daemon's memory, which the RSS sum counts again);
- times the cold start: ``Popen`` of the child -> the end of its first
  stage-0 micro-batch (``Instance.metrics[0].batches > 0``), and the child's
  own phases (imports, ``Instance.start``).

Usage::

    python benchmarks/footprint.py [--lines 200000] [--trigger-ms 500] [--json]
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the child's phases count from here (before the heavy imports)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KINDS = ("jvm", "python_driver", "python_workers", "python_planners", "other")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MIB = 2**20
_TICKS = os.sysconf("SC_CLK_TCK")


# -- the child: one cold instance --------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """Run WordCount over ``args.topic`` to the end; JSON events on stdout."""
    from benchmarks._engine import engine_from
    from stream_assets.examples import wordcount
    from stream_assets.runtime.spark.instance import Instance
    from stream_assets.settings import RocketMQSettings

    def event(name: str, **data: Any) -> None:
        print(json.dumps({"event": name, "t": time.perf_counter() - _T0, **data}), flush=True)

    event("imported")
    instance = Instance(
        wordcount.build(args.job, args.topic, f"{args.job}-out"),
        rocketmq=RocketMQSettings(),
        engine=engine_from(args),
        progress=lambda _m: None,
    )
    instance.start()
    event("started")
    deadline = time.monotonic() + 600
    while instance.metrics[0].batches == 0:
        instance.check_failed()
        if time.monotonic() > deadline:
            raise TimeoutError("no batch completed in 600 s")
        time.sleep(0.01)
    event("first_batch")
    instance.await_caught_up(1800, poll_s=0.2)
    last = max(m.last_batch_at for m in instance.metrics.values())
    event("caught_up", last_batch_wall=last)
    instance.close()
    event("closed")


# -- the parent: /proc sampling ----------------------------------------------------


def _children_map() -> dict[int, list[int]]:
    """ppid -> pids, for every process now."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def _tree(root: int) -> list[int]:
    children = _children_map()
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def _kind(pid: int, root: int) -> tuple[str, str]:
    """The kind of process ``pid`` is (:data:`KINDS`), and its program (last argument)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "other", "?"
    cmd = " ".join(args)
    program = next((a for a in reversed(args) if a), "?")
    if pid == root:
        return "python_driver", "driver"
    if "java" in args[0]:
        return "jvm", "java"
    if "pyspark.sql.worker" in cmd or "python_streaming_source_runner" in cmd:
        return "python_planners", program
    if "pyspark.daemon" in cmd or "pyspark.worker" in cmd:
        return "python_workers", program
    return "other", Path(program).name  # e.g. the spark-submit shell before it execs the JVM


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def _cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` has used (user + system), from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    # After the command's ")": utime and stime are the 12th and 13th fields there.
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
        for line in f:
            if line.startswith(b"Pss:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class Sampler:
    """Samples the tree under ``root`` until stopped; keeps the peaks."""

    root: int
    every_s: float
    samples: int = 0
    peak_rss: int = 0
    peak_split: dict[str, int] = field(default_factory=dict)
    peak_counts: dict[str, int] = field(default_factory=dict)
    #: At the peak: program -> (processes, RSS bytes).
    peak_programs: dict[str, tuple[int, int]] = field(default_factory=dict)
    peak_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    peak_pss: int = 0
    #: pid -> (kind, CPU seconds at its latest sample): a process that lived and died
    #: between two samples is missed, and one's last CPU after its latest sample too.
    cpu: dict[int, tuple[str, float]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def cpu_by_kind(self) -> dict[str, float]:
        """CPU seconds of the tree so far, by kind (:data:`KINDS`)."""
        out = dict.fromkeys(KINDS, 0.0)
        for kind, seconds in list(self.cpu.values()):
            out[kind] += seconds
        return out

    def run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> None:
        split = dict.fromkeys(KINDS, 0)
        counts = dict.fromkeys(KINDS, 0)
        programs: dict[str, tuple[int, int]] = {}
        pss = 0
        for pid in _tree(self.root):
            # Not cached: a pid's program changes on exec (spark-submit -> java).
            kind, program = _kind(pid, self.root)
            try:
                rss = _rss(pid)
                pss += _pss(pid)
                self.cpu[pid] = (kind, _cpu_s(pid))
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            split[kind] += rss
            counts[kind] += 1
            n, size = programs.get(program, (0, 0))
            programs[program] = (n + 1, size + rss)
        self.samples += 1
        total = sum(split.values())
        if total > self.peak_rss:
            self.peak_rss, self.peak_split, self.peak_counts = total, split, counts
            self.peak_programs = programs
        self.peak_pss = max(self.peak_pss, pss)
        for kind, value in split.items():
            self.peak_by_kind[kind] = max(self.peak_by_kind[kind], value)

    def stop(self) -> None:
        self._stop.set()


def parent(args: argparse.Namespace) -> None:
    """Pre-produce, start the child, sample it, print the figures."""
    from benchmarks._engine import create_topic, engine_from, knobs, unique
    from benchmarks.limits import produce_batched, wordcount_bodies
    from stream_assets.settings import RocketMQSettings

    settings = RocketMQSettings()
    used = {
        **knobs(engine_from(args)),
        "lines": args.lines,
        "lines_per_message": args.lines_per_message,
        "queues": args.queues,
        "sample_ms": args.sample_ms,
    }
    say = (lambda _text: None) if args.json else print
    say("knobs: " + ", ".join(f"{k}={v}" for k, v in used.items()))
    job = unique("bench-footprint")
    topic = f"{job}-in"
    create_topic(settings, topic, args.queues)
    produce_batched(settings, topic, wordcount_bodies(args.lines, args.lines_per_message))
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--job",
        job,
        "--topic",
        topic,
        "--trigger-ms",
        str(args.trigger_ms),
        "--max-records-per-batch",
        str(args.max_records_per_batch),
        "--mode",
        args.mode,
    ]
    spawned = time.perf_counter()
    spawned_wall = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid, args.sample_ms / 1000)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    events: dict[str, dict[str, Any]] = {}
    first_cpu: dict[str, float] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            data = json.loads(line)
        except ValueError:
            print(line, end="", file=sys.stderr)
            continue
        data["seen"] = time.perf_counter() - spawned
        events[data["event"]] = data
        if data["event"] == "first_batch":
            sampler.sample()
            first_cpu = sampler.cpu_by_kind()
    code = proc.wait()
    sampler.stop()
    thread.join()
    if code != 0 or "caught_up" not in events:
        raise SystemExit(f"child failed (exit {code}); events: {events}")
    run_s = events["caught_up"]["last_batch_wall"] - spawned_wall
    figures: dict[str, Any] = {
        "knobs": used,
        "cold_start_s": events["first_batch"]["seen"],
        "child_imports_s": events["imported"]["t"],
        "child_instance_start_s": events["started"]["t"] - events["imported"]["t"],
        "child_first_batch_s": events["first_batch"]["t"] - events["started"]["t"],
        "cold_run_s": run_s,
        "cold_run_lines_per_s": args.lines / run_s,
        "peak_rss_mib": sampler.peak_rss / _MIB,
        "peak_rss_split_mib": {k: v / _MIB for k, v in sampler.peak_split.items()},
        "peak_processes": sampler.peak_counts,
        "peak_programs_mib": {
            k: {"processes": n, "mib": size / _MIB}
            for k, (n, size) in sampler.peak_programs.items()
        },
        "peak_by_kind_mib": {k: v / _MIB for k, v in sampler.peak_by_kind.items()},
        "peak_pss_mib": sampler.peak_pss / _MIB,
        "samples": sampler.samples,
        "cpu_to_first_batch_s": sum(first_cpu.values()),
        "cpu_to_first_batch_by_kind_s": first_cpu,
        "cpu_whole_run_s": sum(sampler.cpu_by_kind().values()),
    }
    if args.json:
        print(json.dumps(figures))
        return
    print(
        f"cold start (process start -> first batch done): {figures['cold_start_s']:.2f} s "
        f"(imports {figures['child_imports_s']:.2f} s, Instance.start "
        f"{figures['child_instance_start_s']:.2f} s, then first batch "
        f"{figures['child_first_batch_s']:.2f} s)"
    )
    print(
        f"CPU over the process tree, process start -> first batch: "
        f"{figures['cpu_to_first_batch_s']:.1f} s (target <= 25): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in first_cpu.items() if v)
        + f"; whole run {figures['cpu_whole_run_s']:.1f} s"
    )
    print(
        f"cold run: {args.lines} lines caught up {run_s:.2f} s after process start "
        f"({figures['cold_run_lines_per_s']:.0f} lines/s including the start)"
    )
    print(
        f"peak RSS of the instance tree: {figures['peak_rss_mib']:.0f} MiB "
        f"(target <= {1.5 * 1000**3 / _MIB:.0f} MiB = 1.5 GB), at that moment: "
        + ", ".join(
            f"{k} {v:.0f} MiB ({sampler.peak_counts[k]} proc)"
            for k, v in figures["peak_rss_split_mib"].items()
            if sampler.peak_counts.get(k)
        )
    )
    print(
        "  by program: "
        + ", ".join(
            f"{k} {n} x = {size / _MIB:.0f} MiB"
            for k, (n, size) in sorted(sampler.peak_programs.items(), key=lambda kv: -kv[1][1])
        )
    )
    print(
        "peak of each kind on its own: "
        + ", ".join(f"{k} {v:.0f} MiB" for k, v in figures["peak_by_kind_mib"].items() if v)
    )
    print(
        f"peak PSS of the tree (shared pages split): {figures['peak_pss_mib']:.0f} MiB; "
        f"{sampler.samples} samples every {args.sample_ms} ms"
    )


def main() -> None:
    from benchmarks._engine import add_engine_flags

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--lines-per-message", type=int, default=20)
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--sample-ms", type=int, default=100)
    parser.add_argument("--json", action="store_true", help="one JSON object of the figures")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    add_engine_flags(parser)
    args = parser.parse_args()
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
