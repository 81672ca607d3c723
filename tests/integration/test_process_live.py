"""The user's stateful logic (``process()``) live on a two-worker Spark cluster, a worker
killed mid-stream: de-duplication with a state TTL and silence alerts from one source.

One stage 0 feeds two keyed exits (``_process_topologies.dedup_and_silence``):
:class:`~stream_assets.examples.dedup.FirstWithin` keyed by ``id`` (event-time
timer + TTL) and :class:`~stream_assets.examples.silence_alert.SilenceAlert`
keyed by ``device``. The instance runs as a driver process of its own against
the standalone master (as in test_cluster.py); each worker keeps its RocksDB
on its own disk, so the queues of the killed worker continue on the other one
from the state topic.

References follow the timer contract (stream_assets/operators/processor.py),
per key in arrival order, computed from the source topic as stored: every
event is produced keyed by its device (each device, and each id, which
belongs to one device, lands on one source queue) from one thread with a
global event-time clock, so event time rises within every source queue; one
far-future flush event per source queue ends the stream, so the watermark
passes every timer.
"""

from __future__ import annotations

import collections
import json
import random
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.settings import RocketMQSettings
from stream_assets.state.records import Delta, decode_record, is_void
from tests.integration._cluster import SparkCluster, spark_cluster  # noqa: F401
from tests.integration._driver_process import DriverProcess
from tests.integration._engine_util import (
    BackgroundProducer,
    Message,
    latest_by_message_key,
    read_topic,
    unique,
    wait_until,
)
from tests.integration._process_topologies import dedup_and_silence

pytestmark = pytest.mark.integration

CATCH_UP_S = 240.0
SOURCE_QUEUES = 4
BASE_TS = 1_700_000_000_000
FLUSH_TS = BASE_TS + 10**9  # past every timer the stream sets
HORIZON_MS = 1_500  # FirstWithin: an id passes again this long after it passed
SILENCE_MS = 1_000  # SilenceAlert: a device silent this long raises an alert
LATENESS_S = 1.0  # water_mark of both processors
EVENTS = 6_000
LIVE_FROM = 2_000  # events before the kill; the rest are produced around it


def _events(rnd: random.Random) -> list[dict[str, Any]]:
    """Events on one global clock (steps of 0-11 ms); devices Zipf-like, so rare ones
    go silent; each device has 6 ids, repeated within and beyond the horizon."""
    devices = [f"d{i:02d}" for i in range(24)]
    weights = [1 / (i + 1) for i in range(len(devices))]
    clock = BASE_TS
    out = []
    for n in range(EVENTS):
        clock += rnd.randrange(12)
        device = rnd.choices(devices, weights)[0]
        out.append({"id": f"{device}.{rnd.randrange(6)}", "device": device, "t": clock, "n": n})
    return out


def _stored_events(records: list[Record]) -> dict[int, list[dict[str, Any]]]:
    """The source topic's events per queue, in offset order (the order the engine read)."""
    per_queue: dict[int, list[tuple[int, dict[str, Any]]]] = collections.defaultdict(list)
    for r in records:
        per_queue[r.queue_id].append((r.queue_offset, json.loads(r.body)))
    return {q: [e for _, e in sorted(rows, key=lambda x: x[0])] for q, rows in per_queue.items()}


def _dedup_reference(per_queue: dict[int, list[dict[str, Any]]], horizon: int) -> list[int]:
    """``n`` of each event FirstWithin passes: an id's first, or one at least ``horizon``
    after the id last passed (its timer, at that time, fires before it)."""
    passed_at: dict[str, int] = {}
    out = []
    for events in per_queue.values():
        for e in events:
            last = passed_at.get(e["id"])
            if last is None or e["t"] >= last + horizon:
                passed_at[e["id"]] = e["t"]
                out.append(e["n"])
    return sorted(out)


