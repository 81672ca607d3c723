"""Bringing the state of queues an instance is about to gain up to date (NewSplit).

A stateful queue's new owner would rebuild its RocksDB on its first batch
anyway (the runtime restores a store that is behind its state topic), but
then inside a Spark task, while the queue has no owner. In a rebalance's
warm phase each instance brings the stores of the queues it gains up to date
first, while their old owner still runs (:meth:`Instance.warm_up
<stream_assets.runtime.spark.instance.Instance.warm_up>`), so the handover pause
does not include the restore.

Only stateful stages keep state: a gained queue of the source topic, or of a
shuffle topic feeding a stage without an aggregate, needs nothing and is
skipped. A store that is behind catches up from the changelog tail, or
restores from the latest snapshot (:func:`~stream_assets.state.restore.ensure_current`).

Example::

    >>> done = warm_queues(topology, [("wordcount__shuffle__aggregate", 3)], state_dir,
    ...                    admin, reader, progress=print)  # doctest: +SKIP
    warmed wordcount__state__aggregate[3]: 1204 keys, seq 57 in 0.41s
    >>> done[0].result.keys  # doctest: +SKIP
    1204
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from stream_assets.plan.topology import Stage, Topology
from stream_assets.state.errors import StateLockedError
from stream_assets.state.ports import RangeReader, StateTopicAdmin
from stream_assets.state.restore import (
    RestoreResult,
    ensure_current,
    state_queue,
)
from stream_assets.state.store import QueueStateStore


@dataclass(frozen=True)
class RestoredQueue:
    """One queue whose state was rebuilt: the allocated ``topic`` (the stateful stage's
    input), its ``state_topic``, the queue id both share, and what the restore did."""

    topic: str
    state_topic: str
    queue_id: int
    result: RestoreResult


def stateful_stages(topology: Topology) -> dict[str, Stage]:
    """The stages that keep state, by the topic they read (the topic their queues are allocated in).

    Example::

        >>> from stream_assets.examples import wordcount
        >>> {t: s.state_topic for t, s in stateful_stages(wordcount.build()).items()}
        {'wordcount__shuffle__aggregate': 'wordcount__state__aggregate'}
    """
    return {s.input_topic: s for s in topology.stages if s.head is not None and s.state_topic}


def _with_state(
    topology: Topology, queues: Iterable[tuple[str, int]]
) -> Iterator[tuple[str, int, Stage]]:
    """The ``(topic, queue_id)`` pairs a stateful stage reads, with that stage."""
    stages = stateful_stages(topology)
    for topic, queue_id in queues:
        stage = stages.get(topic)
        if stage is not None:
            yield topic, queue_id, stage


def warm_queues(
    topology: Topology,
    queues: Iterable[tuple[str, int]],
    state_root: Path,
    admin: StateTopicAdmin,
    reader: RangeReader,
    progress: Callable[[str], None] | None = None,
) -> list[RestoredQueue]:
    """Bring the local stores of queues an instance is about to gain up to date (NewSplit).

    Nothing is wiped, and a store another process holds open is left alone:
    on this machine that is the queue's current owner, whose store is the
    state itself, so there is nothing to warm. Stores that were behind catch
    up (or restore) now, while the current owner still runs; its last batches
    before the handover are then a short tail for the first batch of the new
    owner.

    Example::

        >>> warm_queues(topology, [("wordcount__shuffle__aggregate", 3)], root, admin,
        ...             reader, print)  # doctest: +SKIP
    """
    say = progress or (lambda _line: None)
    out: list[RestoredQueue] = []
    for topic, queue_id, stage in _with_state(topology, queues):
        assert stage.head is not None and stage.state_topic is not None
        store = QueueStateStore(state_root, topology.job_id, stage.head.op_id, queue_id)
        try:
            store.open(wait_s=0)
        except StateLockedError:
            say(f"{stage.state_topic}[{queue_id}]: held by its current owner here; nothing to warm")
            continue
        try:
            log = state_queue(admin, stage.state_topic, queue_id)
            result = ensure_current(store, log, admin, reader)
        finally:
            store.close()
        if result is not None:
            say(
                f"warmed {stage.state_topic}[{queue_id}]: {result.keys} keys, seq {result.seq} "
                f"in {result.seconds:.2f}s"
            )
            out.append(RestoredQueue(topic, stage.state_topic, queue_id, result))
    return out
