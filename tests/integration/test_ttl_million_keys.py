"""State TTL over a million distinct keys: the store holds one TTL's worth, and a restore
from the state topic rebuilds it exactly.

Runs through :class:`~stream_assets.testing.TopologyTestDriver`: the engine's
per-queue core with real RocksDB stores and the real changelog, on an
in-memory broker (no RocketMQ, no Spark). An unwindowed count with
``.ttl(...)`` is fed 1 000 000 distinct keys over an event-time clock that
moves ``RECORDS_PER_MS`` records per millisecond, in chunks; about one record
in ten repeats a key seen up to 1.5 TTLs before, so some repeats find the key
alive (its count goes on) and some find it expired (its count starts over).

After every chunk the expected live keys are computed from the input alone:
a key lives while its latest record is less than the TTL behind the
watermark (the lowest of the source queues' latest event times; no allowed
lateness), and each live key holds exactly three entries (its count, its
expiry time, its expiry index entry). The stores' exact contents are checked
against that, and against a bound from the parameters alone; RocksDB's own
estimate (what ``TaskStats.state_keys`` reports, what monitoring sees) is held to the
same bound.

Only counts of 3 or more reach the sink: a million sink messages would make the
in-memory broker the test's main cost, and the sink is not what is tested here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer
from stream_assets.state import layout as lay
from stream_assets.state.store import QueueStateStore
from stream_assets.testing import TopologyTestDriver
from tests.integration._engine_util import final_counts

pytestmark = pytest.mark.integration

KEYS = 1_000_000
CHUNK_KEYS = 50_000  # new keys per chunk
TTL_MS = 2_000
RECORDS_PER_MS = 10  # the event-time clock: record i is at i // RECORDS_PER_MS
REPEAT = 0.1  # share of records that repeat an earlier key
REPEAT_BACK = int(1.5 * TTL_MS * RECORDS_PER_MS)  # how many keys back a repeat reaches
SOURCE_QUEUES = 2
ELEMENTS_PER_MESSAGE = 100
SINK_FROM = 3  # counts below this are filtered before the sink
#: Entries a live key holds: its count, its expiry time and its expiry index entry.
ENTRIES_PER_KEY = 3
#: A live key had a record in the last TTL_MS ms before the watermark, which trails the
#: newest record by at most ~1 ms (both queues get records every ms): at most this many.
LIVE_BOUND = ENTRIES_PER_KEY * RECORDS_PER_MS * (TTL_MS + 2)


def _topology() -> Topology:
    b = StreamBuilder("ttl-million")
    (
        b.source("in", json_deserializer)
        .flat_map(lambda message: message)  # [[key, event time], ...]
        .select_timestamp(lambda element: element[1])
        .key_by(lambda element: element[0])
        .count()
        # Silent expiry: a deletion per expired key would be a million sink messages.
        .ttl(TTL_MS / 1000, tombstones=False)
        .to_rstream()
        .filter(lambda result: result["count"] >= SINK_FROM)
        .sink("out")
    )
    return b.build()


class _Reference:
    """Per key (count since its state last expired, latest event time), in record order,
    as the TTL contract says: a record at or after its key's expiry starts over."""

    def __init__(self) -> None:
        #: Keys that may still be alive: (count, latest event time).
        self.state: dict[int, tuple[int, int]] = {}
        self.seen: set[int] = set()
        self.restarts = 0

    def add(self, key: int, ts: int) -> None:
        count, last = self.state.get(key, (0, ts))
        if key in self.seen and (key not in self.state or ts >= last + TTL_MS):
            count = 0
            self.restarts += 1
        self.seen.add(key)
        self.state[key] = (count + 1, max(last, ts))

    def live(self, watermark: int) -> dict[int, int]:
        """Keys whose expiry (latest + TTL) the watermark has not reached: their counts.

        The others are forgotten here too: every later record of theirs comes from
        their source queue, at or after its latest event time, so at or after the
        watermark, which passed their expiry: they start over anyway.
        """
        self.state = {k: v for k, v in self.state.items() if v[1] + TTL_MS > watermark}
        return {k: c for k, (c, _last) in self.state.items()}


