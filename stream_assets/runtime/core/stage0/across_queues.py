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
    >>> class Out:
    ...     def send(self, topic, body, queue_id, key): self.body = body
    >>> out, batches = Out(), []
    >>> for q, words in ((0, ["to", "be"]), (1, ["be"])):
    ...     s = ShuffleOut(ctx, out, TaskStats(queue_id=q), src=q, combine=True)
    ...     keyed = s.key(0, [(w, 7) for w in words], offset=0)
    ...     s.fold(keyed); s.accept(0, keyed, offset=0); batches.append((s, 0))
    >>> send_across(batches)
    {0, 1}
    >>> sorted((e[0], e[3]) for e in decode(out.body)["comb"]), decode(out.body)["n"]
    ([('be', [2]), ('to', [1])], 3)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stream_assets.runtime.core.shuffle_codec import encode_across
from stream_assets.runtime.core.stage0.shuffle_out import WHOLE_OFFSET, EntryKey, ShuffleOut
from stream_assets.serde.packing import PackingError

#: One queue's batch: its shuffle and the last offset it read.
Batch = tuple[ShuffleOut, int]


def send_across(batches: Sequence[Batch]) -> set[int]:
    """Send the pre-combined partials of ``batches`` merged per shuffle queue, where at
    least two can go so; the indexes of those sent (the others' ``send_all`` is the
    caller's). Nothing is sent when the merge cannot be (a partial the codec cannot
    carry, a message over the body limit)."""
    chosen = [i for i, (shuffle, _) in enumerate(batches) if _joins(shuffle)]
    if len(chosen) < 2:
        return set()
    parts = [batches[i] for i in chosen]
    first = parts[0][0]
    bodies: list[tuple[int, bytes, int]] = []
    for target in sorted({t for shuffle, _ in parts for t in shuffle.combined}):
        merged = _merged(parts, target)
        if merged is None:
            return set()
        bodies.append((target, *merged))
    topic = first.exits[0].topic
    for target, body, entries in bodies:
        first.send_message(topic, target, body, parts[0][1])
        first.stats.shuffle_records += entries
    return set(chosen)


def _joins(shuffle: ShuffleOut) -> bool:
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
        and bool(shuffle.combined_records)
    )


def _merged(parts: Sequence[Batch], target: int) -> tuple[bytes, int] | None:
    """The message for shuffle queue ``target`` and its entry count; None: it cannot go."""
    first = parts[0][0]
    counting = first.count_acc
    assert counting is not None
    slots: dict[EntryKey, list[Any]] = {}
    origins: list[tuple[int, tuple[int, int], int, int | None]] = []
    for shuffle, last_offset in parts:
        mine = shuffle.combined.get(target)
        if not mine:
            continue
        end = (last_offset, WHOLE_OFFSET)
        origins.append((shuffle.src, end, shuffle.combined_records[target], shuffle.progress))
        for entry_key, slot in mine.items():
            have = slots.get(entry_key)
            if have is None:
                slots[entry_key] = list(slot)  # the queue's own slot stays as it was
                continue
            if slot[4] > have[4]:
                have[4] = slot[4]
            have[5] += slot[5]
    entries = list(slots.values())
    for slot in entries:  # a counted slot's accumulator, as add would have made it
        slot[3] = counting(slot[5])
    try:
        body = encode_across(origins, entries)
    except PackingError:
        return None
    return None if len(body) > first.body_limit else (body, len(entries))
