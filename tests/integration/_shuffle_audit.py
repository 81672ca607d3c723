"""What a WordCount's shuffle queues say when a count went past the input: which pre-combined
message a keyed queue applied although part of its range had been applied before.

A failure message, not a check of its own: the keyed stage applies a combined message whole
when its end is past the origin's high-water mark, so a combined message whose step started
below that mark counts the overlap twice (docs/engine.md, "Pre-shuffle combine"). This
replays that rule over what the broker holds and, for every combined message applied,
compares the records it says it stands for with the words the source queue holds between
the mark and its end, routed to that shuffle queue.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.shuffle_codec import decode, encode_key
from tests.integration._engine_util import unique

#: A source queue's records by offset: each record's words, in order.
SourceWords = Mapping[int, Sequence[str]]


def read_source(
    admin: RocketMQAdmin, layout: TopicLayout, readable: set[str]
) -> dict[int, dict[int, list[str]]]:
    """Per source queue index on a ``readable`` group: offset -> the record's words."""
    reader = QueueReader(admin, group=unique("it-audit-src"))
    try:
        return {
            index: {r.queue_offset: r.body.decode().split() for r in reader.read(q, 0)}
            for index, q in ((i, layout.queue(i)) for i in range(len(layout)))
            if q.broker_name in readable
        }
    finally:
        reader.close()


def overlapping_combines(
    admin: RocketMQAdmin,
    shuffle: TopicLayout,
    sources: Mapping[int, SourceWords],
    readable: set[str],
) -> list[str]:
    """Every combined message of a shuffle queue on a ``readable`` group that stands for
    more records than its origin holds past the mark, described for a person."""
    found: list[str] = []
    for target, records in _shuffle_queues(admin, shuffle, readable):
        found += _audit_queue(target, len(shuffle), records, sources)
    return found


def _audit_queue(
    target: int, shuffle_queues: int, records: list[Record], sources: Mapping[int, SourceWords]
) -> list[str]:
    marks: dict[int, tuple[int, int]] = {}
    found: list[str] = []
    for record in records:
        body = decode(record.body)
        if "srcs" in body:  # pre-combined across a step's source queues: audited whole
            found += _audit_across(target, shuffle_queues, record, body, marks, sources)
            continue
        src = int(body["src"])
        mark = marks.get(src, (-1, -1))
        if "recs" in body:
            for entry in body["recs"]:
                mark = max(mark, (int(entry[3]), int(entry[4])))
        elif tuple(body["end"]) > mark:
            end = (int(body["end"][0]), int(body["end"][1]))
            if "comb" in body and src in sources:
                routed = _routed_words(sources[src], mark, end[0], target, shuffle_queues)
                if int(body["n"]) > routed:
                    found.append(
                        f"shuffle queue {target} @{record.queue_offset}: origin {src} combined "
                        f"to {end} stands for {body['n']} records, but only {routed} lie past "
                        f"the mark {mark} (born {record.born_timestamp}, stored "
                        f"{record.store_timestamp})"
                    )
            mark = end
        marks[src] = mark
    return found


def _audit_across(
    target: int,
    shuffle_queues: int,
    record: Record,
    body: dict[str, Any],
    marks: dict[int, tuple[int, int]],
    sources: Mapping[int, SourceWords],
) -> list[str]:
    ends = {int(s): (int(off), int(sub)) for s, off, sub, _p in body["srcs"]}
    if any(end <= marks.get(src, (-1, -1)) for src, end in ends.items()):
        return []  # a replay: the keyed stage skips it whole (or fails on a partial one)
    routed = 0
    for src, end in ends.items():
        if src in sources:
            routed += _routed_words(
                sources[src], marks.get(src, (-1, -1)), end[0], target, shuffle_queues
            )
        marks[src] = end
    if not set(ends) <= set(sources) or int(body["n"]) <= routed:
        return []
    return [
        f"shuffle queue {target} @{record.queue_offset}: origins {sorted(ends)} combined to "
        f"{ends} stand for {body['n']} records, but only {routed} lie past their marks "
        f"(born {record.born_timestamp}, stored {record.store_timestamp})"
    ]


def _routed_words(
    words: SourceWords, mark: tuple[int, int], end: int, target: int, queues: int
) -> int:
    total = 0
    for offset in range(mark[0], end + 1):
        for sub, word in enumerate(words.get(offset, ())):
            if (offset, sub) > mark and queue_for_key(encode_key(word), queues) == target:
                total += 1
    return total


def replayed_counts(
    admin: RocketMQAdmin, shuffle: TopicLayout, readable: set[str]
) -> tuple[collections.Counter[str], list[str]]:
    """The count per word the keyed rule makes of the shuffle queues on ``readable`` groups
    (each message applied once, in queue order, replays skipped by origin marks), and what
    the rule would refuse (a partly applied message): what the keyed state should hold if
    stage 0's messages are right. A count past the input that this replay does not make
    was made by the keyed side."""
    counts: collections.Counter[str] = collections.Counter()
    refused: list[str] = []
    for target, records in _shuffle_queues(admin, shuffle, readable):
        _replay_queue(target, records, counts, refused)
    return counts, refused


def _shuffle_queues(
    admin: RocketMQAdmin, shuffle: TopicLayout, readable: set[str]
) -> Iterator[tuple[int, list[Record]]]:
    """Each shuffle queue on a ``readable`` group: its index and every record it holds."""
    reader = QueueReader(admin, group=unique("it-audit-shuffle"))
    try:
        for target in range(len(shuffle)):
            queue = shuffle.queue(target)
            if queue.broker_name in readable:
                yield target, list(reader.read(queue, 0))
    finally:
        reader.close()


def _replay_queue(
    target: int, records: list[Record], counts: collections.Counter[str], refused: list[str]
) -> None:
    marks: dict[int, tuple[int, int]] = {}
    for record in records:
        body = decode(record.body)
        if "srcs" in body:
            ends = {int(s): (int(off), int(sub)) for s, off, sub, _p in body["srcs"]}
            new = [end > marks.get(src, (-1, -1)) for src, end in ends.items()]
            if not any(new):
                continue
            if not all(new):
                refused.append(f"shuffle queue {target} @{record.queue_offset}: partly applied")
                continue
            counts.update({str(e[0]): int(e[5]) for e in body["comb"]})
            marks.update(ends)
            continue
        src = int(body["src"])
        mark = marks.get(src, (-1, -1))
        if "recs" in body:
            for entry in body["recs"]:
                if (int(entry[3]), int(entry[4])) > mark:
                    mark = (int(entry[3]), int(entry[4]))
                    counts[str(entry[0])] += 1
        elif tuple(body["end"]) > mark:
            for e in body.get("comb", ()):
                counts[str(e[0])] += int(e[5])
            mark = (int(body["end"][0]), int(body["end"][1]))
        marks[src] = mark
