"""Rebuilding the state of queues that change owner, before their new owner starts.

A stateful queue's new instance would rebuild its RocksDB on its first batch
anyway (the runtime restores a store that is behind its state topic), but
then inside a Spark task, with nothing to show for it. The scale job restores
moved queues while supervision is paused instead, into the state root the
instances use (``EngineSettings.resolved_state_dir()``), reporting progress:
the new owner then finds its store current and starts at once.

Only stateful stages keep state: a moved queue of the source topic, or of a
shuffle topic feeding a stage without an aggregate, needs nothing and is
skipped. Each restored store is wiped first, then rebuilt from the latest
snapshot and changelog tail of the state-topic queue with the same id
(:func:`~stream_assets.state.restore.restore_queue`).

Example::

    >>> done = restore_queues(topology, [("wordcount__shuffle__key_by-2", 3)], state_dir,
    ...                       admin, reader, progress=print)  # doctest: +SKIP
    restored wordcount__state__aggregate-3[3]: 1204 keys, seq 57, 58 messages in 0.41s
    >>> done[0].result.keys  # doctest: +SKIP
    1204
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from stream_assets.plan.topology import Stage, Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.state.errors import StateLockedError
from stream_assets.state.restore import (
    RestoreProgress,
    RestoreResult,
    ensure_current,
    restore_queue,
    state_queue,
)
from stream_assets.state.store import QueueStateStore

#: A progress line is logged whenever this many state messages have been read.
PROGRESS_EVERY_MESSAGES = 200


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
        {'wordcount__shuffle__key_by-2': 'wordcount__state__aggregate-3'}
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


def restore_queues(
    topology: Topology,
    queues: Iterable[tuple[str, int]],
    state_root: Path,
    admin: RocketMQAdmin,
    reader: QueueReader,
    progress: Callable[[str], None] | None = None,
) -> list[RestoredQueue]:
    """Rebuild the state of every ``(topic, queue_id)`` of ``topology`` that has state, in order.

    ``topic`` is the allocated topic (a :class:`~stream_assets.control.allocation.Move`'s
    ``topic``); pairs whose topic no stateful stage reads are skipped. Each
    store under ``state_root`` is wiped and restored from its state topic;
    ``progress`` hears how far each restore is (every
    :data:`PROGRESS_EVERY_MESSAGES` messages) and what each one rebuilt.

    Example::

        >>> gained = [(m.topic, m.queue_id) for m in moves(old, new)
        ...           if m.to_instance is not None]  # doctest: +SKIP
        >>> restore_queues(topology, gained, engine.resolved_state_dir(), admin,
        ...                reader, context.log.info)  # doctest: +SKIP
    """
    say = progress or (lambda _line: None)
    out: list[RestoredQueue] = []
    for topic, queue_id, stage in _with_state(topology, queues):
        assert stage.head is not None and stage.state_topic is not None
        state_topic = stage.state_topic

        def report(p: RestoreProgress, state_topic: str = state_topic) -> None:
            if p.messages_total and p.messages_read % PROGRESS_EVERY_MESSAGES == 0:
                say(
                    f"restoring {state_topic}[{p.queue_id}]: {p.messages_read}/"
                    f"{p.messages_total} messages, {p.keys_loaded} keys"
                )

        with QueueStateStore(state_root, topology.job_id, stage.head.op_id, queue_id) as st:
            st.wipe()
            st.open()
            result = restore_queue(st, state_topic, queue_id, admin, reader, report)
        say(
            f"restored {state_topic}[{queue_id}]: {result.keys} keys, seq {result.seq}, "
            f"{result.messages_read} messages in {result.seconds:.2f}s"
        )
        out.append(RestoredQueue(topic, state_topic, queue_id, result))
    return out


def warm_queues(
    topology: Topology,
    queues: Iterable[tuple[str, int]],
    state_root: Path,
    admin: RocketMQAdmin,
    reader: QueueReader,
    progress: Callable[[str], None] | None = None,
) -> list[RestoredQueue]:
    """Bring the local stores of queues an instance is about to gain up to date (NewSplit).

    Unlike :func:`restore_queues` nothing is wiped, and a store another
    process holds open is left alone: on this machine that is the queue's
    current owner, whose store is the state itself, so there is nothing to
    warm. Stores that were behind catch up (or restore) now, while the
    current owner still runs; its last batches before the handover are then
    a short tail for the first batch of the new owner.

    Example::

        >>> warm_queues(topology, [("wordcount__shuffle__key_by-2", 3)], root, admin,
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
