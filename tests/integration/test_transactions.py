"""Transactional (half) messages against the real 5.3.3 broker: what a plain consumer sees.

The foundation of exactly-once sinks (issue 33): a prepared message is seen by
no consumer; a committed one is seen once, each key's in the order
committed; a rolled-back one never; one whose producer died is resolved by the
broker's check-back, answered by another process of its group. Read back with
the project's QueueReader, as any consumer reads, with no de-duplication; a
rollback is read from the broker's own record of it (its op queue).
"""

from __future__ import annotations

import collections
import threading
import time
import uuid

import pytest

from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer, OutgoingMessage
from stream_assets.rocketmq.discarded import PROPERTY_ORIGINAL_ID
from stream_assets.rocketmq.errors import SendError
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.rocketmq.transaction_checks import CheckResponder, TransactionCheck
from stream_assets.rocketmq.transactions import (
    PROPERTY_END_WINDOW,
    EndWindowClosedError,
    Outcome,
    TransactionalSender,
)
from stream_assets.runtime.core.sink_transactions import SeenIds, StepMessages, await_visible
from stream_assets.settings import RocketMQSettings
from tests.integration._engine_util import wait_until

pytestmark = pytest.mark.integration

QUEUES = 4


def _stored(admin: RocketMQAdmin, topic: str) -> dict[int, list[Record]]:
    reader = QueueReader(admin, group=f"it-tx-{uuid.uuid4().hex[:8]}")
    try:
        return {q.queue_id: list(reader.read(q, 0)) for q in admin.queues(topic)}
    finally:
        reader.close()


