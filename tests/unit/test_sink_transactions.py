"""Exactly-once sinks on the real per-queue core (TopologyTestDriver: real RocksDB, in-memory
topics whose half messages stand in for the broker's).

A plain reader of the sink sees each result once, each key's in step order, with no
de-duplication: across a step whose delta never landed, an owner that died between
its delta and the end of its transaction, and a step ended too late, whose messages
the check-back (answered from the state queue, as an instance answers it) commits
once their end window closed. The expected counts come from the input, counted here.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.discarded import PROPERTY_ORIGINAL_ID
from stream_assets.rocketmq.records import OutgoingMessage
from stream_assets.rocketmq.transaction_checks import TransactionCheck
from stream_assets.rocketmq.transactions import Outcome, Prepared
from stream_assets.runtime.core import sink_transactions
from stream_assets.runtime.drive.sink_checks import resolve_from_state
from stream_assets.testing import InMemoryBroker, TopologyTestDriver, _TopicView
from stream_assets.windows import Time, TumblingWindow
from tests.consumer_rule import plain_counts

WORDS = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen"]


def _wordcount(exactly_once: bool = True) -> Topology:
    builder = StreamBuilder("eos", exactly_once_sinks=exactly_once)
    (
        builder.source("lines", lambda body: body.decode())
        .flat_map(str.split)
        .key_by(str)
        .count()
        .to_rstream()
        .sink("counts")
    )
    return builder.build()


def _lines(seed: int, n: int) -> list[str]:
    rnd = random.Random(seed)
    return [" ".join(rnd.choices(WORDS, k=rnd.randint(1, 6))) for _ in range(n)]


class CheckService:
    """The broker's check-back over the in-memory half messages: every round, each half
    message past its end window gets its answer from the state queue, as an instance's
    driver gives it."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self.broker = broker
        view = _TopicView(broker)
        self.resolve = resolve_from_state(view, view)
        self.answers: collections.Counter[Outcome] = collections.Counter()
        #: The messages a check committed, in the order it did (not a queue's order).
        self.committed: list[OutgoingMessage] = []

    def round(self) -> None:
        # Latest first: a queue's order must hold whatever order the broker checks in.
        for msg_id, (message, prepared) in reversed(list(self.broker.half.items())):
            if msg_id not in self.broker.windows_closed:
                continue
            outcome = self.resolve(TransactionCheck(prepared, message.properties or {}))
            self.answers[outcome] += 1
            if outcome is Outcome.COMMIT:
                self.broker.commit([prepared], from_check=True)
                self.committed.append(message)
            elif outcome is Outcome.ROLLBACK:
                self.broker.rollback([prepared], from_check=True)


@contextlib.contextmanager
def checking(service: CheckService) -> Iterator[None]:
    """Check rounds in the background while the block runs, as the broker's service does;
    between rounds the end window of every message held passes (a step still running
    may find its own end refused: the check-back must then end it alike). After the
    block, time passes for what is still held and a last round ends it: a step whose
    end was refused after the loop's last round leaves messages whose windows were
    still open (a slow machine failed the tests here, 3 runs in 12 under CPU load)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.01):
            service.round()
            service.broker.close_end_windows()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    service.broker.close_end_windows()
    service.round()


def test_results_are_seen_once_and_nothing_stays_prepared(tmp_path: Any) -> None:
    lines = _lines(1, 300)
    with TopologyTestDriver(
        _wordcount(), state_dir=tmp_path, sink_queues=3, max_records_per_batch=7
    ) as driver:
        for line in lines:
            driver.pipe(line)
        driver.advance()
        records = driver.output_records("counts")
        assert not driver.broker.half
    assert plain_counts(records) == collections.Counter(w for line in lines for w in line.split())


def test_a_step_whose_delta_did_not_land_leaves_nothing_seen(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state record's send fails (unknown to the step whether it landed): no rollback
    from the step; the retry's delta takes the offset, so the check-back rolls the
    first attempt's messages back."""
    lines = _lines(2, 120)
    topology = _wordcount()
    with TopologyTestDriver(topology, state_dir=tmp_path, sink_queues=2) as driver:
        broker = driver.broker
        real = broker.send_all
        failed: list[int] = []

        def send_all(messages: list[OutgoingMessage]) -> Any:
            if not failed and any(m.topic in topology.state_topics for m in messages):
                failed.append(len(broker.half))
                raise ConnectionError("the broker went away")
            return real(messages)

        monkeypatch.setattr(broker, "send_all", send_all)
        for line in lines:
            driver.pipe(line)
        with pytest.raises(ConnectionError):
            driver.advance()
        assert failed and failed[0] > 0 and broker.half, "the failed step prepared its results"
        checks = CheckService(broker)
        broker.close_end_windows()
        checks.round()  # nothing at its offset yet: asked again later
        assert checks.answers == {Outcome.UNKNOWN: failed[0]}
        driver.advance()  # the step again: its delta lands where the first one's would have
        checks.round()
        assert checks.answers[Outcome.ROLLBACK] == failed[0] and not broker.half
        records = driver.output_records("counts")
    assert plain_counts(records) == collections.Counter(w for line in lines for w in line.split())


