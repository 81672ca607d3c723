"""Scale pause of an in-place rebalance, against a cold instance start measured in the same run.

WordCount with ``--keys`` distinct words (100 000 by default, so every
shuffle queue's RocksDB holds ~keys/queues entries) runs under a real Dagster
daemon (supervisor sensor) in a temporary DAGSTER_HOME, as it would under
``dagster dev``. Measured:

- baseline "cold start": scale 0 -> 1, from the scale job's start until the
  instance runs (a new run: process, SparkSession, queries); a scale that
  restarted instances would pause at least this long;
- the pause of scale 1 -> 3 and 3 -> 2 as the scale job records it
  (``pause_s``: first release to last start of a changed instance), with its
  ratio to the cold start and to the 10 s target;
- each scale's whole duration (warm-up of new instances included);
- kill -9 of one instance's process with 2 000 messages arriving: seconds
  until everything is processed (detection, relaunch, restore, catch-up).

Input keeps flowing during the scales (paced producer).

Usage::

    bash infra/dev.sh bench scale_pause [--keys 100000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._engine import create_topic, produce
from stream_assets.settings import RocketMQSettings

TARGET_PAUSE_S = 10.0


def _scale(instance: Any, name: str, target: int) -> dict[str, Any]:
    from stream_assets.definitions import defs

    config = {"ops": {"scale": {"config": {"topology": name, "target_instances": target}}}}
    result = defs.get_job_def("scale_job").execute_in_process(
        run_config=config, instance=instance, raise_on_error=False
    )
    if not result.success:
        failures = [e.message for e in result.all_events if e.is_failure]
        raise SystemExit(f"scale to {target} failed: {failures}")
    outputs = [e for e in result.all_node_events if e.is_successful_output]
    return {k: v.value for k, v in outputs[0].step_output_data.metadata.items()}


def _paced(settings: RocketMQSettings, topic: str, stop: threading.Event, words: list[str]) -> None:
    from stream_assets.rocketmq.producer import Producer

    rnd = random.Random(3)
    with Producer(settings) as producer:
        while not stop.wait(0.2):
            producer.send(topic, " ".join(rnd.choices(words, k=200)).encode())


def _drained(settings: RocketMQSettings, name: str) -> bool:
    from stream_assets.control.registry import REGISTRY
    from stream_assets.rocketmq.admin import RocketMQAdmin

    topology = REGISTRY[name].topology()
    with RocketMQAdmin(settings) as admin:
        for topic in (*topology.source_topics, *topology.shuffle_topics):
            for q in admin.queues(topic):
                if (admin.query_consumer_offset(name, q) or 0) < admin.max_offset(q):
                    return False
    return True


def _kill9_to_caught_up(
    instance: Any, name: str, settings: RocketMQSettings, words: list[str]
) -> float:
    """kill -9 one instance's process with input waiting; seconds until all of it is processed
    (the supervisor notices, relaunches the index, the new run restores and catches up)."""
    import dagster as dg

    from stream_assets.control.desired_state import heartbeats

    deadline = time.monotonic() + 600
    while not _drained(settings, name):
        if time.monotonic() > deadline:
            raise SystemExit("the topology never caught up before the kill")
        time.sleep(0.5)
    runs = [
        r
        for r in instance.get_runs(filters=dg.RunsFilter(job_name="instance_job"))
        if r.status == dg.DagsterRunStatus.STARTED
    ]
    victim = runs[0]
    pid = heartbeats(instance, [victim.run_id])[victim.run_id].pid
    rnd = random.Random(9)
    burst = [" ".join(rnd.choices(words, k=200)).encode() for _ in range(2_000)]
    began = time.time()
    os.kill(pid, signal.SIGKILL)
    produce(settings, f"{name}-in", burst)
    while not _drained(settings, name):
        if time.monotonic() > deadline + 600:
            raise SystemExit("the topology never caught up after the kill")
        time.sleep(0.5)
    return round(time.time() - began, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = RocketMQSettings()
    import dagster as dg

    from tests.integration._dagster_env import dagster_deployment

    figures: dict[str, Any] = {"keys": args.keys}
    home = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    stop = threading.Event()
    with dagster_deployment(
        home,
        settings.namesrv_addr,
        STREAM_ASSETS_ENGINE_SHUFFLE_QUEUES="8",
        STREAM_ASSETS_SUPERVISOR_INTERVAL_S="2",
    ) as deployment:
        instance, name = deployment.instance, deployment.name
        try:
            source = f"{name}-in"
            create_topic(settings, source, 8)
            words = [f"k{i:06d}" for i in range(args.keys)]
            bodies = [" ".join(words[i : i + 500]).encode() for i in range(0, len(words), 500)]
            produce(settings, source, bodies)
            began = time.time()
            cold = _scale(instance, name, 1)
            figures["cold_start_s"] = round(time.time() - began, 1)
            feeder = threading.Thread(
                target=_paced, args=(settings, source, stop, words), daemon=True
            )
            feeder.start()
            for target in (3, 2):
                before = instance.get_runs_count(dg.RunsFilter(job_name="instance_job"))
                md = _scale(instance, name, target)
                key = f"{'3' if target == 2 else '1'}->{target}"
                after = instance.get_runs_count(dg.RunsFilter(job_name="instance_job"))
                figures[key] = {
                    "pause_s": md["pause_s"],
                    "scale_s": md["scale_s"],
                    "queues_moved": md["queues_moved"],
                    "new_runs": after - before,
                }
            figures["generation"] = cold["generation"]
            stop.set()
            feeder.join(30)
            figures["kill9_to_caught_up_s"] = _kill9_to_caught_up(instance, name, settings, words)
        finally:
            stop.set()
    if args.json:
        print(json.dumps(figures))
        return
    cold_s = figures["cold_start_s"]
    print(f"WordCount, {args.keys} keys, 8 source queues; cold start (scale 0->1): {cold_s} s")
    for key in ("1->3", "3->2"):
        f = figures[key]
        print(
            f"scale {key}: pause {f['pause_s']:.2f} s = {f['pause_s'] / cold_s:.1%} of a cold "
            f"start, {f['pause_s'] / TARGET_PAUSE_S:.0%} of the {TARGET_PAUSE_S:.0f} s target "
            f"({'ok' if f['pause_s'] <= TARGET_PAUSE_S else 'MISSED'}); whole scale "
            f"{f['scale_s']:.1f} s, {f['queues_moved']} queues moved, {f['new_runs']} new runs"
        )
    print(
        f"kill -9 of an instance with 2 000 messages arriving: caught up after "
        f"{figures['kill9_to_caught_up_s']} s ({figures['kill9_to_caught_up_s'] / cold_s:.1f}x "
        "a cold start; the supervisor's detection and relaunch included)"
    )


if __name__ == "__main__":
    main()
