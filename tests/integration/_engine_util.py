"""Helpers for the engine end-to-end tests: produce fast, read sinks, poll with a deadline.

Also :func:`totals_topology`, the plain keyed sum several test modules run.

No test logic and no reference answers live here: the tests compute those
themselves from the input they generate. How a consumer reads a sink
(``latest_by_message_key``, ``current_results``, ``final_counts``) is
:mod:`tests.consumer_rule`, imported here for the tests that read sinks.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.serde import json_deserializer
from stream_assets.settings import RocketMQSettings
from stream_assets.state.records import Delta, decode_record, is_void
from tests.consumer_rule import current_results, final_counts, latest_by_message_key
from tests.integration._util import wait_for

__all__ = ["current_results", "final_counts", "latest_by_message_key"]

T = TypeVar("T")


def unique(prefix: str) -> str:
    """A job id / topic name no other test (or earlier run) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class Message:
    """One message to produce: body, optional key (routes by stable hash) or explicit
    queue, optional tag."""

    body: bytes
    key: str | None = None
    queue_id: int | None = None
    tags: str | None = None


def produce(
    settings: RocketMQSettings,
    topic: str,
    messages: Sequence[Message],
    threads: int = 1,
) -> None:
    """Send ``messages`` to ``topic`` with ``threads`` producers (one Producer per thread).

    Messages bound for the same queue keep their relative order only when
    ``threads == 1`` or when they are pinned to a queue with ``queue_id`` and
    every queue is sent by a single thread (see :func:`produce_per_queue`).
    """
    if threads <= 1:
        _send_all(settings, topic, messages)
        return
    shares = [messages[i::threads] for i in range(threads)]
    _run_threads(settings, topic, shares)


def produce_per_queue(
    settings: RocketMQSettings, topic: str, per_queue: dict[int, Sequence[bytes]]
) -> None:
    """Send each queue's bodies, in order, from a thread of its own (order kept per queue)."""
    shares = [[Message(b, queue_id=q) for b in bodies] for q, bodies in sorted(per_queue.items())]
    _run_threads(settings, topic, shares)


def _send_all(settings: RocketMQSettings, topic: str, messages: Sequence[Message]) -> None:
    with Producer(settings) as producer:
        for m in messages:
            producer.send(topic, m.body, key=m.key, tags=m.tags, queue_id=m.queue_id)


def _run_threads(
    settings: RocketMQSettings, topic: str, shares: Sequence[Sequence[Message]]
) -> None:
    errors: list[BaseException] = []

    def work(share: Sequence[Message]) -> None:
        try:
            _send_all(settings, topic, share)
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(s,), daemon=True) for s in shares if s]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


class BackgroundProducer:
    """Produce messages from threads while the test goes on; ``join()`` re-raises errors.

    With ``pause_after``, each thread stops after that many of its messages
    until :meth:`resume` is called, so a test knows input is still to come.
    """

    def __init__(
        self,
        settings: RocketMQSettings,
        topic: str,
        messages: Sequence[Message],
        threads: int = 4,
        pause_after: int | None = None,
    ) -> None:
        self.sent = 0
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._pause_after = pause_after
        self._gate = threading.Event()
        if pause_after is None:
            self._gate.set()
        shares = [messages[i::threads] for i in range(threads)]
        self._threads = [
            threading.Thread(target=self._work, args=(settings, topic, s), daemon=True)
            for s in shares
            if s
        ]

    def _work(self, settings: RocketMQSettings, topic: str, share: Sequence[Message]) -> None:
        try:
            with Producer(settings) as producer:
                for i, m in enumerate(share):
                    if i == self._pause_after:
                        self._gate.wait()
                    producer.send(topic, m.body, key=m.key, tags=m.tags, queue_id=m.queue_id)
                    with self._lock:
                        self.sent += 1
        except BaseException as exc:
            self._errors.append(exc)

    def start(self) -> BackgroundProducer:
        for t in self._threads:
            t.start()
        return self

    def resume(self) -> None:
        """Let paused threads send the rest."""
        self._gate.set()

    @property
    def running(self) -> bool:
        """Whether some thread is still sending."""
        return any(t.is_alive() for t in self._threads)

    def join(self, timeout_s: float = 300) -> None:
        self.resume()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise AssertionError(f"background producer still running after {timeout_s}s")
        if self._errors:
            raise self._errors[0]


def read_topic(admin: RocketMQAdmin, topic: str) -> list[Record]:
    """Every record stored in ``topic``, queue by queue, in offset order within a queue."""
    reader = QueueReader(admin, group=unique("it-engine-check"))
    try:
        out: list[Record] = []
        for queue in admin.queues(topic):
            out.extend(reader.read(queue, 0))
        return out
    finally:
        reader.close()


def await_readable(
    admin: RocketMQAdmin,
    topic: str,
    wanted: Collection[str],
    ids: Callable[[Record], Iterable[str]] = lambda r: r.keys,
) -> None:
    """Wait until a message of each of ``wanted`` (what was just sent, by the ``ids`` a
    record carries: its message keys unless told) can be read from ``topic``'s queues
    on the groups that answer.

    A send returns once the master stored the message, yet readers see it only once
    it is dispatched, and a controller-mode group with a slave dispatches a message
    once its in-sync replicas hold it: moments later, seconds on a loaded machine (a
    reference read right after a send missed a quarter of the input). A reference
    computed from what a topic holds reads it after this.
    """
    missing = set(wanted)

    def all_readable() -> bool:
        missing.difference_update(i for r in read_topic(admin, topic) for i in ids(r))
        return not missing

    wait_for(
        all_readable,
        timeout_s=60.0,
        what=f"what was sent to {topic} to be readable",
        interval_s=0.1,
    )


def state_writers(admin: RocketMQAdmin, state_topic: str) -> dict[str, list[str]]:
    """Per state queue (``broker:queue``), the writer of each valid commit, in commit order.

    Two instances never own a queue at once when each writer's commits form one
    contiguous block (a killed run's replacement is a new writer after it).
    """
    reader = QueueReader(admin, group=unique("it-state-writers"))
    out: dict[str, list[str]] = {}
    try:
        for queue in admin.queues(state_topic):
            writers: list[str] = []
            for record in reader.read(queue, admin.min_offset(queue)):
                decoded = decode_record(record.body)
                if is_void(decoded, record.queue_offset):
                    continue
                if isinstance(decoded, Delta) and decoded.part == 0 and decoded.meta is not None:
                    writers.append(decoded.meta.writer)
            out[f"{queue.broker_name}:{queue.queue_id}"] = writers
    finally:
        reader.close()
    return out


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.3) -> T:
    """Poll ``condition`` until truthy; fail naming ``what`` after ``timeout_s``."""
    return wait_for(condition, timeout_s, what, interval_s=poll_s)


def totals_topology(job: str, source: str, sink: str) -> Topology:
    """JSON records ``{"word": ..., "n": ...}`` summed per word into ``total``, unwindowed."""
    builder = StreamBuilder(job)
    (
        builder.source(source, json_deserializer)
        .key_by("word")
        .sum("n", "total")
        .to_rstream()
        .sink(sink)
    )
    return builder.build()