def _chunks(rnd: random.Random) -> Iterator[list[list[list[int]]]]:
    """Per chunk, per source queue: ``[key, event time]`` elements in clock order."""
    introduced = 0
    record = 0
    while introduced < KEYS:
        per_queue: list[list[list[int]]] = [[] for _ in range(SOURCE_QUEUES)]
        target = min(KEYS, introduced + CHUNK_KEYS)
        while introduced < target:
            if introduced and rnd.random() < REPEAT:
                key = introduced - 1 - rnd.randrange(min(introduced, REPEAT_BACK))
            else:
                key, introduced = introduced, introduced + 1
            # Each key has one source queue, as if produced keyed by it.
            per_queue[key % SOURCE_QUEUES].append([key, record // RECORDS_PER_MS])
            record += 1
        yield per_queue


def _contents(stores: dict[tuple[int, int], QueueStateStore]) -> dict[Any, Any]:
    """Every store's user entries and meta (less where the store was restored to)."""
    out: dict[Any, Any] = {}
    for where, store in sorted(stores.items()):
        meta = store.meta.to_wire()
        meta.pop("log_end", None)
        out[where] = (list(store.items()), meta)
    return out


def test_ttl_keeps_a_million_keys_bounded_and_restores_exactly(report: Any) -> None:
    began = time.monotonic()
    reference = _Reference()
    newest = [-1] * SOURCE_QUEUES  # latest event time piped per source queue
    records = 0
    peak_exact = peak_estimate = 0
    estimates: list[int] = []
    with TopologyTestDriver(
        _topology(), source_queues=SOURCE_QUEUES, shuffle_queues=2, snapshot_every=5
    ) as driver:
        for chunk, per_queue in enumerate(_chunks(random.Random(17))):
            for q, elements in enumerate(per_queue):
                for i in range(0, len(elements), ELEMENTS_PER_MESSAGE):
                    message = elements[i : i + ELEMENTS_PER_MESSAGE]
                    driver.pipe(message, event_time=message[-1][1], queue=q)
                for key, ts in elements:
                    reference.add(key, ts)
                if elements:
                    newest[q] = elements[-1][1]
                records += len(elements)
            driver.advance()
            stores = driver.stores()  # (stage, shuffle queue) -> the queue's RocksDB
            live = reference.live(min(newest))
            exact = sum(s.key_count() for s in stores.values())
            estimate = sum(s.estimated_key_count() for s in stores.values())
            estimates.append(driver.stats[-1].state_keys)
            assert exact == ENTRIES_PER_KEY * len(live), f"chunk {chunk}"
            assert exact <= LIVE_BOUND, f"chunk {chunk}: {exact} entries"
            # What monitoring sees (RocksDB's estimate) is bounded too, not only the truth.
            assert estimate <= LIVE_BOUND, f"chunk {chunk}: estimated {estimate} keys"
            peak_exact, peak_estimate = max(peak_exact, exact), max(peak_estimate, estimate)
        fed_s = time.monotonic() - began

        assert len(reference.seen) == KEYS
        assert sum(s.records_in for s in driver.stats if s.stage == 1) == records
        # The live keys and their counts, read back from the stores.
        final_live = reference.live(min(newest))
        counts = {key: (driver.state(key) or {}).get("count") for key in final_live}
        assert counts == final_live
        plain = sum(1 for s in stores.values() for _ in s.items(lay.PLAIN))
        assert plain == len(final_live)
        # Every life of a key ended by the watermark or by a record after its expiry.
        ended = KEYS + reference.restarts - len(final_live)
        expired = sum(s.expired for s in driver.stats)
        assert ended - reference.restarts <= expired <= ended
        # The sink: a live key's latest result is its count (when it passed the filter).
        sunk = final_counts(driver.output_records())
        high = {k: c for k, c in final_live.items() if c >= SINK_FROM}
        assert high, f"no live key reached a count of {SINK_FROM}"
        assert {k: sunk.get(k) for k in high} == high

        # A kill: the local RocksDB is gone, every queue is rebuilt from the state topic.
        live_contents = _contents(stores)
        restore_began = time.monotonic()
        restored = driver.restore_state()
        restore_s = time.monotonic() - restore_began
        assert _contents(stores) == live_contents
        state_records = len(driver.output_records(driver.topology.state_topics[0]))

    report(
        f"TTL {TTL_MS} ms over {KEYS:,} keys ({records:,} records, {chunk + 1} chunks): "
        f"peak {peak_exact:,} entries (bound {LIVE_BOUND:,}; {len(final_live):,} keys live "
        f"at the end, {len(high)} of them in the sink), RocksDB estimate peak "
        f"{peak_estimate:,}, last per-batch state_keys {estimates[-1]:,}; {expired:,} "
        f"expired by the watermark, {reference.restarts:,} restarts; fed in {fed_s:.1f} s; "
        f"restore of {len(restored)} queues from "
        f"{state_records} state records in {restore_s:.2f} s; "
        f"{time.monotonic() - began:.1f} s in all"
    )
