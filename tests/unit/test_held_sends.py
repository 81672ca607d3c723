"""A real-time task's held sends: a group without a master is held back, in order, bounded."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pytest

from stream_assets.rocketmq.errors import BrokerUnreachableError
from stream_assets.rocketmq.records import OutgoingMessage, SendReceipt
from stream_assets.runtime.core.send_buffer import SendBuffer
from stream_assets.runtime.drive.held_sends import GroupWentDown, HeldSends


class Groups:
    """Shuffle queues 0-1 on broker-a, 2-3 on broker-b; stores what reaches a live group."""

    max_message_size = 4 << 20

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.stored: dict[int, list[bytes]] = {q: [] for q in range(4)}

    @staticmethod
    def group(m: OutgoingMessage) -> str:
        assert m.queue_id is not None
        return "broker-a" if m.queue_id < 2 else "broker-b"

    def send_reachable(
        self, messages: Sequence[OutgoingMessage], skip: Collection[str] = ()
    ) -> tuple[list[SendReceipt | None], dict[int, str]]:
        receipts: list[SendReceipt | None] = []
        unsent: dict[int, str] = {}
        for i, m in enumerate(messages):
            group = self.group(m)
            if group in skip or group in self.dead:
                receipts.append(None)
                unsent[i] = group
                continue
            assert m.queue_id is not None
            self.stored[m.queue_id].append(m.body)
            receipts.append(SendReceipt(m.topic, m.queue_id, 0, "", group))
        return receipts, unsent


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(
    held: HeldSends, queue: tuple[int, int], start: int, bodies: list[tuple[int, str]]
) -> None:
    buffer = SendBuffer(held.transport(queue, start))
    for target, body in bodies:
        buffer.send("shuffle", body.encode(), queue_id=target)
    buffer.flush()


def test_a_group_without_a_master_is_held_in_order_and_sent_when_it_answers() -> None:
    brokers, clock, said = Groups(), Clock(), []
    held = HeldSends(lambda: brokers, 1 << 20, retry_every_s=5.0, log=said.append, clock=clock)
    brokers.dead.add("broker-b")
    step(held, (0, 0), 10, [(0, "a1"), (2, "b1"), (3, "b2")])
    assert held.held_from((0, 0)) == 10 and held.groups == {"broker-b"}
    assert brokers.stored[0] == [b"a1"] and "broker-b does not answer" in said[0]
    # broker-b is back, but not asked again before the retry is due: later messages
    # for it go behind the held ones; broker-a's are sent at once.
    brokers.dead.clear()
    clock.now += 1
    step(held, (0, 0), 20, [(0, "a2"), (2, "b3")])
    step(held, (0, 1), 5, [(3, "b4")])
    assert brokers.stored == {0: [b"a1", b"a2"], 1: [], 2: [], 3: []}
    assert (held.held_from((0, 0)), held.held_from((0, 1)), held.messages) == (10, 5, 4)
    held.retry()  # not due yet
    assert held.take_cleared() == [] and held.messages == 4
    clock.now += 5
    held.retry()
    assert held.take_cleared() == [(0, 0), (0, 1)] and held.take_cleared() == []
    # Each queue's messages of one origin in offset order.
    assert brokers.stored[2] == [b"b1", b"b3"] and brokers.stored[3] == [b"b2", b"b4"]
    assert held.held_from((0, 0)) is None and held.groups == set() and held.bytes == 0
    assert "broker-b answers again" in said[-1]


def test_a_retry_while_the_group_is_still_down_keeps_everything_held() -> None:
    brokers, clock = Groups(), Clock()
    held = HeldSends(lambda: brokers, 1 << 20, retry_every_s=5.0, log=lambda _: None, clock=clock)
    brokers.dead.add("broker-b")
    step(held, (0, 0), 10, [(2, "b1"), (2, "b2")])
    clock.now += 6
    held.retry()
    assert held.take_cleared() == []
    assert held.messages == 2 and held.held_from((0, 0)) == 10 and held.bytes == 4


def test_past_the_limit_a_step_waits_and_sends_nothing() -> None:
    brokers, clock = Groups(), Clock()
    held = HeldSends(lambda: brokers, 4, retry_every_s=5.0, log=lambda _: None, clock=clock)
    brokers.dead.add("broker-b")
    step(held, (0, 0), 10, [(2, "b1"), (2, "b2")])  # 4 bytes: the limit
    with pytest.raises(BrokerUnreachableError, match="STREAM_ASSETS_ENGINE_HELD_SEND_BYTES"):
        step(held, (0, 0), 20, [(0, "a1"), (2, "b3")])
    assert brokers.stored[0] == []  # nothing of the refused step went
    brokers.dead.clear()
    step(held, (0, 0), 20, [(0, "a1"), (2, "b3")])  # the step again: held ones first
    assert brokers.stored[2] == [b"b1", b"b2", b"b3"] and held.messages == 0


def test_a_queue_cleared_inside_a_step_is_reported_once_unless_it_holds_again() -> None:
    brokers, clock = Groups(), Clock()
    held = HeldSends(lambda: brokers, 1 << 20, retry_every_s=5.0, log=lambda _: None, clock=clock)
    brokers.dead.add("broker-b")
    step(held, (0, 0), 10, [(2, "b1")])
    step(held, (0, 1), 10, [(3, "c1")])
    brokers.dead.clear()
    clock.now += 6
    step(held, (0, 2), 7, [(0, "a1")])  # the retry falls due inside another queue's send
    assert held.messages == 0
    brokers.dead.add("broker-b")
    step(held, (0, 1), 20, [(3, "c2")])  # held again before anyone asked
    assert held.take_cleared() == [(0, 0)]  # (0, 1) holds from 20: its commit stays there
    assert held.held_from((0, 1)) == 20


def test_a_step_of_several_queues_holds_nothing_and_marks_the_group_down() -> None:
    groups, logs = Groups(), []
    held = HeldSends(lambda: groups, 1 << 20, retry_every_s=5.0, log=logs.append, clock=Clock())
    groups.dead.add("broker-b")
    buffer = SendBuffer(held.unheld_transport())
    buffer.send("shuffle", b"a", queue_id=0)
    buffer.send("shuffle", b"b", queue_id=2)
    with pytest.raises(GroupWentDown, match="broker-b"):
        buffer.flush()
    assert held.messages == 0 and held.groups == {"broker-b"}
    assert groups.stored[0] == [b"a"], "the healthy group's message is stored"
    # The step again queue by queue: broker-b's message is held at once.
    step(held, (0, 1), 10, [(0, "a"), (2, "b")])
    assert held.held_from((0, 1)) == 10 and groups.stored[2] == []
    assert len(logs) == 1 and "broker-b does not answer" in logs[0]
