"""Topologies of the ``process()`` integration tests, importable by a driver process by name.

Only the build functions live here: every function the tasks run (the
deserializer, the processors) comes from the installed ``stream_assets``, and
keys and event time are field names, so nothing of this module has to be
shipped to the executors.
"""

from __future__ import annotations

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples.dedup import FirstWithin
from stream_assets.examples.silence_alert import SilenceAlert
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer


def dedup_and_silence(
    job_id: str,
    source: str,
    unique_sink: str,
    alert_sink: str,
    horizon_ms: int,
    silence_ms: int,
    lateness_s: float,
) -> Topology:
    """One source, one stage 0, two keyed exits.

    Events ``{"id", "device", "t", "n"}`` (``t``: event time, ms): the first event
    of each ``id`` within ``horizon_ms`` goes to ``unique_sink``
    (:class:`FirstWithin`, its state forgotten ``2 * horizon_ms`` after the id's
    latest event), and a ``device`` silent for ``silence_ms`` raises an alert in
    ``alert_sink`` (:class:`SilenceAlert`).
    """
    builder = StreamBuilder(job_id)
    events = builder.source(source, json_deserializer).select_timestamp("t")
    (
        events.key_by("id")
        .process(FirstWithin(horizon_ms), ttl=2 * horizon_ms / 1000, water_mark=lateness_s)
        .sink(unique_sink)
    )
    (
        events.key_by("device")
        .process(SilenceAlert(silence_ms), water_mark=lateness_s)
        .sink(alert_sink)
    )
    return builder.build()
