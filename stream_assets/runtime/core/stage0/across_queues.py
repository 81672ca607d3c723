"""One step of several source queues: their pre-combined partials as one message per shuffle queue.

A real-time task reads a few source queues each step. Sent per source queue,
a word that four of them read became four partials: four entries packed,
sent, stored by the broker, read, unpacked and merged by the keyed stage, on
a machine whose cores the broker shares. Merged across the queues of the
step, it is one entry whose message names every origin it stands for
(:func:`~stream_assets.runtime.core.shuffle_codec.encode_across`).

Where: the queues whose batch went wholly pre-combined, into a count that
judges no time (no window, TTL or timer: nothing depends on one origin's
progress), when the merged partials pack and each fits one message.
Anything else goes per queue, as every batch did before (``send_all``).

Exactly once, as with one origin: a queue's range is pre-combined only where
no earlier attempt can have sent it (``StageContext.may_combine``), so a
keyed queue has applied all the origins of such a message or none of them;
a replay of it (the same ranges again, combined across or per queue, or per
record after a crash) ends each origin where it ended, and is skipped.

Example::

    >>> from stream_assets.examples import wordcount
    >>> from stream_assets.runtime.core.context import StageContext, TaskStats
    >>> from stream_assets.runtime.core.shuffle_codec import decode
    >>> ctx = StageContext.of(wordcount.build(), 0, shuffle_queues=1, source_queues=(0, 1))
    >>> from stream_assets.runtime.core.stage0.count_path import CountPath
    >>> class Out:
    ...     def send(self, topic, body, queue_id, key): self.body = body
    >>> out, batches = Out(), []
    >>> for q, line in ((0, "to be"), (1, "be")):
    ...     shuffle = ShuffleOut(ctx, out, TaskStats(queue_id=q), src=q, combine=True)
    ...     counting = CountPath.of(ctx.stage, shuffle)
    ...     counting.take(line, 7, offset=0)
    ...     batches.append((shuffle, counting, 0))
    >>> send_across(batches)
    {0, 1}
    >>> sorted((e[0], e[3]) for e in decode(out.body)["comb"]), decode(out.body)["n"]
    ([('be', [2]), ('to', [1])], 3)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from stream_assets.runtime.core.shuffle_codec import encode_across
from stream_assets.runtime.core.stage0.count_path import CountPath, merge_counts
from stream_assets.runtime.core.stage0.shuffle_out import WHOLE_OFFSET, ShuffleOut
from stream_assets.serde.packing import PackingError

#: One queue's batch: its shuffle, its count path with the counts not yet merged into
#: the shuffle's slots (None: the stage has none), and the last offset it read.
Batch = tuple[ShuffleOut, CountPath | None, int]


def send_across(batches: Sequence[Batch]) -> set[int]:
    """Send the pre-combined partials of ``batches`` merged per shuffle queue, where at
    least two can go so; the indexes of those sent (the others' counts still to merge
    and ``send_all`` are the caller's). Nothing is sent, and no batch changed, when the
    merged partials cannot go (a message over the body limit)."""
    chosen = [i for i, batch in enumerate(batches) if _joins(*batch)]
    if len(chosen) < 2:
        return set()
    parts = [batches[i] for i in chosen]
    merged = _merged(parts)
    assert merged.count_acc is not None
    # Every origin in every message: one with nothing for a queue moves its mark there
    # over a range that holds nothing for it, which a replay of it would not send either.
    origins = [(shuffle.src, (last, WHOLE_OFFSET), shuffle.progress) for shuffle, _, last in parts]
    bodies: list[tuple[int, bytes, int]] = []
    for target, slots in sorted(merged.combined.items()):
        entries = list(slots.values())
        for slot in entries:  # a counted slot's accumulator, as add would have made it
            slot[3] = merged.count_acc(slot[5])
        try:
            body = encode_across(origins, entries, merged.combined_records[target])
        except PackingError:
            return set()
        if len(body) > merged.body_limit:
            return set()
        bodies.append((target, body, len(entries)))
    first, _, last_offset = parts[0]
    topic = first.exits[0].topic
    for target, body, sent in bodies:
        first.send_message(topic, target, body, last_offset)
        first.stats.shuffle_records += sent
    return set(chosen)


def _joins(shuffle: ShuffleOut, counting: CountPath | None, _last: int) -> bool:
    """Whether a queue's batch may be merged with others: it went wholly pre-combined,
    into a count that judges no time, and has partials to send. Only counts: a merged
    sum the state refuses (past 64 bits) would be one dead letter where the queues'
    partials, folded one by one, make some of them."""
    return (
        shuffle.combine
        and shuffle.counts_only
        and not shuffle.timed_topics
        and not shuffle.per_record_only
        and not shuffle.per_record
        and bool(shuffle.combined_records or (counting is not None and counting.counts))
    )


def _merged(parts: Sequence[Batch]) -> ShuffleOut:
    """A shuffle holding the partials of every part: their counts added up and routed
    once per distinct key, then the slots some records took another way to (the
    vectorised path's, a key that is not a ``str``), copied so each part's stay."""
    first = parts[0][0]
    merged = ShuffleOut(first.ctx, first.sender, first.stats, first.src, combine=True)
    counts: Counter[str] = Counter()
    latest: dict[str, int] = {}
    for _, counting, _ in parts:
        if counting is None or not counting.counts:
            continue
        counts.update(counting.counts)
        for key, ts in counting.latest.items():
            if ts > latest.get(key, ts - 1):
                latest[key] = ts
    merge_counts(merged, counts, latest)
    for shuffle, _, _ in parts:
        for target, slots in shuffle.combined.items():
            into = merged.combined[target]
            for entry_key, slot in slots.items():
                have = into.get(entry_key)
                if have is None:
                    into[entry_key] = list(slot)
                    continue
                have[4] = max(have[4], slot[4])
                have[5] += slot[5]
            merged.combined_records[target] += shuffle.combined_records[target]
    return merged