def _silence_reference(
    per_queue: dict[int, list[dict[str, Any]]], silence: int, final_watermark: int
) -> list[tuple[str, int]]:
    """(device, last_seen) of each alert: a device's next event came ``silence`` or more
    after its previous one, or the final watermark passed its last timer."""
    last: dict[str, int] = {}
    alerts = []
    for events in per_queue.values():
        for e in events:
            before = last.get(e["device"])
            if before is not None and e["t"] >= before + silence:
                alerts.append((e["device"], before))
            last[e["device"]] = e["t"]
    alerts += [(d, t) for d, t in last.items() if t + silence <= final_watermark]
    return sorted(alerts)


def _state_histories(
    admin: RocketMQAdmin, state_topic: str
) -> dict[str, tuple[list[int], set[str]]]:
    """Per state queue: the seqs of its valid commits in offset order, and their writers."""
    reader = QueueReader(admin, group=unique("it-proc-state"))
    out: dict[str, tuple[list[int], set[str]]] = {}
    try:
        for queue in admin.queues(state_topic):
            seqs: list[int] = []
            writers: set[str] = set()
            for record in reader.read(queue, admin.min_offset(queue)):
                decoded = decode_record(record.body)
                if is_void(decoded, record.queue_offset):
                    continue
                if isinstance(decoded, Delta) and decoded.part == 0:
                    seqs.append(decoded.seq)
                    if decoded.meta is not None:
                        writers.add(decoded.meta.writer)
            out[f"{queue.broker_name}:{queue.queue_id}"] = (seqs, writers)
    finally:
        reader.close()
    return out


def _spec(
    cluster: SparkCluster, settings: RocketMQSettings, kwargs: dict[str, Any]
) -> dict[str, Any]:
    return {
        "topology": "tests.integration._process_topologies:dedup_and_silence",
        "topology_kwargs": kwargs,
        "rocketmq": json.loads(settings.revealed_json()),
        "engine": {
            "spark_master": cluster.master_url,
            "spark_conf": cluster.spark_conf(),
            # state_dir unset: each executor keeps state on its own worker's disk.
            "shuffle_queues": 4,
            "sink_queues": 4,
            "trigger_interval_ms": 300,
            "tick_ms": 500,
            "snapshot_every": 8,
        },
    }


