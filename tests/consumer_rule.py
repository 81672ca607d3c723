"""What docs/guarantees.md tells a consumer of a sink to do, as the tests read sinks.

An exactly-once sink needs none of it: :func:`plain_counts` reads one as a plain
consumer does, and fails on a result seen twice or out of order.

Sinks are at least once and every message carries a deterministic key, its last
one: keep the last copy per message key. For an unwindowed aggregate the key is
``job/operator/<result key>/v<version>/<position>``: per result key the highest
version is the current value, and a body with ``"expired": true`` means the key
is gone (its TTL expired). Works on any :class:`~stream_assets.rocketmq.records.Record`
list: the real broker's or the test driver's.

    >>> from stream_assets.rocketmq.records import Record
    >>> def msg(key: str, body: str) -> Record:
    ...     return Record("out", 0, 0, body.encode(), keys=(key,))
    >>> final_counts([msg("j/s/a/v1/0", '{"key": "a", "count": 1}'),
    ...               msg("j/s/a/v3/0", '{"key": "a", "expired": true}'),
    ...               msg("j/s/b/v2/0", '{"key": "b", "count": 4}')])
    {'b': 4}
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable, Sequence
from typing import Any

from stream_assets.rocketmq.records import Record


def latest_by_message_key(records: Sequence[Record]) -> dict[str, Any]:
    """JSON bodies by the engine's message key (``record.keys[-1]``), the last copy winning."""
    out: dict[str, Any] = {}
    for r in records:
        assert r.keys, f"sink message without a key at {r.topic}[{r.queue_id}]@{r.queue_offset}"
        out[r.keys[-1]] = json.loads(r.body)
    return out


def version_of(message_key: str) -> tuple[str, int]:
    """(result key part, version) of an unwindowed result's message key."""
    result_key, version, _position = message_key.rsplit("/", 2)
    assert version.startswith("v"), f"not an unwindowed result's key: {message_key}"
    return result_key, int(version[1:])


def current_results(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """For an unwindowed sink: per result key, the body of its highest version (a deletion
    included)."""
    best: dict[str, tuple[int, dict[str, Any]]] = {}
    for message_key, body in latest_by_message_key(records).items():
        result_key, number = version_of(message_key)
        if result_key not in best or number > best[result_key][0]:
            best[result_key] = (number, body)
    return {k: body for k, (_, body) in best.items()}


def final_counts(records: Sequence[Record], field: str = "count") -> dict[Any, Any]:
    """For an unwindowed sink: key -> ``field`` of its current result; deleted keys left out."""
    return {v["key"]: v[field] for v in current_results(records).values() if not v.get("expired")}


def plain_counts(records: Sequence[Record], field: str = "count") -> dict[Any, Any]:
    """An exactly-once unwindowed sink as a plain consumer reads it, queue by queue: each
    result once (its engine key unique), each key's ``field`` rising in its queue;
    key -> the last ``field`` seen.

    >>> from stream_assets.rocketmq.records import Record
    >>> def msg(key: str, n: int) -> Record:
    ...     return Record("out", 0, 0, f'{{"key": "a", "count": {n}}}'.encode(), keys=(key,))
    >>> plain_counts([msg("j/s/a/v1/0", 1), msg("j/s/a/v4/0", 3)])
    {'a': 3}
    >>> plain_counts([msg("j/s/a/v1/0", 1), msg("j/s/a/v1/0", 1)])
    Traceback (most recent call last):
    AssertionError: a result was seen twice: ['j/s/a/v1/0']
    """
    keys = [r.keys[-1] for r in records]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    assert not twice, f"a result was seen twice: {twice[:5]}"
    last: dict[Any, Any] = {}
    for r in records:
        value = json.loads(r.body)
        key, n = value["key"], value[field]
        assert key not in last or n > last[key], f"{key}: {field} {n} seen after {last[key]}"
        last[key] = n
    return last


def plain_windows(records: Sequence[Record], field: str = "sum") -> dict[tuple[Any, int, int], Any]:
    """An exactly-once windowed sink as a plain consumer reads it: each window once;
    (key, window start, window end) -> its ``field``.

    >>> from stream_assets.rocketmq.records import Record
    >>> def win(start: int) -> Record:
    ...     body = f'{{"key": "a", "window_start": {start}, "window_end": {start + 10}, "sum": 5}}'
    ...     return Record("out", 0, 0, body.encode())
    >>> plain_windows([win(0), win(10)])
    {('a', 0, 10): 5, ('a', 10, 20): 5}
    >>> plain_windows([win(0), win(0)])
    Traceback (most recent call last):
    AssertionError: window ('a', 0, 10) seen twice
    """
    seen: dict[tuple[Any, int, int], Any] = {}
    for r in records:
        v = json.loads(r.body)
        window = (v["key"], v["window_start"], v["window_end"])
        assert window not in seen, f"window {window} seen twice"
        seen[window] = v[field]
    return seen


def checked_back(record: Record) -> bool:
    """Whether the broker's check-back committed ``record`` (its owner died before ending
    its step): the broker stamps the stored message with how often it asked."""
    return "TRANSACTION_CHECK_TIMES" in record.properties


def plain_copies(
    records: Sequence[Record], sources: Sequence[Sequence[Any]], ident: Callable[[Record], Any]
) -> int:
    """An exactly-once sink before any aggregate as a plain consumer reads it, queue by
    queue: each source record's copy once; each source queue's copies in source order,
    but for those the check-back committed (a dead step's: in the broker's order,
    docs/guarantees.md). ``sources``: each source queue's records in order, as
    ``ident`` names a copy. Returns how many copies the check-back committed.

    >>> from stream_assets.rocketmq.records import Record
    >>> def copy(body: str) -> Record:
    ...     return Record("out", 0, 0, body.encode())
    >>> plain_copies([copy("a1"), copy("b1"), copy("a2")], [["a1", "a2"], ["b1"]],
    ...              lambda r: r.body.decode())
    0
    >>> plain_copies([copy("a2"), copy("a1")], [["a1", "a2"]], lambda r: r.body.decode())
    Traceback (most recent call last):
    AssertionError: source queue 0's copies out of order: ['a2', 'a1']
    """
    seen = [ident(r) for r in records]
    every = [x for queue in sources for x in queue]
    assert collections.Counter(seen) == collections.Counter(every), (
        "a source record copied twice, or never"
    )
    by_owner = [x for x, r in zip(seen, records, strict=True) if not checked_back(r)]
    for q, queue in enumerate(sources):
        rank = {x: i for i, x in enumerate(queue)}
        mine = [x for x in by_owner if x in rank]
        assert mine == sorted(mine, key=rank.__getitem__), (
            f"source queue {q}'s copies out of order: {mine[:5]}"
        )
    return sum(1 for r in records if checked_back(r))
