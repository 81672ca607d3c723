"""Reference answers for event-time operators, by each source queue's own progress.

Computed from the input alone, without the engine: a record is late exactly
when the highest event time its *own source queue* held before it (every
earlier record of that queue, whatever its key) minus the allowed lateness
has reached the end of its window. Which keys went to which stateful queue,
batch sizes and pre-combining play no part.

Input: ``queues`` maps a source queue (any hashable name, e.g. ``(topic,
queue id)``) to its events in offset order. An event is a dict with at least
``"key"``, ``"id"`` and ``"ts"`` (epoch ms).

Example::

    >>> q = {"a": [{"key": "k", "id": 1, "ts": 50_000}, {"key": "k", "id": 2, "ts": 1_000}]}
    >>> [e["id"] for e in late_records(q, lambda e: e["ts"] // 10_000 * 10_000 + 10_000, 5_000)]
    [2]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

Event = dict[str, Any]
Queues = Mapping[Hashable, Sequence[Event]]


def with_progress(queues: Queues) -> Iterator[tuple[Hashable, Event, int | None]]:
    """Every event with its queue's progress before it (None for a queue's first)."""
    for queue, events in queues.items():
        progress: int | None = None
        for event in events:
            yield queue, event, progress
            progress = event["ts"] if progress is None else max(progress, event["ts"])


def late_records(
    queues: Queues, window_end: Callable[[Event], int], lateness_ms: int
) -> list[Event]:
    """The events whose window (ending at ``window_end(event)``) their queue had closed."""
    return [
        e
        for _q, e, progress in with_progress(queues)
        if progress is not None and window_end(e) <= progress - lateness_ms
    ]


def tumbling_end(size_ms: int) -> Callable[[Event], int]:
    """The end of an event's tumbling window of ``size_ms``."""
    return lambda e: e["ts"] - e["ts"] % size_ms + size_ms


def window_join(
    left: Queues, right: Queues, size_ms: int, lateness_ms: int, kind: str
) -> tuple[list[tuple[Any, Any]], list[Event]]:
    """A tumbling-window join: ``(left id, right id)`` pairs of one key and window
    (``(left id, None)`` for an unmatched left record of a ``left`` join), sorted by
    ids; and the late records of both sides."""
    end = tumbling_end(size_ms)
    late_left = late_records(left, end, lateness_ms)
    late_right = late_records(right, end, lateness_ms)
    late_ids = {id(e) for e in late_left + late_right}
    rights: dict[tuple[Any, int], list[Event]] = defaultdict(list)
    for events in right.values():
        for e in events:
            if id(e) not in late_ids:
                rights[(e["key"], end(e))].append(e)
    pairs: list[tuple[Any, Any]] = []
    for events in left.values():
        for e in events:
            if id(e) in late_ids:
                continue
            matched = rights.get((e["key"], end(e)), [])
            pairs.extend((e["id"], r["id"]) for r in matched)
            if not matched and kind == "left":
                pairs.append((e["id"], None))
    return sorted(pairs, key=repr), late_left + late_right


def table_join(
    stream: Queues, table: Queues, lateness_ms: int, kind: str
) -> tuple[list[tuple[Any, Any]], list[Event]]:
    """A stream-table join: ``(stream id, table id)`` for each on-time stream record
    and the on-time table update of its key with the latest event time at or before
    the record's (``(stream id, None)`` in a ``left`` join when there is none); and
    the late records of both sides. Event times of one key's updates must differ."""
    point_end: Callable[[Event], int] = lambda e: e["ts"] + 1  # noqa: E731
    late_stream = late_records(stream, point_end, lateness_ms)
    late_table = late_records(table, point_end, lateness_ms)
    late_ids = {id(e) for e in late_stream + late_table}
    versions: dict[Any, list[Event]] = defaultdict(list)
    for events in table.values():
        for e in events:
            if id(e) not in late_ids:
                versions[e["key"]].append(e)
    pairs: list[tuple[Any, Any]] = []
    for events in stream.values():
        for e in events:
            if id(e) in late_ids:
                continue
            before = [v for v in versions[e["key"]] if v["ts"] <= e["ts"]]
            if before:
                pairs.append((e["id"], max(before, key=lambda v: v["ts"])["id"]))
            elif kind == "left":
                pairs.append((e["id"], None))
    return sorted(pairs, key=repr), late_stream + late_table


def session_counts(
    queues: Queues, gap_ms: int, lateness_ms: int
) -> tuple[dict[tuple[Any, int, int], int], list[Event]]:
    """Session windows: ``{(key, start, end): records}`` and the late records.

    A record's window is ``[ts, ts + gap)``. It is late when it touches a
    session of its key that had closed by its queue's progress minus the
    lateness (a closed session takes nothing more), or when it touches none
    and its own window had closed; otherwise it merges with every session it
    touches. Every record of a key must come from one source queue, as it
    does when producers key messages by the session key: then the order the
    stateful queue meets a key's records in is the input's.
    """
    owner: dict[Any, Hashable] = {}
    sessions: dict[Any, list[list[int]]] = defaultdict(list)  # key -> [[start, end, n]]
    late: list[Event] = []
    for queue, e, progress in with_progress(queues):
        if owner.setdefault(e["key"], queue) != queue:
            raise ValueError(f"key {e['key']!r} comes from two source queues")
        start, end = e["ts"], e["ts"] + gap_ms
        closed_to = None if progress is None else progress - lateness_ms
        touched = [s for s in sessions[e["key"]] if s[0] <= end and start <= s[1]]
        judged = [s[1] for s in touched] or [end]
        if closed_to is not None and min(judged) <= closed_to:
            late.append(e)
            continue
        n = 1
        for s in touched:
            start, end, n = min(start, s[0]), max(end, s[1]), n + s[2]
        kept = [s for s in sessions[e["key"]] if s not in touched]
        sessions[e["key"]] = [*kept, [start, end, n]]
    counts = {(k, s, e): n for k, found in sessions.items() for s, e, n in found}
    return counts, late