def test_dedup_with_ttl_and_silence_alerts_on_two_workers_with_a_worker_killed(
    spark_cluster: SparkCluster,  # noqa: F811
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    began = time.monotonic()
    job = unique("it-proc")
    source, unique_sink, alert_sink = f"{job}-src", f"{job}-unique", f"{job}-alerts"
    admin.create_topic(source, SOURCE_QUEUES)
    settings = RocketMQSettings.model_validate(
        {
            **json.loads(client_settings.revealed_json()),
            "send_retries": 5,
            "producer_group": f"it-proc-{uuid.uuid4().hex[:6]}",
        }
    )
    kwargs = {
        "job_id": job,
        "source": source,
        "unique_sink": unique_sink,
        "alert_sink": alert_sink,
        "horizon_ms": HORIZON_MS,
        "silence_ms": SILENCE_MS,
        "lateness_s": LATENESS_S,
    }
    topology = dedup_and_silence(**kwargs)  # type: ignore[arg-type]
    events = _events(random.Random(29))
    # Keyed by device: a device (and each of its ids) on one source queue, in order.
    messages = [Message(json.dumps(e).encode(), key=e["device"]) for e in events]
    messages += [
        Message(
            json.dumps(
                {"id": f"flush-{q}", "device": f"flush-{q}", "t": FLUSH_TS, "n": -1 - q}
            ).encode(),
            queue_id=q,
        )
        for q in range(SOURCE_QUEUES)
    ]

    def outputs(topic: str) -> list[dict[str, Any]]:
        return list(latest_by_message_key(read_topic(admin, topic)).values())

    with DriverProcess(
        _spec(spark_cluster, settings, kwargs), log_dir=tmp_path / "driver"
    ) as driver:
        driver.wait_started(240)
        started_s = time.monotonic() - began
        # One thread: every queue gets its events in clock order. It holds back after
        # LIVE_FROM until both executors hold state for the queues they ran.
        producer = BackgroundProducer(settings, source, messages, threads=1, pause_after=LIVE_FROM)
        producer.start()
        wait_until(lambda: producer.sent >= LIVE_FROM, 60, "the first events sent")
        driver.await_caught_up(CATCH_UP_S)
        producer.resume()
        # Worker 0 dies while the rest of the stream is being produced and processed.
        killed = spark_cluster.kill_worker(0)
        sent_at_kill = producer.sent
        assert killed, "worker 0 had no processes to kill"
        assert sent_at_kill < len(messages), "the stream was over before the kill"
        spark_cluster.wait_ready(workers=1, timeout_s=60)
        producer.join(120)

        stored = _stored_events(read_topic(admin, source))
        expected_unique = _dedup_reference(stored, HORIZON_MS)
        final_watermark = FLUSH_TS - int(LATENESS_S * 1000)
        expected_alerts = _silence_reference(stored, SILENCE_MS, final_watermark)
        wait_until(
            lambda: (
                len(outputs(unique_sink)) >= len(expected_unique)
                and len(outputs(alert_sink)) >= len(expected_alerts)
            ),
            CATCH_UP_S,
            "every unique event and every alert",
            poll_s=1.0,
        )
        driver.await_caught_up(CATCH_UP_S)
        metrics = driver.stop(180)["metrics"]

    # The reference's premises: each key from one source queue, event time rising in it.
    assert {e["n"] for evs in stored.values() for e in evs} == {
        json.loads(m.body)["n"] for m in messages
    }
    for key in ("id", "device"):
        homes = collections.defaultdict(set)
        for q, evs in stored.items():
            for e in evs:
                homes[e[key]].add(q)
        assert all(len(qs) == 1 for qs in homes.values()), key
    for q, evs in stored.items():
        assert [e["t"] for e in evs] == sorted(e["t"] for e in evs), f"queue {q}"

    uniques = outputs(unique_sink)
    assert sorted(e["n"] for e in uniques) == expected_unique
    alerts = outputs(alert_sink)
    assert sorted((a["device"], a["last_seen"]) for a in alerts) == expected_alerts
    assert all(a["silent_at"] == a["last_seen"] + SILENCE_MS for a in alerts)
    assert read_topic(admin, topology.dead_letter_topic) == []
    for stage in ("1", "2"):
        assert metrics[stage]["totals"]["late"] == 0, metrics[stage]
        assert metrics[stage]["totals"]["dead_letters"] == 0, metrics[stage]
    assert metrics["1"]["totals"]["expired"] > 0, "the dedup state's TTL never expired a key"
    # Each state queue's valid history: commits 1, 2, 3, ... from one writer.
    for state_topic in topology.state_topics:
        histories = _state_histories(admin, state_topic)
        assert any(seqs for seqs, _ in histories.values()), f"{state_topic}: no state written"
        for queue, (seqs, writers) in histories.items():
            assert seqs == list(range(1, len(seqs) + 1)), f"{state_topic}[{queue}]: {seqs}"
            assert len(writers) <= 1, f"{state_topic}[{queue}]: {writers}"

    totals = {s: metrics[s]["totals"] for s in ("1", "2")}
    report(
        f"dedup + silence on 2 workers, worker 0 killed after {sent_at_kill}/{len(messages)} "
        f"sent: {len(expected_unique)} unique of {len(events)} events, "
        f"{len(expected_alerts)} alerts; dedup expired {int(totals['1']['expired'])} keys; "
        f"restores {int(totals['1']['restores'])}+{int(totals['2']['restores'])}, "
        f"catch-ups {int(totals['1']['catch_ups'])}+{int(totals['2']['catch_ups'])}; "
        f"driver up in {started_s:.1f} s, {time.monotonic() - began:.1f} s in all"
    )
