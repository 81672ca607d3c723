"""Topologies of the ``process()`` integration tests, importable by a driver process by name.

Only the build functions live here: every function the tasks run (the
deserializer, the processors) comes from the installed ``stream_assets``, and
keys and event time are field names, so nothing of this module has to be
shipped to the executors.
"""

from __future__ import annotations

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples.activity_sessions import ActivitySessions
from stream_assets.examples.dedup import FirstWithin
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer


def dedup_and_sessions(
    job_id: str,
    source: str,
    unique_sink: str,
    session_sink: str,
    horizon_ms: int,
    gap_ms: int,
    session_ttl_s: float,
    lateness_s: float,
) -> Topology:
    """One source, one stage 0, two keyed exits.

    Events ``{"id", "device", "t", "n"}`` (``t``: event time, ms): the first event
    of each ``id`` within ``horizon_ms`` goes to ``unique_sink``
    (:class:`FirstWithin`, its state forgotten ``2 * horizon_ms`` after the id's
    latest event), and each ``device``'s sessions of activity (closed by an
    event-time timer ``gap_ms`` after its latest event, state under a TTL of
    ``session_ttl_s``, shorter than the gap) go to ``session_sink``
    (:class:`ActivitySessions`).
    """
    builder = StreamBuilder(job_id)
    events = builder.source(source, json_deserializer).select_timestamp("t")
    # The producer pauses while the instance catches up: its references let the watermark
    # alone move time, so that pause must not count as the sources going idle (which
    # would fire every pending timer: docs/writing-topologies.md, "Idle sources").
    idle_s = 3_600
    (
        events.key_by("id")
        .process(
            FirstWithin(horizon_ms),
            ttl=2 * horizon_ms / 1000,
            water_mark=lateness_s,
            idle_timeout=idle_s,
        )
        .sink(unique_sink)
    )
    (
        events.key_by("device")
        .process(
            ActivitySessions(gap_ms),
            ttl=session_ttl_s,
            water_mark=lateness_s,
            idle_timeout=idle_s,
        )
        .sink(session_sink)
    )
    return builder.build()
