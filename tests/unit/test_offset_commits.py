"""OffsetCommits: a lost commit is committed again, and nothing else is taken for one.

A RocketMQ master flushes consumer offsets every 5 s; killed in between, it
comes back with older ones. Nothing else commits those queues again until new
input arrives there, so without this their lag stayed up for good (seen in
CI: 203 messages, 240 s after the master was back).

The lost-offsets warning used to fire with no master restarted: the lag reader
compared the broker's answer with offsets that had not been acknowledged yet
(a commit waiting for its group, landing while the broker answered). These
tests race commits against the check on a broker stand-in that is linearisable
like a master: every answer is the latest acknowledged commit at some moment
between the request and the reply.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import MessageQueue, QueueOffsets
from stream_assets.rocketmq.errors import BrokerUnreachableError
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.runtime.drive.offset_commits import OffsetCommits
from stream_assets.runtime.spark.instance import Instance
from stream_assets.settings import EngineSettings, RocketMQSettings

Q = MessageQueue("orders", "broker-a", 0)
QB = MessageQueue("orders", "broker-b", 0)


class Broker:
    """Master and slave of each group: the slave's copy moves only on :meth:`sync`."""

    def __init__(self) -> None:
        self.master: dict[MessageQueue, int] = {}
        self.slave: dict[MessageQueue, int] = {}
        self.down: set[str] = set()
        self.lock = threading.Lock()
        #: Runs inside group_offsets between reading the answer and returning it.
        self.while_answering = lambda: None
        self.jitter = False

    def _pause(self) -> None:
        if self.jitter and random.random() < 0.5:
            threading.Event().wait(random.random() / 2000)

    def commit_consumer_offsets(self, group: str, offsets: Mapping[MessageQueue, int]) -> None:
        for queue in offsets:
            if queue.broker_name in self.down:
                raise BrokerUnreachableError(f"broker group {queue.broker_name}", "-", "no master")
        self._pause()
        with self.lock:
            self.master.update(offsets)
        self._pause()

    def group_offsets(
        self,
        group: str,
        topic: str,
        queues: Iterable[MessageQueue] | None = None,
        *,
        from_master: bool = False,
    ) -> dict[MessageQueue, int | None]:
        wanted = list(queues or [])
        self._pause()
        answer: dict[MessageQueue, int | None] = {}
        for q in wanted:
            master_down = q.broker_name in self.down
            if master_down and from_master:
                raise BrokerUnreachableError(f"broker group {q.broker_name}", "-", "no master")
            with self.lock:
                answer[q] = (self.slave if master_down else self.master).get(q)
        self.while_answering()
        self._pause()
        return answer

    def sync(self) -> None:
        with self.lock:
            self.slave = dict(self.master)


def _book(broker: Broker) -> tuple[OffsetCommits, list[str]]:
    said: list[str] = []
    return OffsetCommits(lambda: broker, "wordcount", said.append), said


def _lost_alarms(said: list[str]) -> list[str]:
    return [m for m in said if "lost the committed offsets" in m]


def test_a_waiting_commit_landing_while_the_broker_answers_is_no_loss() -> None:
    broker = Broker()
    book, said = _book(broker)
    book.commit({Q: 10})
    broker.down.add("broker-a")
    book.commit({Q: 20})  # waits: the group has no master
    assert book.waiting == 1 and said == [
        "offsets on broker group broker-a wait: cannot reach RocketMQ broker group broker-a: "
        "no master. Is it running? (its status: `stream-assets broker status`, `cluster "
        "status` or `deploy status`, whichever started it; set "
        "STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR if it lives elsewhere)"
    ]
    book.commit({Q: 21})  # still waiting: said once per outage
    assert len(said) == 1
    broker.down.clear()

    def land_the_waiting_commit() -> None:
        broker.while_answering = lambda: None
        book.commit_waiting()

    # The broker reads 10 for the answer, then the waiting 20 lands, then it replies.
    broker.while_answering = land_the_waiting_commit
    assert book.group_offsets("orders", [Q]) == {Q: 10}
    assert _lost_alarms(said) == []
    assert broker.master[Q] == 21 and book.waiting == 0


def test_a_slave_answering_behind_while_its_master_is_down_is_no_loss() -> None:
    broker = Broker()
    book, said = _book(broker)
    book.commit({Q: 10})
    broker.sync()
    book.commit({Q: 30})
    broker.down.add("broker-a")  # the slave (at 10) answers now
    assert book.group_offsets("orders", [Q]) == {Q: 10}
    assert _lost_alarms(said) == [] and book.waiting == 0


def test_lost_offsets_go_again_with_the_newest_and_not_after_a_stop() -> None:
    broker = Broker()
    book, said = _book(broker)
    book.commit({Q: 10, QB: 5})
    book.commit({Q: 40})
    broker.master = {QB: 5}  # broker-a's master came back without its offsets
    assert book.group_offsets("orders", [Q, QB]) == {Q: None, QB: 5}
    assert len(_lost_alarms(said)) == 1 and "broker group broker-a " in said[-1]
    assert book.commit_waiting() == 0
    assert broker.master == {Q: 40, QB: 5}
    book.forget()  # given up at a stop: another owner's lower offsets are no loss
    broker.master = {}
    book.group_offsets("orders", [Q, QB])
    assert len(_lost_alarms(said)) == 1


