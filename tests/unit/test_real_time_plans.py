"""How a real-time interval deals an instance's queues over its tasks (no Spark needed)."""

from __future__ import annotations

from typing import Any

from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.runtime.drive.outage import FAIL_AT_ONCE
from stream_assets.runtime.drive.planning import StageOptions, position_key
from stream_assets.runtime.spark.real_time import RealTimeQuery, RealTimeSetup, _Sharing, task_share


class _Server:
    address, token = "127.0.0.1:1", "t"


def _layout(topic: str, queues: int) -> TopicLayout:
    return TopicLayout(topic, tuple(("broker-a", q) for q in range(queues)))


def _query(options: dict[int, StageOptions]) -> RealTimeQuery:
    setup = RealTimeSetup(
        group="g",
        planned_group="g-planned",
        interval_s=30.0,
        step_max_records=100,
        idle_poll_s=0.02,
        held_send_bytes=1 << 20,
        outage=FAIL_AT_ONCE,
        tasks=0,
        on_rows=lambda rows: None,
        admin=lambda: None,  # type: ignore[arg-type,return-value]
    )
    contexts: dict[int, Any] = {i: f"context of stage {i}" for i in options}
    query = RealTimeQuery(None, "q", contexts, options, setup)
    query._server = _Server()  # type: ignore[assignment]
    for index, opts in options.items():
        layout = opts.layouts[opts.topic]
        query._positions[index] = {
            "q": {position_key(q): 10 * layout.index(q) for q in layout.queues},
            "tick": 3,
            "idle": [],
        }
    return query


def _options() -> dict[int, StageOptions]:
    return {
        0: StageOptions(topic="src", layouts={"src": _layout("src", 4)}),
        1: StageOptions(
            topic="shuffle", queues=(1, 2, 3), layouts={"shuffle": _layout("shuffle", 4)}
        ),
    }


def test_every_assigned_queue_goes_to_exactly_one_task_with_its_own_position() -> None:
    plans = _query(_options())._plans(slots=2, interval_s=1.0)
    assert len(plans) == 2
    dealt = sorted((i, q) for p in plans for i, o in p.options.items() for q in o.queues or ())
    assert dealt == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    for plan in plans:
        # Every task gets queues of both stages: the stages run at once in each slot.
        assert set(plan.options) == {0, 1}
        for index, opts in plan.options.items():
            assert plan.contexts[index] == f"context of stage {index}"
            keys = {f"broker-a:{q}" for q in opts.queues or ()}
            assert plan.positions[index]["q"] == {k: 10 * int(k[-1]) for k in keys}
            assert plan.positions[index]["tick"] == 3


def test_no_more_tasks_than_queues_and_none_without_queues() -> None:
    options = _options()
    assert len(_query(options)._plans(slots=64, interval_s=1.0)) == 7
    idle = {0: StageOptions(topic="src", queues=(), layouts={"src": _layout("src", 4)})}
    assert _query(idle)._plans(slots=2, interval_s=1.0) == []


class _Query:
    def __init__(self) -> None:
        self.redeals = 0

    def redeal(self) -> None:
        self.redeals += 1


def test_queries_of_one_application_share_its_slots_and_redeal_as_they_come_and_go() -> None:
    """A newcomer or a leaver makes every other query of the same application deal its
    queues anew (so slots move within a step); another application's are untouched."""
    sharing = _Sharing()
    a, b, c, elsewhere = _Query(), _Query(), _Query(), _Query()
    sharing.join(1, a)  # type: ignore[arg-type]
    sharing.join(2, elsewhere)  # type: ignore[arg-type]
    sharing.join(1, b)  # type: ignore[arg-type]
    assert (a.redeals, b.redeals, elsewhere.redeals) == (1, 0, 0)
    sharing.join(1, c)  # type: ignore[arg-type]
    assert (a.redeals, b.redeals, c.redeals) == (2, 1, 0)
    assert sharing.count(1) == 3 and sharing.count(2) == 1 and sharing.count(3) == 1
    assert task_share(slots=2, queries=sharing.count(1)) == (1, True)
    sharing.leave(1, b)  # type: ignore[arg-type]
    sharing.leave(1, b)  # type: ignore[arg-type]  # twice: once only
    assert (a.redeals, b.redeals, c.redeals, elsewhere.redeals) == (3, 1, 1, 0)
    assert task_share(slots=2, queries=sharing.count(1)) == (1, False)
