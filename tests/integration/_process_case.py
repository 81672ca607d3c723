"""The case of the live ``process()`` test: its input, and references from the input alone.

Every event is produced keyed by its device (each device, and each id, which
belongs to one device, lands on one source queue) from one thread with a
global event-time clock, so event time rises within every source queue; one
far-future flush event per source queue ends the stream, so the watermark
passes every timer. References follow the timer contract
(stream_assets/operators/processor.py), per key in arrival order, computed
from the source topic as stored.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.runtime.core.shuffle_codec import decode_key
from stream_assets.state import layout as lay
from stream_assets.state.records import Delta, decode_record, is_void
from stream_assets.state.restore import restore_queue
from stream_assets.state.store import QueueStateStore
from tests.integration._engine_util import unique
from tests.session_reference import sessions


def events(rnd: random.Random, count: int, base_ts: int) -> list[dict[str, Any]]:
    """Events on one global clock (steps of 0-11 ms); devices Zipf-like, so rare ones
    go silent; each device has 6 ids, repeated within and beyond the horizon."""
    devices = [f"d{i:02d}" for i in range(24)]
    weights = [1 / (i + 1) for i in range(len(devices))]
    clock = base_ts
    out = []
    for n in range(count):
        clock += rnd.randrange(12)
        device = rnd.choices(devices, weights)[0]
        out.append({"id": f"{device}.{rnd.randrange(6)}", "device": device, "t": clock, "n": n})
    return out


def stored_events(admin: RocketMQAdmin, topic: str) -> dict[str, list[dict[str, Any]]]:
    """The source topic's events per queue (``broker:queue``, every broker group), in
    offset order: the order the engine read them."""
    reader = QueueReader(admin, group=unique("it-proc-source"))
    try:
        return {
            f"{queue.broker_name}:{queue.queue_id}": [
                json.loads(r.body) for r in reader.read(queue, admin.min_offset(queue))
            ]
            for queue in admin.queues(topic)
        }
    finally:
        reader.close()


def dedup_reference(per_queue: dict[str, list[dict[str, Any]]], horizon: int) -> list[int]:
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


def sessions_reference(
    per_queue: dict[str, list[dict[str, Any]]], gap: int, ttl: int, final_watermark: int
) -> list[tuple[str, int, int, int, int]]:
    """(device, records, first, last, total) of every session summary
    (:func:`tests.session_reference.sessions`), flush events included: the final
    watermark closes every session but theirs."""
    events = [(e["device"], e["t"]) for evs in per_queue.values() for e in evs]
    found = sessions(events, gap, ttl, final_watermark)
    return sorted((d, *s) for d, summaries in found.items() for s in summaries)


def state_histories(
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


def restored_keys(
    admin: RocketMQAdmin, job_id: str, operator_id: str, state_topic: str, scratch: Path
) -> dict[bytes, set[object]]:
    """Rebuild every queue of ``state_topic`` into a private store, as an executor that
    gained the queue would; per kind of state (its layout prefix), the keys it holds."""
    reader = QueueReader(admin, group=unique("it-proc-restore"))
    held: dict[bytes, set[object]] = {}
    try:
        for queue_id in range(len(admin.queues(state_topic))):
            with QueueStateStore(scratch, job_id, operator_id, queue_id) as store:
                restore_queue(store, state_topic, queue_id, admin, reader)
                for raw, _ in store.items():
                    kind = raw[:1]
                    if kind == lay.USER:
                        key_bytes = lay.parse_user_key(raw)[0]
                    elif kind in (lay.EXPIRY, lay.EVENT_TIMERS, lay.PROCESSING_TIMERS):
                        key_bytes = lay.key_of_timed(raw)
                    else:
                        key_bytes = raw[1:]
                    held.setdefault(kind, set()).add(decode_key(key_bytes))
    finally:
        reader.close()
    return held


def live_ids(per_queue: dict[str, list[dict[str, Any]]], ttl_ms: int, watermark: int) -> set[str]:
    """The ids whose latest event is less than ``ttl_ms`` behind the final watermark."""
    latest: dict[str, int] = {}
    for events in per_queue.values():
        for e in events:
            latest[e["id"]] = max(latest.get(e["id"], e["t"]), e["t"])
    return {i for i, t in latest.items() if t + ttl_ms > watermark}
