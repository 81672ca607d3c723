"""Queue allocation: RocketMQ's average strategy, the sticky strategy, moves, JSON."""

import itertools
import random

import pytest

from stream_assets.control.allocation import (
    Allocation,
    Move,
    allocate,
    average_share,
    changed_instances,
    moves,
    topology_queues,
)
from stream_assets.examples import windowed_sum, wordcount


def reference_average(queues: list[int], index: int, count: int) -> list[int]:
    """AllocateMessageQueueAveragely.allocate, transcribed from the Java client.

    Written out independently (in the Java's own shape) so the test does not
    share a bug with the implementation.
    """
    mq_all = sorted(queues)
    size = len(mq_all)
    mod = size % count
    if size <= count:
        average_size = 1
    elif mod > 0 and index < mod:
        average_size = size // count + 1
    else:
        average_size = size // count
    start_index = index * average_size if mod > 0 and index < mod else index * average_size + mod
    range_ = min(average_size, size - start_index)
    result = []
    for i in range(range_):
        result.append(mq_all[(start_index + i) % size])
    return result


def owners(a: Allocation) -> dict[tuple[str, int], int]:
    return {
        (t, q): i for i, share in enumerate(a.assignment) for t, qs in share.items() for q in qs
    }


def assert_complete_and_balanced(a: Allocation, queues_by_topic: dict[str, list[int]]) -> None:
    for topic, queues in queues_by_topic.items():
        got = sorted(q for share in a.assignment for q in share[topic])
        assert got == sorted(queues), f"{topic}: every queue exactly once"
        sizes = [len(share[topic]) for share in a.assignment]
        low = len(queues) // a.instances
        assert all(s in (low, low + 1) for s in sizes), (topic, sizes)
        assert sum(s == low + 1 for s in sizes) == len(queues) % a.instances


# -- average -------------------------------------------------------------------


