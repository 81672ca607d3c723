"""How a real-time interval deals an instance's queues over its tasks (no Spark needed)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.runtime.drive.outage import FAIL_AT_ONCE
from stream_assets.runtime.drive.planning import StageOptions, position_key
from stream_assets.runtime.spark.real_time import (
    RealTimeQuery,
    RealTimeSetup,
    _Sharing,
    task_share,
    task_slots,
    watch_interval,
)


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


def test_an_interval_ends_early_once_when_the_task_slots_change() -> None:
    """The driver watches the application's task slots during an interval: while they
    stay as dealt nothing happens; when an executor joins or leaves, the interval ends
    (once) so the next one deals the queues over the slots there are."""
    reads: list[int] = []
    enough = threading.Event()

    def steady() -> tuple[int, int]:
        reads.append(4)
        if len(reads) >= 20:
            enough.set()
        return 4, 0

    calls: list[str] = []
    with watch_interval(steady, (4, 0), lambda: calls.append("redeal"), every_s=0.001):
        assert enough.wait(10)
    assert calls == [] and len(reads) >= 20

    seen = iter([(4, 0), (4, 0), (2, 0), (3, 0), (2, 0)])
    changed = threading.Event()

    def redeal() -> None:
        calls.append("redeal")
        changed.set()

    with watch_interval(lambda: next(seen, (2, 0)), (4, 0), redeal, every_s=0.001):
        assert changed.wait(10)
    assert calls == ["redeal"], "one change ends the interval once"
    assert next(seen) == (3, 0), "the watch stopped reading at the first change"


def test_the_watched_shape_counts_failed_tasks_of_this_querys_running_job_only() -> None:
    """A failed task of this query's running interval changes its shape; one of an
    earlier interval (same job group, finished) or of another query does not."""
    query = _query(_options())
    jobs = {
        1: SimpleNamespace(stageIds=[10]),  # an earlier interval of this query
        2: SimpleNamespace(stageIds=[20, 21]),  # this query's running interval
        3: SimpleNamespace(stageIds=[30]),  # another query's
    }
    stages = {
        10: SimpleNamespace(numFailedTasks=5),
        20: SimpleNamespace(numFailedTasks=0),
        21: SimpleNamespace(numFailedTasks=0),
        30: SimpleNamespace(numFailedTasks=7),
    }
    tracker = SimpleNamespace(
        getActiveJobsIds=lambda: [2, 3],
        getJobIdsForGroup=lambda group: [1, 2] if group == query._job_group else [3],
        getJobInfo=jobs.get,
        getStageInfo=stages.get,
    )
    sc = SimpleNamespace(statusTracker=lambda: tracker, defaultParallelism=4)  # no JVM: its count
    assert query._shape(sc) == (4, 0)
    stages[21].numFailedTasks = 1
    sc.defaultParallelism = 3
    assert query._shape(sc) == (3, 1)


def test_task_slots_are_sparks_count_of_what_runs_at_once_never_zero() -> None:
    """Spark's own count where it has one (a lost one-core worker of two lowers it to 1,
    where ``defaultParallelism`` stays 2), at least 1 (no executor registered yet), and
    ``defaultParallelism`` where the count is out of reach."""

    def context(count: int) -> Any:
        manager = SimpleNamespace(defaultResourceProfile=lambda: "default")
        jvm = SimpleNamespace(
            maxNumConcurrentTasks=lambda rp: count if rp == "default" else -1,
            resourceProfileManager=lambda: manager,
        )
        return SimpleNamespace(_jsc=SimpleNamespace(sc=lambda: jvm), defaultParallelism=2)

    assert [task_slots(context(n)) for n in (2, 1, 0, 7)] == [2, 1, 1, 7]
    assert task_slots(SimpleNamespace(defaultParallelism=3)) == 3