def test_commits_racing_the_check_never_raise_a_false_alarm() -> None:
    broker = Broker()
    broker.jitter = True
    book, said = _book(broker)
    done = threading.Event()
    outage_toggles = 0

    def commit_forever() -> None:
        nonlocal outage_toggles
        offset = 0
        while not done.is_set():
            offset += 1
            if offset % 29 == 0:  # now and then the group loses its master for a while
                broker.down.symmetric_difference_update({"broker-b"})
                outage_toggles += 1
            book.commit({Q: offset, QB: offset})
            if offset % 13 == 0:
                book.commit_waiting()

    committer = threading.Thread(target=commit_forever)
    committer.start()
    try:
        for _ in range(300):
            book.group_offsets("orders", [Q, QB])
    finally:
        done.set()
        committer.join()
    broker.down.clear()
    assert book.commit_waiting() == 0
    assert outage_toggles > 2  # the race ran through outages, not only plain commits
    assert _lost_alarms(said) == []
    assert broker.master[Q] == broker.master[QB] > 0


# -- through the instance's lag reader (what its run loop calls) -----------------------


class ForgetfulBroker:
    """Committed offsets and queue ends of one group, as a broker would answer them."""

    def __init__(self, queues: list[MessageQueue], end: int) -> None:
        self.committed: dict[MessageQueue, int | None] = dict.fromkeys(queues)
        self.end = end
        self.commits: list[dict[MessageQueue, int]] = []

    def group_offsets(
        self, group: str, topic: str, queues: list[MessageQueue], from_master: bool = False
    ) -> dict[MessageQueue, int | None]:
        return {q: self.committed.get(q) for q in queues}

    def topic_offsets(self, topic: str, queues: list[MessageQueue]) -> dict[MessageQueue, Any]:
        return {q: QueueOffsets(q, 0, self.end) for q in queues}

    def commit_consumer_offsets(self, group: str, offsets: Mapping[MessageQueue, int]) -> None:
        self.commits.append(dict(offsets))
        self.committed.update(offsets)


def _instance() -> tuple[Instance, ForgetfulBroker, list[MessageQueue], list[str]]:
    said: list[str] = []
    topology = wordcount.build()
    inst = Instance(
        topology, rocketmq=RocketMQSettings(), engine=EngineSettings(), progress=said.append
    )
    layouts = {}
    for stage in topology.stages:
        queues = [
            MessageQueue(stage.input_topic, b, i) for b in ("broker-a", "broker-b") for i in (0, 1)
        ]
        layouts[stage.input_topic] = TopicLayout.of(queues)
    inst._layouts = layouts
    source = layouts[topology.stages[0].input_topic].queues
    broker = ForgetfulBroker([q for layout in layouts.values() for q in layout.queues], end=10)
    inst._admin_obj = broker  # type: ignore[assignment]
    return inst, broker, list(source), said


def test_the_instance_lag_commits_again_what_a_restarted_master_lost() -> None:
    inst, broker, source, said = _instance()
    inst.offsets.commit({q: 10 for q in source})
    assert inst.lag()[source[0].topic] == 0
    # broker-a's master restarts with what it flushed before: two queues behind.
    broker.committed[source[0]], broker.committed[source[1]] = 4, None
    assert inst.lag()[source[0].topic] == 16  # the broker's word, until committed again
    assert "broker group broker-a lost the committed offsets of 2 queues" in said[-1]
    broker.commits.clear()
    assert inst.commit_waiting() == 0
    assert broker.commits == [{source[0]: 10, source[1]: 10}]
    assert inst.lag()[source[0].topic] == 0


def test_an_offset_the_broker_has_beyond_ours_is_left_alone() -> None:
    inst, broker, source, said = _instance()
    inst.offsets.commit({source[0]: 6})
    broker.committed[source[0]] = 9  # e.g. committed by the instance before this one
    broker.commits.clear()
    inst.lag()
    assert inst.commit_waiting() == 0 and broker.commits == [] and said == []


def test_a_commit_landing_while_the_broker_answers_is_no_loss() -> None:
    """The lag reader asks the broker outside the commit lock: a batch's commit that lands
    between the broker's answer and the comparison must not look like a master that lost
    offsets (a false warning seen in production-shaped runs)."""
    inst, broker, source, said = _instance()
    inst.offsets.commit({q: 5 for q in source})
    answer = broker.group_offsets

    def answer_then_commit(
        group: str, topic: str, queues: list[MessageQueue], from_master: bool = False
    ) -> dict[MessageQueue, int | None]:
        stale = answer(group, topic, queues)  # the broker answers from before ...
        if topic == source[0].topic and not from_master:
            inst.offsets.commit({q: 9 for q in source})  # ... a commit that then lands
        return stale

    broker.group_offsets = answer_then_commit  # type: ignore[method-assign]
    broker.commits.clear()
    inst.lag()
    assert said == [] and inst.commit_waiting() == 0
    assert broker.commits == [{q: 9 for q in source[:2]}, {q: 9 for q in source[2:]}]
    # A real loss after that is still found, and the newest offset is what goes again.
    broker.group_offsets = answer  # type: ignore[method-assign]
    broker.committed[source[0]] = 2
    inst.lag()
    assert "lost the committed offsets of 1 queues" in said[-1]
    broker.commits.clear()
    assert inst.commit_waiting() == 0 and broker.commits == [{source[0]: 9}]
