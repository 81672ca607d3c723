"""Impressions joined with clicks: which ad impressions were clicked within the minute.

Two topics of JSON events ``{"ad": ..., "user": ..., "ts": epoch ms}``. A left
join in one-minute tumbling windows on (ad, user): every impression gives one
result per click of the same user on the same ad in its window, or one with
``clicked: false`` when there was none::

    >>> t = build()
    >>> t.source_topics, t.sink_topics
    (('ad-impressions', 'ad-clicks'), ('ad-impressions-clicked',))
"""

from __future__ import annotations

from typing import Any

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.serde import json_deserializer
from stream_assets.windows import Time, TumblingWindow


def _key(event: dict[str, Any]) -> list[Any]:
    return [event["ad"], event["user"]]


def _joined(impression: dict[str, Any], click: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "ad": impression["ad"],
        "user": impression["user"],
        "shown_at": impression["ts"],
        "clicked": click is not None,
        "clicked_at": None if click is None else click["ts"],
    }


def build(
    job_id: str = "ad-join",
    impressions: str = "ad-impressions",
    clicks: str = "ad-clicks",
    sink: str = "ad-impressions-clicked",
    window_s: int = 60,
    lateness_s: float = 5,
    idle_timeout_s: float = 10,
) -> Topology:
    """The ad-join topology."""
    b = StreamBuilder(job_id)
    shown = b.source(impressions, json_deserializer).select_timestamp("ts")
    clicked = b.source(clicks, json_deserializer).select_timestamp("ts")
    (
        shown.left_join(clicked)
        .where(_key)
        .equal_to(_key)
        .window(TumblingWindow.of(Time.seconds(window_s)))
        .water_mark(lateness_s)
        .idle_timeout(idle_timeout_s)
        .apply(_joined)
        .sink(sink, key=lambda r: f"{r['ad']}/{r['user']}")
    )
    return b.build()
