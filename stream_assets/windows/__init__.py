"""Event-time windows and watermarks.

Example::

    >>> from stream_assets.windows import Time, TumblingWindow
    >>> TumblingWindow.of(Time.seconds(10)).assign(25_000)
    [Window(start=20000, end=30000)]
"""

from __future__ import annotations

from stream_assets.windows.assigners import (
    SessionWindow,
    SlidingWindow,
    TumblingWindow,
    Window,
    WindowSpec,
    merge_sessions,
    window_spec_from_dict,
)
from stream_assets.windows.time import Time
from stream_assets.windows.watermark import WatermarkTracker, later, window_closed

__all__ = [
    "SessionWindow",
    "SlidingWindow",
    "Time",
    "TumblingWindow",
    "WatermarkTracker",
    "Window",
    "WindowSpec",
    "later",
    "merge_sessions",
    "window_closed",
    "window_spec_from_dict",
]