@pytest.mark.parametrize("n_queues", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("instances", [1, 2, 3, 4, 5, 8, 9, 20])
def test_average_matches_the_java_formula(n_queues: int, instances: int) -> None:
    queues = list(range(n_queues))
    for index in range(instances):
        assert average_share(queues, index, instances) == reference_average(
            queues, index, instances
        )
    a = allocate({"t": queues}, instances, "average")
    assert [share["t"] for share in a.assignment] == [
        reference_average(queues, i, instances) for i in range(instances)
    ]
    assert_complete_and_balanced(a, {"t": queues})


def test_average_is_per_topic_and_on_sorted_queue_ids() -> None:
    # Queue ids given out of order and not contiguous: the Java client sorts them.
    queues = {"src": [3, 0, 2, 1], "shuf": [5, 1, 7, 0, 2, 4, 6, 3]}
    a = allocate(queues, 3)
    assert a.assignment == (
        {"shuf": [0, 1, 2], "src": [0, 1]},
        {"shuf": [3, 4, 5], "src": [2]},
        {"shuf": [6, 7], "src": [3]},
    )
    sparse = allocate({"t": [10, 30, 20]}, 2)
    assert [s["t"] for s in sparse.assignment] == [[10, 20], [30]]


def test_more_instances_than_queues_leaves_instances_idle() -> None:
    a = allocate({"src": [0, 1], "shuf": [0, 1, 2]}, 5)
    assert [share["src"] for share in a.assignment] == [[0], [1], [], [], []]
    assert [share["shuf"] for share in a.assignment] == [[0], [1], [2], [], []]
    assert a.idle_instances() == [3, 4]
    # Every topic is still listed for an idle instance, with no queues.
    assert a.for_instance(4) == {"shuf": [], "src": []}


def test_topology_queues_cover_source_and_shuffle_topics() -> None:
    t = windowed_sum.build()
    queues = topology_queues(t, [0, 1, 2, 3], shuffle_queues=8)
    assert queues == {"events": [0, 1, 2, 3], "windowed-sum__shuffle__aggregate": list(range(8))}
    a = allocate(queues, 2)
    assert a.for_instance(1) == {
        "events": [2, 3],
        "windowed-sum__shuffle__aggregate": [4, 5, 6, 7],
    }


# -- sticky --------------------------------------------------------------------


def test_sticky_without_previous_is_average() -> None:
    queues = {"t": list(range(7))}
    assert allocate(queues, 3, "sticky").assignment == allocate(queues, 3).assignment


def test_sticky_scale_out_moves_only_what_must_move() -> None:
    queues = {"t": list(range(8))}
    two = allocate(queues, 2)  # [0..3], [4..7]
    four = allocate(queues, 4, "sticky", previous=two)
    assert_complete_and_balanced(four, queues)
    # Each old owner keeps two of its four queues; the new instances get the rest.
    assert four.assignment[0]["t"] == [0, 1] and four.assignment[1]["t"] == [4, 5]
    assert len(moves(two, four)) == 4
    assert all(m.from_instance in (0, 1) and m.to_instance in (2, 3) for m in moves(two, four))


def test_sticky_scale_in_keeps_survivors_queues() -> None:
    queues = {"t": list(range(9))}
    three = allocate(queues, 3)  # [0,1,2], [3,4,5], [6,7,8]
    two = allocate(queues, 2, "sticky", previous=three)
    assert_complete_and_balanced(two, queues)
    assert set(three.assignment[0]["t"]) <= set(two.assignment[0]["t"])
    assert set(three.assignment[1]["t"]) <= set(two.assignment[1]["t"])
    # Only the removed instance's queues move.
    assert {m.queue_id for m in moves(three, two)} == {6, 7, 8}
    # The average strategy reshuffles more: 0..4 / 5..8 moves 3, 5, 6, 7, 8.
    assert len(moves(three, allocate(queues, 2))) == 5


def test_sticky_gives_the_extra_queue_to_whoever_already_holds_it() -> None:
    # Previous: instance 1 holds three, instance 0 two; 5 queues over 2 again must
    # not move anything even though average would give instance 0 the extra one.
    previous = Allocation(1, 2, ({"t": [0, 4]}, {"t": [1, 2, 3]}))
    again = allocate({"t": [0, 1, 2, 3, 4]}, 2, "sticky", previous=previous)
    assert again.assignment == previous.assignment
    assert moves(previous, again) == []
    assert again.generation == 2


def test_sticky_handles_new_and_removed_topics_and_queues() -> None:
    previous = allocate({"a": [0, 1, 2, 3], "gone": [0, 1]}, 2)
    new_queues = {"a": [0, 1, 2, 3, 4, 5], "b": [0, 1, 2]}
    a = allocate(new_queues, 3, "sticky", previous=previous)
    assert_complete_and_balanced(a, new_queues)
    assert a.topics == ["a", "b"]
    m = moves(previous, a)
    assert Move("gone", 0, 0, None) in m and Move("gone", 1, 1, None) in m
    assert {(x.queue_id, x.from_instance) for x in m if x.topic == "b"} == {
        (0, None),
        (1, None),
        (2, None),
    }


def _random_allocation(rng: random.Random, queues: dict[str, list[int]], n: int) -> Allocation:
    """Any valid (not necessarily balanced) allocation: the sticky input can be arbitrary."""
    shares: list[dict[str, list[int]]] = [{t: [] for t in queues} for _ in range(n)]
    for topic, qs in queues.items():
        for q in qs:
            shares[rng.randrange(n)][topic].append(q)
    return Allocation(rng.randrange(1, 50), n, tuple(shares))


def _max_kept(previous: Allocation, queues: dict[str, list[int]], n: int) -> int:
    """Brute force: the most queues any balanced allocation over n instances can leave in place."""
    best_total = 0
    for topic, qs in queues.items():
        base, extra = divmod(len(qs), n)
        held = [
            len(set(previous.assignment[i].get(topic, [])) & set(qs))
            if i < previous.instances
            else 0
            for i in range(n)
        ]
        best = 0
        for plus in itertools.combinations(range(n), extra):
            caps = [base + (i in plus) for i in range(n)]
            best = max(best, sum(min(h, c) for h, c in zip(held, caps, strict=True)))
        best_total += best
    return best_total


def test_sticky_is_balanced_minimal_and_never_worse_than_average() -> None:
    rng = random.Random(20240601)
    for _ in range(300):
        queues = {
            t: sorted(rng.sample(range(24), rng.randrange(0, 13))) for t in ("src", "s1", "s2")
        }
        old_n, new_n = rng.randrange(1, 7), rng.randrange(1, 7)
        previous = _random_allocation(rng, queues, old_n)
        sticky = allocate(queues, new_n, "sticky", previous=previous)
        average = allocate(queues, new_n, "average", previous=previous)
        assert_complete_and_balanced(sticky, queues)
        assert_complete_and_balanced(average, queues)
        kept = sum(1 for key, i in owners(sticky).items() if owners(previous).get(key) == i)
        # Minimal: as many queues stay put as any balanced allocation could keep.
        assert kept == _max_kept(previous, queues, new_n)
        assert len(moves(previous, sticky)) <= len(moves(previous, average))
        # Stable: re-allocating with the same count moves nothing once balanced.
        assert moves(sticky, allocate(queues, new_n, "sticky", previous=sticky)) == []


# -- bookkeeping ---------------------------------------------------------------


def test_generation_advances_and_can_be_pinned() -> None:
    a = allocate({"t": [0]}, 1)
    assert a.generation == 1
    assert allocate({"t": [0]}, 1, previous=a).generation == 2
    assert allocate({"t": [0]}, 1, previous=a, generation=7).generation == 7


def test_json_round_trip() -> None:
    a = allocate({"wordcount__shuffle__aggregate": list(range(8)), "sourceTopic": [0, 1]}, 3)
    text = a.to_json()
    assert Allocation.from_json(text) == a
    assert '"generation":1' in text


def test_moves_and_changed_instances() -> None:
    a = allocate({"t": [0, 1, 2, 3]}, 2)
    b = allocate({"t": [0, 1, 2, 3]}, 3, "sticky", previous=a)
    # Ties in holdings give the extra queue to the lower index, as average does.
    assert moves(a, b) == [Move("t", 3, 1, 2)]
    assert changed_instances(a, b) == {1, 2}
    assert changed_instances(None, b) == {0, 1, 2}
    assert moves(None, a) == [Move("t", q, None, a.owner("t", q)) for q in range(4)]
    # Scale back in: instance 2 goes away, instance 1 takes its queue, 0 is untouched.
    assert changed_instances(b, allocate({"t": [0, 1, 2, 3]}, 2, "sticky", previous=b)) == {1, 2}


def test_invalid_allocations_are_rejected() -> None:
    with pytest.raises(ValueError, match="instances must be >= 1"):
        allocate({"t": [0]}, 0)
    with pytest.raises(ValueError, match="strategy"):
        allocate({"t": [0]}, 1, "roundrobin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="duplicate"):
        allocate({"t": [0, 0]}, 1)
    with pytest.raises(ValueError, match="assigned to instances 0 and 1"):
        Allocation(1, 2, ({"t": [0]}, {"t": [0]}))
    with pytest.raises(ValueError, match="entries"):
        Allocation(1, 2, ({"t": [0]},))
    with pytest.raises(IndexError):
        allocate({"t": [0]}, 1).for_instance(1)


def test_wordcount_allocation_feeds_instance_assignment() -> None:
    t = wordcount.build()
    a = allocate(topology_queues(t, 4, 8), 2)
    share = a.for_instance(0)
    # Instance(assignment=...) reads exactly these topics: every stage's input.
    assert set(share) == {s.input_topic for s in t.stages}
    assert share == {"sourceTopic": [0, 1], "wordcount__shuffle__aggregate": [0, 1, 2, 3]}


def test_assigns_is_exact_ownership_of_an_instance_share() -> None:
    old = allocate({"t": [0, 1, 2, 3], "u": [0, 1]}, 2)
    new = allocate({"t": [0, 1, 2, 3], "u": [0, 1]}, 3, "sticky", previous=old)
    # A run keeps serving while its share is unchanged, whatever the generation.
    assert new.assigns(0, old.for_instance(0))
    assert not new.assigns(1, old.for_instance(1))
    assert new.assigns(2, new.for_instance(2))
    # Tuples (or any sequence) compare like the lists of a JSON-decoded assignment.
    assert new.assigns(0, {t: tuple(qs) for t, qs in new.for_instance(0).items()})
    # Scaled in, untagged (-1), or unmanaged (None: every queue): owns nothing here.
    assert not old.assigns(2, new.for_instance(2))
    assert not new.assigns(-1, new.for_instance(0))
    assert not new.assigns(0, None)
    # A share missing a topic (even an empty one) is not the same share.
    assert not new.assigns(2, {"t": new.for_instance(2)["t"]})
