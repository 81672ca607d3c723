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
from dataclasses import dataclass

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
    more records than its origins hold past their marks, described for a person."""
    found: list[str] = []
    for target, records in _shuffle_queues(admin, shuffle, readable):
        for one in _applied(records):
            if one.n is None or one.refused or not set(one.spans) <= set(sources):
                continue
            routed = sum(
                _routed_words(sources[src], mark, end[0], target, len(shuffle))
                for src, (mark, end) in one.spans.items()
            )
            if one.n > routed:
                record = one.record
                found.append(
                    f"shuffle queue {target} @{record.queue_offset}: origins "
                    f"{ {src: end for src, (_, end) in one.spans.items()} } combined stand for "
                    f"{one.n} records, but only {routed} lie past their marks "
                    f"{ {src: mark for src, (mark, _) in one.spans.items()} } (born "
                    f"{record.born_timestamp}, stored {record.store_timestamp})"
                )
    return found


def replayed_counts(
    admin: RocketMQAdmin, shuffle: TopicLayout, readable: set[str]
) -> tuple[collections.Counter[str], list[str]]:
    """The count per word the keyed rule makes of the shuffle queues on ``readable`` groups,
    and the messages it would refuse (partly applied before): what the keyed state should
    hold if stage 0's messages are right. A count past the input that this replay does
    not make was made by the keyed side."""
    counts: collections.Counter[str] = collections.Counter()
    refused: list[str] = []
    for target, records in _shuffle_queues(admin, shuffle, readable):
        for one in _applied(records):
            if one.refused:
                refused.append(f"shuffle queue {target} @{one.record.queue_offset}")
            for word, n in one.words:
                counts[word] += n
    return counts, refused


#: An origin's high-water mark: (offset, sub-index).
Mark = tuple[int, int]


@dataclass(frozen=True)
class _Applied:
    """A shuffle message the keyed rule applies (or, ``refused``, would fail the step on)."""

    record: Record
    #: Per origin of a combined message or progress mark: the mark before it, its end.
    spans: dict[int, tuple[Mark, Mark]]
    #: What it adds: (word, records), the per-record entries not applied before.
    words: list[tuple[str, int]]
    #: The records a combined message says it stands for (None: not a combined one).
    n: int | None
    refused: bool = False


def _applied(records: list[Record]) -> Iterator[_Applied]:
    """The keyed rule (keyed/batch.py ``apply``) over one shuffle queue's messages in order:
    per-record entries past their origin's mark, a combined message or progress mark whose
    end is past it (across queues: all its origins, or none as a replay)."""
    marks: dict[int, Mark] = {}
    for record in records:
        body = decode(record.body)
        if "recs" in body:
            src = int(body["src"])
            mark, words = marks.get(src, (-1, -1)), []
            for entry in body["recs"]:
                if (int(entry[3]), int(entry[4])) > mark:
                    mark = (int(entry[3]), int(entry[4]))
                    words.append((str(entry[0]), 1))
            marks[src] = mark
            yield _Applied(record, {}, words, None)
            continue
        if "srcs" in body:
            ends = {int(s): (int(off), int(sub)) for s, off, sub, _p in body["srcs"]}
        else:
            ends = {int(body["src"]): (int(body["end"][0]), int(body["end"][1]))}
        spans = {src: (marks.get(src, (-1, -1)), end) for src, end in ends.items()}
        new = [end > mark for mark, end in spans.values()]
        if not any(new):
            continue  # a replay: skipped whole
        comb = body.get("comb")
        n = None if comb is None else int(body["n"])
        if not all(new):
            yield _Applied(record, spans, [], n, refused=True)
            continue
        marks.update(ends)
        yield _Applied(record, spans, [(str(e[0]), int(e[5])) for e in comb or ()], n)


def _routed_words(words: SourceWords, mark: Mark, end: int, target: int, queues: int) -> int:
    total = 0
    for offset in range(mark[0], end + 1):
        for sub, word in enumerate(words.get(offset, ())):
            if (offset, sub) > mark and queue_for_key(encode_key(word), queues) == target:
                total += 1
    return total


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
