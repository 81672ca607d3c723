"""Which instance reads which message queue: RocketMQ's average allocation, and a sticky one.

A consumer group (one deployed topology) reads its source topic and every
shuffle topic; each topic's queues are shared out among K instances, topic by
topic. ``"average"`` is RocketMQ's ``AllocateMessageQueueAveragely``: instance
``i`` of ``K`` takes a contiguous run of the sorted queues, the first
``len % K`` instances one more than the rest, and instances beyond the queue
count get nothing (idle, visibly). ``"sticky"`` gives every instance the same
*number* of queues per topic as the average would (floor or ceil of the mean),
but keeps each queue on its previous owner wherever that owner survives, so a
scale event moves as few queues (and their state) as possible.

Example::

    >>> a = allocate({"src": [0, 1, 2, 3], "shuf": list(range(8))}, 3, "average")
    >>> a.for_instance(0)
    {'shuf': [0, 1, 2], 'src': [0, 1]}
    >>> b = allocate({"src": [0, 1, 2, 3], "shuf": list(range(8))}, 2, "sticky", previous=a)
    >>> [(m.topic, m.queue_id, m.from_instance, m.to_instance) for m in moves(a, b)]
    [('shuf', 6, 2, 0), ('shuf', 7, 2, 1), ('src', 3, 2, 1)]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from stream_assets.plan.topology import Topology

Strategy = Literal["average", "sticky"]
STRATEGIES: tuple[Strategy, ...] = ("average", "sticky")

#: Allocation.generation of the first allocation of a group; 0 stays for instances
#: started outside Dagster (the runtime's default), so a managed generation always wins.
FIRST_GENERATION = 1


@dataclass(frozen=True)
class Allocation:
    """One generation of a group's queue assignment: ``assignment[i]`` is instance ``i``'s share.

    Each entry maps topic -> sorted queue ids; an idle instance has no queue in
    any topic. Every topic allocated appears in every entry (possibly with
    ``[]``), so ``for_instance(i)`` is also a complete list of the group's topics.

    Example::

        >>> a = allocate({"t": [0, 1]}, 3)
        >>> a.instances, a.idle_instances(), Allocation.from_json(a.to_json()) == a
        (3, [2], True)
    """

    generation: int
    instances: int
    assignment: tuple[dict[str, list[int]], ...]

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError(f"an allocation needs at least one instance, got {self.instances}")
        if len(self.assignment) != self.instances:
            raise ValueError(
                f"allocation of {self.instances} instances has {len(self.assignment)} entries"
            )
        seen: dict[tuple[str, int], int] = {}
        for index, share in enumerate(self.assignment):
            for topic, queues in share.items():
                for q in queues:
                    if (topic, q) in seen:
                        raise ValueError(
                            f"queue {topic}/{q} is assigned to instances {seen[topic, q]} "
                            f"and {index}"
                        )
                    seen[topic, q] = index

    # Frozen but holding dicts: hashing would fail anyway, say so plainly.
    __hash__ = None  # type: ignore[assignment]

    @property
    def topics(self) -> list[str]:
        """Every topic this allocation covers, sorted."""
        return sorted({t for share in self.assignment for t in share})

    def queues_by_topic(self) -> dict[str, list[int]]:
        """Every allocated queue, per topic (the input of :func:`allocate`)."""
        out: dict[str, list[int]] = {t: [] for t in self.topics}
        for share in self.assignment:
            for topic, queues in share.items():
                out[topic].extend(queues)
        return {t: sorted(qs) for t, qs in out.items()}

    def for_instance(self, index: int) -> dict[str, list[int]]:
        """Instance ``index``'s share (a copy): the ``assignment`` argument of ``Instance``."""
        if not 0 <= index < self.instances:
            raise IndexError(f"instance {index} is not in 0..{self.instances - 1}")
        return {t: list(qs) for t, qs in sorted(self.assignment[index].items())}

    def owner(self, topic: str, queue_id: int) -> int | None:
        """The instance that owns ``topic``/``queue_id``, or None."""
        for index, share in enumerate(self.assignment):
            if queue_id in share.get(topic, ()):
                return index
        return None

    def assigns(self, index: int, assignment: Mapping[str, Sequence[int]] | None) -> bool:
        """Whether an instance run started as ``index`` on ``assignment`` owns its share here.

        This is the ownership test of the control plane: the supervisor keeps
        such a run instead of launching one, the scale job keeps it running
        instead of stopping it and counts it as ready, and the run itself
        stops when it no longer holds (superseded). The generation is not
        compared on purpose: a run whose share a scale leaves unchanged keeps
        running across it (only changed instances restart), and the state
        store's generation fence guards the queues that did move. An index
        outside the allocation (scaled in, or an untagged run's -1) or an
        assignment of ``None`` (every queue, unmanaged) owns nothing.

        Example::

            >>> a = allocate({"t": [0, 1, 2]}, 2)
            >>> a.assigns(0, {"t": [0, 1]}), a.assigns(1, {"t": [0, 1]}), a.assigns(2, {"t": []})
            (True, False, False)
        """
        if assignment is None or not 0 <= index < self.instances:
            return False
        return self.for_instance(index) == {t: list(qs) for t, qs in assignment.items()}

    def idle_instances(self) -> list[int]:
        """Instances that own no queue at all (more instances than queues)."""
        return [i for i, share in enumerate(self.assignment) if not any(share.values())]

    def to_json(self) -> str:
        """A compact JSON document; :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form."""
        return {
            "generation": self.generation,
            "instances": self.instances,
            "assignment": [
                {t: sorted(qs) for t, qs in sorted(share.items())} for share in self.assignment
            ],
        }

    @classmethod
    def from_json(cls, text: str) -> Allocation:
        """Parse :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Allocation:
        """Parse :meth:`to_dict` output."""
        return cls(
            generation=int(data["generation"]),
            instances=int(data["instances"]),
            assignment=tuple(
                {str(t): sorted(int(q) for q in qs) for t, qs in share.items()}
                for share in data["assignment"]
            ),
        )


@dataclass(frozen=True, order=True)
class Move:
    """One queue changing owner between two allocations.

    ``from_instance`` is None for a queue nobody owned before (a new topic or
    queue); ``to_instance`` is None for a queue that is no longer allocated.
    """

    topic: str
    queue_id: int
    from_instance: int | None
    to_instance: int | None


def average_share(queues: Sequence[int], index: int, instances: int) -> list[int]:
    """RocketMQ's ``AllocateMessageQueueAveragely`` for consumer ``index`` of ``instances``.

    ``queues`` must already be sorted (the Java client sorts both the queues
    and the consumer ids before calling the strategy).

    Example::

        >>> [average_share(range(5), i, 3) for i in range(3)]
        [[0, 1], [2, 3], [4]]
    """
    if not 0 <= index < instances:
        raise ValueError(f"index {index} is not in 0..{instances - 1}")
    total = len(queues)
    mod = total % instances
    if total <= instances:
        average = 1
    elif mod > 0 and index < mod:
        average = total // instances + 1
    else:
        average = total // instances
    start = index * average if mod > 0 and index < mod else index * average + mod
    count = min(average, total - start)
    return [queues[start + k] for k in range(max(count, 0))]


def allocate(
    queues_by_topic: Mapping[str, Sequence[int]],
    instances: int,
    strategy: Strategy = "average",
    previous: Allocation | None = None,
    generation: int | None = None,
) -> Allocation:
    """Share every topic's queues among ``instances`` instances.

    ``generation`` defaults to ``previous.generation + 1`` (or
    :data:`FIRST_GENERATION`): each new allocation fences off the last one,
    even when no queue moves, because the instance count may have changed.
    ``"sticky"`` without ``previous`` is ``"average"``.

    Example::

        >>> allocate({"t": [0, 1, 2]}, 2).assignment
        ({'t': [0, 1]}, {'t': [2]})
    """
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if generation is None:
        generation = FIRST_GENERATION if previous is None else previous.generation + 1
    shares: list[dict[str, list[int]]] = [{} for _ in range(instances)]
    for topic in sorted(queues_by_topic):
        queues = sorted(set(queues_by_topic[topic]))
        if len(queues) != len(queues_by_topic[topic]):
            raise ValueError(f"topic {topic}: duplicate queue ids {list(queues_by_topic[topic])}")
        if strategy == "sticky" and previous is not None:
            per_instance = _sticky_topic(topic, queues, instances, previous)
        else:
            per_instance = [average_share(queues, i, instances) for i in range(instances)]
        for index, share in enumerate(per_instance):
            shares[index][topic] = share
    return Allocation(generation=generation, instances=instances, assignment=tuple(shares))


def _sticky_topic(
    topic: str, queues: list[int], instances: int, previous: Allocation
) -> list[list[int]]:
    """Balanced shares of one topic keeping as many queues on their old owner as possible.

    Every instance ends with ``base`` or ``base + 1`` queues (``extra`` of them
    with ``base + 1``), exactly the counts the average strategy gives. Keeping
    ``min(kept_i, cap_i)`` queues on each instance is the most that can stay,
    and it is largest when the ``+1`` caps go to the instances that already
    hold the most: so moves are minimal among balanced allocations, and never
    more than the average strategy's.
    """
    base, extra = divmod(len(queues), instances)
    existing = set(queues)
    kept: list[list[int]] = []
    for index in range(instances):
        old = previous.assignment[index].get(topic, []) if index < previous.instances else []
        kept.append(sorted(q for q in old if q in existing))
    # Most-kept first; ties to the lower index, matching the average strategy's bias.
    by_holding = sorted(range(instances), key=lambda i: (-len(kept[i]), i))
    caps = [base] * instances
    for index in by_holding[:extra]:
        caps[index] = base + 1
    shares = [kept[i][: caps[i]] for i in range(instances)]
    placed = {q for share in shares for q in share}
    pool = [q for q in queues if q not in placed]
    cursor = 0
    for index in range(instances):
        need = caps[index] - len(shares[index])
        shares[index] = sorted(shares[index] + pool[cursor : cursor + need])
        cursor += need
    assert cursor == len(pool), "caps sum to the queue count"
    return shares


def moves(old: Allocation | None, new: Allocation) -> list[Move]:
    """Every queue whose owner differs between ``old`` and ``new``, sorted by topic and queue.

    With ``old`` None every queue of ``new`` is a move from nobody.

    Example::

        >>> moves(allocate({"t": [0, 1]}, 1), allocate({"t": [0, 1]}, 2))
        [Move(topic='t', queue_id=1, from_instance=0, to_instance=1)]
    """
    owners_old = _owners(old) if old is not None else {}
    owners_new = _owners(new)
    out = []
    for topic, queue in sorted(owners_old.keys() | owners_new.keys()):
        before, after = owners_old.get((topic, queue)), owners_new.get((topic, queue))
        if before != after:
            out.append(Move(topic, queue, before, after))
    return out


def changed_instances(old: Allocation | None, new: Allocation) -> set[int]:
    """Instance indexes whose share differs (in ``old`` or ``new``): the ones to restart.

    Example::

        >>> a = allocate({"t": [0, 1, 2, 3]}, 2)
        >>> sorted(changed_instances(a, allocate({"t": [0, 1, 2, 3]}, 3, "sticky", a)))
        [1, 2]
    """
    if old is None:
        return set(range(new.instances))
    out: set[int] = set()
    for index in range(max(old.instances, new.instances)):
        before = _normalised(old.assignment[index]) if index < old.instances else {}
        after = _normalised(new.assignment[index]) if index < new.instances else {}
        if before != after:
            out.add(index)
    return out


def topology_queues(
    topology: Topology,
    source_queues: int | Sequence[int] | Mapping[str, Sequence[int]],
    shuffle_queues: int,
) -> dict[str, list[int]]:
    """The queues a topology's group allocates: its source topics and every shuffle topic.

    State topics follow their shuffle queue (same id) and sinks are written,
    not read, so neither is allocated. ``source_queues`` is, per source topic
    (a mapping) or for every source topic, the queue count or the queue ids
    (from the broker's route); ``shuffle_queues`` is
    ``EngineSettings.shuffle_queues``.

    Example::

        >>> from stream_assets.examples import wordcount
        >>> topology_queues(wordcount.build(), 2, 3)
        {'sourceTopic': [0, 1], 'wordcount__shuffle__aggregate': [0, 1, 2]}
    """
    out: dict[str, list[int]] = {}
    for topic in topology.source_topics:
        given = (
            source_queues.get(topic, ()) if isinstance(source_queues, Mapping) else source_queues
        )
        out[topic] = list(range(given)) if isinstance(given, int) else sorted(given)
    for topic in topology.shuffle_topics:
        out[topic] = list(range(shuffle_queues))
    return out


def _owners(allocation: Allocation) -> dict[tuple[str, int], int]:
    return {
        (topic, q): index
        for index, share in enumerate(allocation.assignment)
        for topic, queues in share.items()
        for q in queues
    }


def _normalised(share: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    return {t: sorted(qs) for t, qs in share.items() if qs}