def test_an_owner_dead_between_its_delta_and_its_commit_is_followed_in_order(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end of a step's transaction fails after its delta landed (its owner died). The
    new owner's first step waits until the check-back committed the dead step's messages,
    so its own are seen only after them."""
    first, second = _lines(3, 80), _lines(4, 80)
    with TopologyTestDriver(_wordcount(), state_dir=tmp_path, sink_queues=2) as driver:
        broker = driver.broker
        real = broker.commit
        monkeypatch.setattr(broker, "commit", _fail_once(real))
        for line in first:
            driver.pipe(line)
        with pytest.raises(ConnectionError):
            driver.advance()
        stranded = len(broker.half)
        assert stranded > 0
        checks = CheckService(broker)
        checks.round()
        assert not checks.answers, "asked before the end window closed"
        driver.restore_state()  # a new owner: its store from the state topic
        for line in second:
            driver.pipe(line)
        with checking(checks):
            driver.advance()
        assert not broker.half
        # The dead step's, and any of the new owner's the checks came first to.
        assert checks.answers[Outcome.COMMIT] >= stranded
        records = driver.output_records("counts")
    words = collections.Counter(w for line in first + second for w in line.split())
    assert plain_counts(records) == words


def test_a_step_not_ended_in_its_window_is_committed_by_the_check_back_with_no_next_step(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step so slow that the broker refuses its end does not fail. The check-back
    commits its messages though no later step comes (the input ended), and its owner's
    next step starts only once they are seen."""
    first, second = _lines(5, 60), _lines(6, 60)
    with TopologyTestDriver(
        _wordcount(), state_dir=tmp_path, sink_queues=1, shuffle_queues=1
    ) as driver:
        broker = driver.broker
        real = broker.commit

        def too_late(prepared: list[Prepared], **kwargs: Any) -> None:
            broker.close_end_windows()
            real(prepared, **kwargs)

        monkeypatch.setattr(broker, "commit", too_late)
        for line in first:
            driver.pipe(line)
        driver.advance()  # refused: left to the check-back, the step itself went fine
        late = len(broker.half)
        assert late > 0
        monkeypatch.undo()
        checks = CheckService(broker)
        checks.round()
        assert checks.answers == {Outcome.COMMIT: late} and not broker.half
        assert plain_counts(driver.output_records("counts")) == collections.Counter(
            w for line in first for w in line.split()
        )
        monkeypatch.setattr(broker, "commit", too_late)
        for line in second:
            driver.pipe(line)
        driver.advance()
        monkeypatch.undo()
        for line in first:  # the owner's next step waits for the refused one's
            driver.pipe(line)
        with checking(checks):
            driver.advance()
        assert not broker.half
        records = driver.output_records("counts")
    assert plain_counts(records) == collections.Counter(
        w for line in first + second + first for w in line.split()
    )


def test_two_owners_dead_in_a_row_their_messages_are_seen_in_step_order(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner dies before ending its step; the next one dies waiting for that step's
    messages, before a step of its own. The third owner's results are seen only after
    the first's, so every word's counts still rise."""
    batches = [_lines(7 + i, 50) for i in range(3)]
    with TopologyTestDriver(
        _wordcount(), state_dir=tmp_path, sink_queues=1, shuffle_queues=1
    ) as driver:
        broker = driver.broker
        monkeypatch.setattr(broker, "commit", _fail_once(broker.commit))
        for line in batches[0]:
            driver.pipe(line)
        with pytest.raises(ConnectionError):
            driver.advance()
        driver.restore_state()

        def killed_waiting(*_args: Any, **_kwargs: Any) -> None:
            raise ConnectionError("killed while waiting for the previous step")

        monkeypatch.setattr(sink_transactions, "await_visible", killed_waiting)
        for line in batches[1]:
            driver.pipe(line)
        with pytest.raises(ConnectionError):
            driver.advance()
        monkeypatch.undo()
        driver.restore_state()
        for line in batches[2]:
            driver.pipe(line)
        checks = CheckService(broker)
        with checking(checks):
            driver.advance()
        assert not broker.half
        records = driver.output_records("counts")
    assert plain_counts(records) == collections.Counter(
        w for batch in batches for line in batch for w in line.split()
    )


def test_windows_fired_by_a_step_whose_owner_died_are_each_seen_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A windowed sum: the step that fires the first windows dies before ending them; the
    next owner fires the rest. A plain reader sees one result per window and key, each the
    sum of its events."""
    builder = StreamBuilder("eosw", exactly_once_sinks=True)
    (
        builder.source("events", json.loads)
        .key_by(lambda e: e["key"])
        .window(TumblingWindow.of(Time.seconds(10)))
        .sum("v", "sum")
        .to_rstream()
        .sink("sums")
    )
    rnd = random.Random(8)
    events = [(rnd.choice("abcd"), rnd.randint(1, 9), i * 250) for i in range(240)]
    expected: collections.Counter[tuple[str, int]] = collections.Counter()
    for key, value, ts in events:
        expected[key, ts - ts % 10_000] += value
    half = len(events) // 2
    with TopologyTestDriver(
        builder.build(), state_dir=tmp_path, source_queues=1, shuffle_queues=1
    ) as driver:
        broker = driver.broker
        monkeypatch.setattr(broker, "commit", _fail_once(broker.commit))
        for key, value, ts in events[:half]:
            driver.pipe({"key": key, "v": value}, event_time=ts)
        with pytest.raises(ConnectionError):
            driver.advance()  # the watermark fired the first windows: not ended
        assert broker.half
        driver.restore_state()
        for key, value, ts in events[half:]:
            driver.pipe({"key": key, "v": value}, event_time=ts)
        with checking(CheckService(broker)):
            driver.advance_idle()
        assert not broker.half
        records = driver.output_records("sums")
    results = [json.loads(r.body) for r in records]
    windows = [(o["key"], o["window_start"]) for o in results]
    assert len(windows) == len(set(windows)), "a window's result was seen twice"
    assert {(o["key"], o["window_start"]): o["sum"] for o in results} == dict(expected)


def _fail_once(real: Any) -> Any:
    calls: list[int] = []

    def commit(prepared: list[Prepared], **kwargs: Any) -> None:
        if not calls:
            calls.append(1)
            raise ConnectionError("killed before its commit")
        real(prepared, **kwargs)

    return commit


def _copies_and_counts() -> Topology:
    """Each line copied, upper-cased, to an exactly-once sink before any aggregate (a
    positioned source stage), and its words counted (the same stage's shuffle)."""
    builder = StreamBuilder("eos0", exactly_once_sinks=True)
    lines = builder.source("lines", lambda body: body.decode())
    lines.map(str.upper).sink("copies")
    lines.flat_map(str.split).key_by(str).count().to_rstream().sink("counts")
    return builder.build()


def _numbered(seed: int, first: int, n: int) -> list[str]:
    """Lines that name their number (``n<i>``): a copy tells which line it is."""
    return [f"n{i} {line}" for i, line in enumerate(_lines(seed, n), start=first)]


def _pipe_numbered(driver: TopologyTestDriver, lines: list[str]) -> None:
    for line in lines:
        driver.pipe(line, queue=int(line.split()[0][1:]) % driver.source_queues)


def _assert_copied_once_in_order(
    records: list[Any], lines: list[str], queues: int, unordered: frozenset[str] = frozenset()
) -> None:
    """Every line's copy seen once, each source queue's in the order piped, but for the
    ``unordered`` copies: a dead step's, which the check-back commits in its own order
    (in their place, as one block: the next step waited for all of them)."""
    copies = [json.loads(r.body) for r in records]
    assert collections.Counter(copies) == collections.Counter(line.upper() for line in lines)

    def of_queue(values: list[str], q: int) -> list[str]:
        mine = [v for v in values if int(v.split()[0][1:]) % queues == q]
        return ["*" if v in unordered else v for v in mine]

    for q in range(queues):
        assert of_queue(copies, q) == of_queue([line.upper() for line in lines], q)


def test_a_sink_before_any_aggregate_sees_each_record_once_with_its_position_logged(
    tmp_path: Any,
) -> None:
    lines = _numbered(11, 0, 200)
    topology = _copies_and_counts()
    log_topic = topology.stages[0].state_topic
    assert topology.stages[0].positioned and log_topic == "eos0__state__source-0"
    with TopologyTestDriver(topology, state_dir=tmp_path, max_records_per_batch=9) as driver:
        _pipe_numbered(driver, lines)
        driver.advance()
        assert not driver.broker.half
        _assert_copied_once_in_order(driver.output_records("copies"), lines, driver.source_queues)
        counts = driver.output_records("counts")
        logged = driver.broker.topic(log_topic)
        assert all(logged.end(q) > 0 for q in range(driver.source_queues))
    assert plain_counts(counts) == collections.Counter(w for line in lines for w in line.split())


def test_a_source_step_dead_between_its_delta_and_its_end_is_never_sent_again(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source step's delta landed, its end and its consumer offset did not: the next
    owner reads the same range again, skips what the landed step read (its copies are
    the check-back's to commit, once, in the check-back's order), and its own copies come
    after them."""
    first, second = _numbered(12, 0, 60), _numbered(13, 60, 60)
    with TopologyTestDriver(_copies_and_counts(), state_dir=tmp_path) as driver:
        broker = driver.broker
        monkeypatch.setattr(broker, "commit", _fail_once(broker.commit))
        _pipe_numbered(driver, first)
        with pytest.raises(ConnectionError):
            driver.advance()  # the first source queue's step: landed, not ended
        stranded = len(broker.half)
        assert stranded > 0
        dead_step = frozenset(json.loads(message.body) for message, _ in broker.half.values())
        driver.restore_state()  # a new owner: its stores from the state topics
        _pipe_numbered(driver, second)
        checks = CheckService(broker)
        with checking(checks):
            driver.advance()
        assert not broker.half
        # The dead step's, and any later step's the checks came first to (a step whose
        # own end is then refused leaves it to them).
        assert checks.answers[Outcome.COMMIT] >= stranded
        replayed = [s for s in driver.stats if s.stage == 0 and s.skipped_duplicates]
        assert replayed, "the replay skipped the records the landed step had read"
        copies, counts = driver.output_records("copies"), driver.output_records("counts")
    # The check-back's commits keep no queue order within a step, the dead step's and
    # that of a step whose own end was refused alike: each is a block in its place.
    by_checks = frozenset(json.loads(m.body) for m in checks.committed if m.topic == "copies")
    assert dead_step <= by_checks
    _assert_copied_once_in_order(copies, first + second, 4, by_checks)
    assert plain_counts(counts) == collections.Counter(
        w for line in first + second for w in line.split()
    )


def test_a_source_step_whose_delta_did_not_land_is_rolled_back_by_the_check_back(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = _numbered(14, 0, 80)
    topology = _copies_and_counts()
    with TopologyTestDriver(topology, state_dir=tmp_path) as driver:
        broker = driver.broker
        real = broker.send_all
        failed: list[int] = []

        def send_all(messages: list[OutgoingMessage]) -> Any:
            if not failed and any(m.topic == topology.stages[0].state_topic for m in messages):
                failed.append(len(broker.half))
                raise ConnectionError("the broker went away")
            return real(messages)

        monkeypatch.setattr(broker, "send_all", send_all)
        _pipe_numbered(driver, lines)
        with pytest.raises(ConnectionError):
            driver.advance()
        assert failed and failed[0] > 0
        checks = CheckService(broker)
        broker.close_end_windows()
        checks.round()
        assert checks.answers == {Outcome.UNKNOWN: failed[0]}
        driver.advance()
        checks.round()
        assert checks.answers[Outcome.ROLLBACK] == failed[0] and not broker.half
        copies = driver.output_records("copies")
    _assert_copied_once_in_order(copies, lines, 4)


def test_a_step_whose_messages_the_broker_discarded_is_delivered_by_the_next(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner died between its delta and its end, and no instance answered the checks
    until the broker gave up on the step's messages: the next owner finds them among the
    discarded and delivers each once, before its own, so each word's counts still rise."""
    first, second = _lines(21, 80), _lines(22, 80)
    with TopologyTestDriver(_wordcount(), state_dir=tmp_path, sink_queues=2) as driver:
        broker = driver.broker
        monkeypatch.setattr(broker, "commit", _fail_once(broker.commit))
        for line in first:
            driver.pipe(line)
        with pytest.raises(ConnectionError):
            driver.advance()
        assert broker.discard() > 0 and not broker.half
        driver.restore_state()
        for line in second:
            driver.pipe(line)
        driver.advance()  # no check-back at all: the discarded are its only way
        records = driver.output_records("counts")
    assert plain_counts(records) == collections.Counter(
        w for line in first + second for w in line.split()
    )
    assert any(PROPERTY_ORIGINAL_ID in r.properties for r in records)