def test_prepared_messages_are_unseen_until_committed_then_seen_once_in_order(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = f"it-tx-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, QUEUES)
    messages = [
        OutgoingMessage(topic, f"result {i}".encode(), key=f"k{i % 7}", tags="sum")
        for i in range(60)
    ]
    with BatchProducer(client_settings) as producer:
        tx = TransactionalSender(producer, f"it-tx-group-{uuid.uuid4().hex[:6]}")
        prepared = tx.prepare(messages)
        # Each where send_all would have put it: the key's queue.
        assert [p.queue_id for p in prepared] == [
            queue_for_key(m.key or "", QUEUES) for m in messages
        ]
        assert all(not records for records in _stored(admin, topic).values())
        keep, drop = prepared[:45], prepared[45:]
        tx.commit(keep)
        tx.rollback(drop)
        # A broker refuses what is not a prepared message of the group.
        stranger = TransactionalSender(producer, "it-tx-another-group")
        with pytest.raises(SendError, match="commit of"):
            stranger.commit(tx.prepare([messages[0]]))

    stored = _stored(admin, topic)
    seen = [r for records in stored.values() for r in records]
    assert len(seen) == len({r.msg_id for r in seen}) == 45  # each once, nothing else
    by_id = {p.msg_id: m for p, m in zip(prepared, messages, strict=True)}
    # Each key's messages in the order committed (keys of one queue go in parallel).
    expected: dict[tuple[int, str | None], list[bytes]] = collections.defaultdict(list)
    for p in keep:
        expected[p.queue_id, by_id[p.msg_id].key].append(by_id[p.msg_id].body)
    got: dict[tuple[int, str | None], list[bytes]] = collections.defaultdict(list)
    for q, rs in stored.items():
        for r in rs:
            got[q, r.key].append(r.body)
    assert got == expected
    for r in seen:
        m = by_id[r.msg_id]
        assert (r.keys, r.tags) == ((m.key,), m.tags)


#: Where the broker records every commit and rollback of a half message: the
#: half queue's offset, comma-separated, in messages tagged "d" (TransactionalMessageUtil).
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"


def _ended_half_offsets(admin: RocketMQAdmin, broker_name: str) -> set[int]:
    reader = QueueReader(admin, group=f"it-tx-ops-{uuid.uuid4().hex[:8]}")
    try:
        queue = MessageQueue(OP_TOPIC, broker_name, 0)
        # From the first op record still stored: a broker that has served for days has
        # deleted its expired files (fileReservedTime), and this test's are the newest.
        records = reader.read(queue, admin.min_offset(queue))
        return {int(o) for r in records if r.tags == "d" for o in r.body.decode().split(",") if o}
    finally:
        reader.close()


def test_a_dead_producers_transactions_are_resolved_by_the_check_back_of_another(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    """A producer prepares 24 half messages and dies without ending any. Another process
    of its group answers the broker's checks as an exactly-once sink does: commit what a
    durable record says landed (here every other message), unless a consumer already sees
    it; roll back the rest. The broker makes the landed ones visible, each once, and
    records the rollback of the others, which no consumer ever sees."""
    topic = f"it-txc-{uuid.uuid4().hex[:8]}"
    group = f"it-txc-group-{uuid.uuid4().hex[:6]}"
    admin.create_topic(topic, QUEUES)
    messages = [OutgoingMessage(topic, f"r{i}".encode(), key=f"k{i}") for i in range(24)]
    with BatchProducer(client_settings) as producer:
        prepared = TransactionalSender(producer, group).prepare(messages)
    # The producer is gone; nothing ended its transactions.
    landed = {p.msg_id for p in prepared[::2]}
    where = {p.msg_id: (p.topic, p.queue_id, p.broker_name) for p in prepared}
    answers: dict[str, list[tuple[Outcome, int]]] = collections.defaultdict(list)
    lock = threading.Lock()

    def visible() -> list[str]:
        return [r.msg_id for rs in _stored(admin, topic).values() for r in rs]

    def resolve(check: TransactionCheck) -> Outcome:
        p = check.prepared
        assert where[p.msg_id] == (p.topic, p.queue_id, p.broker_name), p
        outcome = (
            Outcome.COMMIT if p.msg_id in landed and p.msg_id not in visible() else Outcome.ROLLBACK
        )
        with lock:
            answers[p.msg_id].append((outcome, p.tran_state_offset))
        return outcome

    with CheckResponder(client_settings, group, resolve) as responder:
        # Checked 6 s after its birth at the earliest, then every 5 s (broker_tuning).
        wait_until(lambda: sorted(visible()) == sorted(landed), 120, "the landed ones visible")
        rolled_back = set(where) - landed
        wait_until(
            lambda: (
                len(answers) == len(where)
                and {
                    offset
                    for m in rolled_back
                    for outcome, offset in answers[m]
                    if outcome == Outcome.ROLLBACK
                }
                <= _ended_half_offsets(admin, prepared[0].broker_name)
            ),
            120,
            "the broker's record of every rollback",
        )
        assert responder.answered[Outcome.UNKNOWN] == 0
    seen = visible()
    assert sorted(seen) == sorted(landed), "a rolled-back message became visible, or one twice"
    assert all(outcome == Outcome.ROLLBACK for m in rolled_back for outcome, _ in answers[m])


def test_past_its_end_window_only_the_check_back_ends_a_message(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    """What exactly-once sinks build on (``END_WINDOW_S``): with CHECK_IMMUNITY_TIME_IN_SECONDS
    on a half message, the broker refuses its producer's end once the window has passed,
    and asks the group about it only after the window; the check's commit makes it
    visible, once. The window is the broker's minimum here (its transactionTimeOut, 6 s on
    the brokers stream-assets starts): the premise is time passing, so the test waits it."""
    topic = f"it-txw-{uuid.uuid4().hex[:8]}"
    group = f"it-txw-group-{uuid.uuid4().hex[:6]}"
    admin.create_topic(topic, QUEUES)
    window_s = 6
    messages = [OutgoingMessage(topic, f"w{i}".encode(), key=f"k{i}") for i in range(6)]
    checked_at: list[float] = []

    def resolve(check: TransactionCheck) -> Outcome:
        checked_at.append(time.time())
        return Outcome.COMMIT

    with (
        CheckResponder(client_settings, group, resolve),
        BatchProducer(client_settings) as producer,
    ):
        sender = TransactionalSender(producer, group)
        born = time.time()
        prepared = sender.prepare(messages, {PROPERTY_END_WINDOW: str(window_s)})
        time.sleep(window_s + 1.5)
        with pytest.raises(EndWindowClosedError):
            sender.commit(prepared)
        ids = {p.msg_id for p in prepared}
        wait_until(
            lambda: (
                sorted(r.msg_id for rs in _stored(admin, topic).values() for r in rs) == sorted(ids)
            ),
            60,
            "the checked messages visible",
        )
    assert min(checked_at) >= born + window_s, "asked before the window closed"


def test_a_step_whose_messages_the_broker_discarded_is_delivered_once_by_the_next(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    """Half messages nobody answers checks for are discarded after transactionCheckMax
    checks (lowered to 1 on the broker for this test): the broker keeps copies in
    TRANS_CHECK_MAX_TIME_TOPIC and never delivers them. The next step's wait for them
    finds them there and delivers each once, plainly, to its queue in its order, naming
    its original id; a second wait finds them delivered and sends nothing."""
    topic = f"it-txd-{uuid.uuid4().hex[:8]}"
    group = f"it-txd-group-{uuid.uuid4().hex[:6]}"
    admin.create_topic(topic, QUEUES)
    (broker,) = admin.cluster_brokers()
    before = admin.broker_config(broker)["transactionCheckMax"]
    messages = [
        OutgoingMessage(topic, f"d{i}".encode(), key=f"k{i % 3}", properties={"user": str(i)})
        for i in range(12)
    ]
    reader = QueueReader(admin, group=f"it-txd-read-{uuid.uuid4().hex[:8]}")
    seen = SeenIds(admin, reader)
    admin.update_broker_config(broker, {"transactionCheckMax": "1"})
    try:
        with BatchProducer(client_settings) as producer:
            born = int(time.time() * 1000)
            # The broker's floor for a window is its transactionTimeOut (6 s here).
            prepared = TransactionalSender(producer, group).prepare(
                messages, {PROPERTY_END_WINDOW: "6"}
            )
        # The producer is gone, and no process of its group answers the checks.
        queues: dict[MessageQueue, list[str]] = {}
        for p in prepared:
            queues.setdefault(MessageQueue(p.topic, p.broker_name, p.queue_id), []).append(p.msg_id)
        step = StepMessages(born, queues)
        wait_until(
            lambda: len(seen.discarded(step, step.queues)) == len(prepared),
            120,
            "every half message discarded",
        )
    finally:
        admin.update_broker_config(broker, {"transactionCheckMax": before})
    try:
        assert not any(_stored(admin, topic).values()), "a discarded message was delivered"
        with BatchProducer(client_settings) as producer:
            await_visible(seen, step, 30, TransactionalSender(producer, group).resend)

        def resend_nothing(discarded: object) -> None:
            raise AssertionError(f"re-sent again: {discarded}")

        await_visible(SeenIds(admin, reader), step, 5, resend_nothing)
    finally:
        reader.close()
    stored = _stored(admin, topic)
    by_id = {p.msg_id: m for p, m in zip(prepared, messages, strict=True)}
    for queue, ids in queues.items():
        records = stored[queue.queue_id]
        assert [r.properties[PROPERTY_ORIGINAL_ID] for r in records] == ids, queue
        for r in records:
            original = by_id[r.properties[PROPERTY_ORIGINAL_ID]]
            assert (r.body, r.keys, r.properties["user"]) == (
                original.body,
                (original.key,),
                original.properties["user"] if original.properties else None,
            )
            assert "TRAN_MSG" not in r.properties and "SA_STEP" not in r.properties
    assert admin.broker_config(broker)["transactionCheckMax"] == before
