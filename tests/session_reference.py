"""Reference answers for activity sessions under a TTL
(:class:`~stream_assets.examples.activity_sessions.ActivitySessions`), from the input alone.

By the documented rules, per key in its own order: the session's timer at
``last + gap`` fires before the key's first record at or after it; the key's
state expires a TTL after the latest of its records and of its timers
(``last + gap + ttl``), and a record at or after that starts the key's total
over; at the end of the input, a session closes if the final watermark reached
its timer (every session, with no watermark given).

    >>> sessions([("a", 0), ("a", 10), ("a", 700), ("a", 2_000)], gap=500, ttl=300)
    {'a': [(2, 0, 10, 2), (1, 700, 700, 3), (1, 2000, 2000, 1)]}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: A summary: (records in the session, first event time, last event time, the key's total).
Summary = tuple[int, int, int, int]


def sessions(
    events: Iterable[tuple[Any, int]], gap: int, ttl: int, final_watermark: int | None = None
) -> dict[Any, list[Summary]]:
    """Per key, its session summaries in order; ``events``: (key, event time), each key's
    events in the order its source queue holds them."""
    out: dict[Any, list[Summary]] = {}
    state: dict[Any, dict[str, Any]] = {}
    for key, t in events:
        s = state.setdefault(key, {"session": None, "total": 0, "expires": None})
        if s["session"] is not None and s["session"][2] + gap <= t:
            out.setdefault(key, []).append((*s["session"], s["total"]))
            s["session"] = None
        if s["expires"] is not None and t >= s["expires"]:
            s["total"] = 0
        records, first = (0, t) if s["session"] is None else s["session"][:2]
        s["session"] = (records + 1, first, t)
        s["total"] += 1
        s["expires"] = t + gap + ttl
    for key, s in state.items():
        if s["session"] is None:
            continue
        if final_watermark is None or s["session"][2] + gap <= final_watermark:
            out.setdefault(key, []).append((*s["session"], s["total"]))
    return out
