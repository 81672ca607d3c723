"""Test a topology without a broker or Spark: the real engine core on in-memory topics.

In the spirit of Kafka Streams' ``TopologyTestDriver``: :class:`TopologyTestDriver`
runs any :class:`~stream_assets.plan.topology.Topology` with the same per-queue
functions an instance runs inside its Spark tasks
(:func:`~stream_assets.runtime.core.stage0.stateless.run_source_batch` for stage 0,
:func:`~stream_assets.runtime.core.keyed.attempt.run_stateful_batch` for a stateful stage:
the currency check against the state topic, fencing, the keyed batch and its
conflict retries), a real :class:`~stream_assets.state.store.QueueStateStore` (RocksDB)
per shuffle queue in a temporary directory, and the real changelog writer,
which writes to an in-memory state topic. Topics are lists of
:class:`~stream_assets.rocketmq.records.Record` per queue
(:class:`InMemoryBroker`); no socket is opened, no JVM started.

Time is the caller's: a message's event time is the born timestamp given to
:meth:`TopologyTestDriver.pipe` (or what ``select_timestamp`` extracts), and
source queues become idle only when the test says so
(:meth:`TopologyTestDriver.advance_idle`). The wall clock plays no part, and
the same calls always give the same results (sink, late, dead-letter and
shuffle messages byte for byte; state-topic records carry a random write id
per attempt, as in the engine).

Example: WordCount over three lines::

    >>> from stream_assets.examples import wordcount
    >>> with TopologyTestDriver(wordcount.build()) as driver:
    ...     _ = driver.pipe_many(["the cat", "the dog", "The end"])
    ...     _ = driver.advance()
    ...     counts = {out["key"]: out["count"] for out in driver.outputs()}
    >>> sorted(counts.items())
    [('cat', 1), ('dog', 1), ('end', 1), ('the', 3)]

A windowed topology fires its windows as event time moves on, or when every
source queue is declared idle::

    >>> from stream_assets.dsl.builder import StreamBuilder
    >>> from stream_assets.serde import json_deserializer
    >>> from stream_assets.windows import Time, TumblingWindow
    >>> b = StreamBuilder("clicks")
    >>> (b.source("events", json_deserializer).key_by("user")
    ...   .window(TumblingWindow.of(Time.seconds(10))).count().to_rstream().sink("out"))
    >>> with TopologyTestDriver(b.build(), source_queues=1) as driver:
    ...     _ = driver.pipe({"user": "ann"}, event_time=1_000)
    ...     _ = driver.pipe({"user": "ann"}, event_time=4_000)
    ...     _ = driver.advance()
    ...     before = driver.outputs()
    ...     _ = driver.advance_idle()
    ...     after = driver.outputs()
    >>> before, after
    ([], [{'key': 'ann', 'count': 2, 'window_start': 0, 'window_end': 10000}])
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from stream_assets.plan import nodes as n
from stream_assets.plan.topology import Stage, Topology, origin_id
from stream_assets.rocketmq.admin import MessageQueue
from stream_assets.rocketmq.discarded import DISCARD_TOPIC, Discarded
from stream_assets.rocketmq.errors import RocketMQError, TopicNotFoundError
from stream_assets.rocketmq.hashing import choose_queue, queue_for_key
from stream_assets.rocketmq.reader import PullBatch, PullStatus
from stream_assets.rocketmq.records import OutgoingMessage, Record, SendReceipt, checked_body
from stream_assets.rocketmq.tags import TagFilter
from stream_assets.rocketmq.transactions import EndWindowClosedError, Prepared
from stream_assets.runtime.core.context import StageContext, TaskStats
from stream_assets.runtime.core.keyed import read_key_state
from stream_assets.runtime.core.keyed.attempt import QueuePorts, run_stateful_batch
from stream_assets.runtime.core.send_buffer import SendBuffer
from stream_assets.runtime.core.shuffle_codec import encode_key
from stream_assets.runtime.core.stage0.exactly_once import run_positioned_source_batch
from stream_assets.runtime.core.stage0.stateless import run_source_batch, run_source_batches
from stream_assets.serde import json_serializer
from stream_assets.settings import DEFAULT_MAX_MESSAGE_SIZE
from stream_assets.state.restore import RestoreResult, restore_queue, state_queue
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import Window

__all__ = ["InMemoryBroker", "InMemoryTopic", "TopologyTestDriver", "encode_input"]

#: The instance name the driver commits state as (``StageContext.writer``).
WRITER = "test-driver"
_BROKER_NAME = "in-memory"


def encode_input(value: Any) -> bytes:
    """The message body :meth:`TopologyTestDriver.pipe` sends for ``value``.

    Bytes (``bytes``, ``bytearray``, ``memoryview``) go as they are, a ``str``
    as UTF-8, anything else as compact JSON (non-ASCII kept as UTF-8); a value
    JSON cannot encode raises ``TypeError`` here rather than reaching the
    topology as something else.

    >>> encode_input("hé"), encode_input(b"\\x00"), encode_input({"k": [1, 2]})
    (b'h\\xc3\\xa9', b'\\x00', b'{"k":[1,2]}')
    """
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class InMemoryTopic:
    """One topic: a list of records per queue, and every record in the order it was stored.

    Offsets are positions in a queue's list (starting at 0), as a fresh
    broker queue would give them.
    """

    def __init__(self, name: str, queues: int) -> None:
        if queues <= 0:
            raise ValueError(f"topic {name!r}: queue count must be positive, got {queues}")
        self.name = name
        self.queues: list[list[Record]] = [[] for _ in range(queues)]
        #: Every record of the topic, in the order it was stored (across queues).
        self.log: list[Record] = []

    @property
    def queue_count(self) -> int:
        """Number of queues."""
        return len(self.queues)

    def end(self, queue_id: int) -> int:
        """The queue's end offset (the offset the next record gets)."""
        return len(self.queues[queue_id])

    def read(self, queue_id: int, start: int, end: int | None = None) -> list[Record]:
        """Records ``start`` .. ``end`` (exclusive; default: the end) of queue ``queue_id``."""
        return self.queues[queue_id][start:end]

    def __len__(self) -> int:
        return len(self.log)


class InMemoryBroker:
    """In-memory topics, and a :class:`~stream_assets.runtime.core.ports.Sender` onto them.

    :meth:`send` picks the queue like the real
    :class:`~stream_assets.rocketmq.producer.Producer`: ``queue_id`` if given,
    else the stable hash of ``key``
    (:func:`~stream_assets.rocketmq.hashing.queue_for_key`), else round-robin
    (per topic). It rejects what the producer rejects (an unknown topic, an
    empty or oversize body, a queue id out of range) and returns the real
    offset, which the changelog's compare-and-append checks. A message key is
    stored as the broker stores it: RocketMQ splits keys on spaces, so
    ``Record.keys`` is ``tuple(key.split(" "))``. ``Record.properties`` holds
    the sender's properties only (no system properties).

    Messages sent get ``clock`` as born and store timestamp (the driver sets
    it to the latest event time piped).

    >>> broker = InMemoryBroker()
    >>> _ = broker.create_topic("t", 4)
    >>> receipt = broker.send("t", b"x", key="user-42")
    >>> receipt.queue_id == queue_for_key("user-42", 4), receipt.queue_offset
    (True, 0)
    """

    def __init__(self, *, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        self.topics: dict[str, InMemoryTopic] = {}
        self.max_message_size = max_message_size
        self.clock = 0
        self._round_robin: dict[str, int] = {}
        self._unflushed: list[SendReceipt] = []
        #: Prepared (half) messages of exactly-once sinks, not yet committed or rolled back.
        self.half: dict[str, tuple[OutgoingMessage, Prepared]] = {}
        #: Half messages past their end window: only a check-back's answer ends them.
        self.windows_closed: set[str] = set()
        self._half_ids = itertools.count(1)

    def create_topic(self, name: str, queues: int) -> InMemoryTopic:
        """Create ``name`` with ``queues`` queues (an existing one must have that count)."""
        existing = self.topics.get(name)
        if existing is not None:
            if existing.queue_count != queues:
                raise ValueError(
                    f"topic {name!r} already exists with {existing.queue_count} queues, "
                    f"not {queues}"
                )
            return existing
        topic = self.topics[name] = InMemoryTopic(name, queues)
        return topic

    def topic(self, name: str) -> InMemoryTopic:
        """The topic ``name``; a missing one raises naming the topics that exist."""
        topic = self.topics.get(name)
        if topic is None:
            raise RocketMQError(
                f"topic {name!r} does not exist in the in-memory broker "
                f"(topics: {', '.join(sorted(self.topics)) or 'none'})"
            )
        return topic

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        key: str | None = None,
        queue_id: int | None = None,
        properties: Mapping[str, str] | None = None,
        route_key: str | None = None,
        tags: str | None = None,
    ) -> SendReceipt:
        """Store one message at once, as the producer would; returns where it was stored.

        Also a :class:`~stream_assets.runtime.core.ports.Sender`: :meth:`flush`
        returns the receipts of the sends since the last flush.
        """
        record = self.append(
            topic,
            body,
            key=key,
            queue_id=queue_id,
            properties=properties,
            route_key=route_key,
            tags=tags,
        )
        receipt = SendReceipt(record.topic, record.queue_id, record.queue_offset, record.msg_id)
        self._unflushed.append(receipt)
        return receipt

    def flush(self) -> list[SendReceipt]:
        """The receipts of :meth:`send` since the last flush (stored already)."""
        done, self._unflushed = self._unflushed, []
        return done

    def send_all(self, messages: Sequence[OutgoingMessage]) -> list[SendReceipt]:
        """Store several messages in order (the batching producer's call); their receipts."""
        receipts = []
        for m in messages:
            record = self.append(
                m.topic,
                m.body,
                key=m.key,
                queue_id=m.queue_id,
                properties=m.properties,
                route_key=m.route_key,
                tags=m.tags,
            )
            receipts.append(
                SendReceipt(record.topic, record.queue_id, record.queue_offset, record.msg_id)
            )
        return receipts

    def prepare(
        self, messages: Sequence[OutgoingMessage], properties: Mapping[str, str] | None = None
    ) -> list[Prepared]:
        """Hold ``messages`` as half messages (an exactly-once sink's step), queues chosen
        as :meth:`send_all` would; no reader sees them until :meth:`commit`."""
        prepared = []
        for m in messages:
            checked_body(m.topic, m.body, self.max_message_size)
            chooser = m.route_key if m.route_key is not None else m.key
            chosen = self._choose(m.topic, m.queue_id, chooser)
            n = next(self._half_ids)
            msg_id = f"half-{n}"
            props = {**(m.properties or {}), **(properties or {})}
            handle = Prepared(m.topic, chosen, _BROKER_NAME, "", chosen, msg_id, n, n, chooser)
            self.half[msg_id] = (dataclasses.replace(m, properties=props), handle)
            prepared.append(handle)
        return prepared

    def close_end_windows(self) -> None:
        """Let the end window of every half message held now pass, as time does at a
        broker: their producer's commit or rollback is refused from now on, and only
        the answer to a check-back (``from_check=True``) ends them."""
        self.windows_closed |= set(self.half)

    def commit(self, prepared: Sequence[Prepared], *, from_check: bool = False) -> None:
        """Store prepared messages in their queues, in the order given, stamped with the
        wall clock as a broker stamps them (a new owner looks for them by that time).
        Raises EndWindowClosedError at the first one past its window (not from a check),
        the ones before it committed."""
        now = int(time.time() * 1000)
        for p in prepared:
            self._check_window(p, from_check)
            m, held = self.half.pop(p.msg_id)
            self.windows_closed.discard(p.msg_id)
            self._store(m, held.queue_id, now, p.msg_id)

    def rollback(self, prepared: Sequence[Prepared], *, from_check: bool = False) -> None:
        """Drop prepared messages (refused past the window as :meth:`commit` is)."""
        for p in prepared:
            self._check_window(p, from_check)
            self.half.pop(p.msg_id, None)
            self.windows_closed.discard(p.msg_id)

    def discard(self) -> int:
        """Give up on every half message held now, as a broker does after
        ``transactionCheckMax`` unanswered checks: each goes, as a copy naming its real
        topic and queue, to ``TRANS_CHECK_MAX_TIME_TOPIC``, and is never delivered.
        Returns how many."""
        self.create_topic(DISCARD_TOPIC, 1)
        now = int(time.time() * 1000)
        for msg_id, (m, held) in list(self.half.items()):
            props = {**(m.properties or {}), "REAL_TOPIC": m.topic, "REAL_QID": str(held.queue_id)}
            copy = dataclasses.replace(m, topic=DISCARD_TOPIC, properties=props)
            self._store(copy, 0, now, msg_id)
            del self.half[msg_id]
            self.windows_closed.discard(msg_id)
        return self.topic(DISCARD_TOPIC).end(0)

    def resend(self, discarded: Sequence[Discarded]) -> None:
        """Deliver discarded half messages plainly to their queues (as
        :meth:`~stream_assets.rocketmq.transactions.TransactionalSender.resend`)."""
        now = int(time.time() * 1000)
        for d in discarded:
            self._store(d.resent(d.queue.queue_id), d.queue.queue_id, now)  # index == id

    def _store(
        self, m: OutgoingMessage, queue_id: int, timestamp: int, msg_id: str | None = None
    ) -> None:
        """Store ``m`` in ``queue_id`` as a broker stores a message it was handed now."""
        self.append(
            m.topic,
            m.body,
            key=m.key,
            queue_id=queue_id,
            timestamp=timestamp,
            properties=m.properties,
            tags=m.tags,
            msg_id=msg_id,
        )

    def _check_window(self, p: Prepared, from_check: bool) -> None:
        if p.msg_id in self.windows_closed and not from_check:
            raise EndWindowClosedError(f"end of {p.msg_id} refused: past its end window")

    def _choose(self, topic: str, queue_id: int | None, chooser: str | None) -> int:
        def turn() -> int:
            self._round_robin[topic] = self._round_robin.get(topic, 0) + 1
            return self._round_robin[topic] - 1

        return choose_queue(topic, self.topic(topic).queue_count, queue_id, chooser, turn)

    def append(
        self,
        topic: str,
        body: bytes,
        *,
        key: str | None = None,
        queue_id: int | None = None,
        properties: Mapping[str, str] | None = None,
        timestamp: int | None = None,
        route_key: str | None = None,
        tags: str | None = None,
        msg_id: str | None = None,
    ) -> Record:
        """:meth:`send` with an explicit born timestamp (default ``clock``); the stored record."""
        target = self.topic(topic)
        body = checked_body(topic, body, self.max_message_size)
        chosen = self._choose(topic, queue_id, route_key if route_key is not None else key)
        ts = self.clock if timestamp is None else timestamp
        offset = target.end(chosen)
        record = Record(
            topic=topic,
            queue_id=chosen,
            queue_offset=offset,
            body=body,
            keys=tuple(key.split(" ")) if key else (),
            tags=tags,
            properties=dict(properties or {}),
            born_timestamp=ts,
            store_timestamp=ts,
            msg_id=msg_id or f"{topic}@{chosen}:{offset}",
        )
        target.queues[chosen].append(record)
        target.log.append(record)
        return record


class _TopicView:
    """The broker's admin offsets and reader pulls, over in-memory topics: what the state
    layer reads a state queue through (:mod:`~stream_assets.state.ports`), and what a
    stateful batch reads its input through."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self.broker = broker

    def queue(self, topic: str, queue_id: int) -> MessageQueue:
        """Queue ``queue_id`` of ``topic`` (one broker: the index is the queue id)."""
        return MessageQueue(topic, _BROKER_NAME, queue_id)

    def get_kv(self, namespace: str, key: str) -> None:
        return None  # no stored layouts: one broker, queue index == queue id

    def queues(self, topic: str) -> list[MessageQueue]:
        return [self.queue(topic, q) for q in range(self.broker.topic(topic).queue_count)]

    def min_offset(self, queue: MessageQueue) -> int:
        return 0

    def max_offset(self, queue: MessageQueue) -> int:
        if queue.topic not in self.broker.topics:
            raise TopicNotFoundError(queue.topic, "in-memory")
        return self.broker.topic(queue.topic).end(queue.queue_id)

    def pull(self, queue: MessageQueue, offset: int, max_messages: int | None = None) -> PullBatch:
        end = self.max_offset(queue)
        if not 0 <= offset <= end:
            return PullBatch(queue, PullStatus.OFFSET_ILLEGAL, [], offset, 0, end)
        stop = end if max_messages is None else min(end, offset + max_messages)
        records = self.broker.topic(queue.topic).read(queue.queue_id, offset, stop)
        status = PullStatus.FOUND if records else PullStatus.NO_NEW_MESSAGES
        return PullBatch(queue, status, records, stop, 0, end)

    def read(self, queue: MessageQueue, start: int, end: int | None = None) -> Iterator[Record]:
        stop = self.max_offset(queue) if end is None else end
        yield from self.broker.topic(queue.topic).read(queue.queue_id, start, stop)


class TopologyTestDriver:
    """Runs ``topology`` on in-memory topics with the engine's real per-queue core.

    - ``source_queues``: queues of each source topic (a source stage's
      parallelism; every one of them holds a windowed stage's watermark until
      it has sent a record or is declared idle, as in the engine);
    - ``shuffle_queues``: queues of the shuffle and state topics;
    - ``state_dir``: where the temporary RocksDB directory is created
      (default: the system's temporary directory); the directory the driver
      creates there is deleted by :meth:`close`;
    - ``snapshot_every``: a full state snapshot every that many commits;
    - ``sink_queues``: queues of sink and late-record topics (the dead-letter
      topic has one, as provisioned by the engine);
    - ``pre_combine``: the engine's pre-shuffle combine setting;
    - ``max_records_per_batch``: at most this many records per queue per
      batch (default: a queue's whole pending range in one batch); smaller
      batches interleave stage 0 and the stateful stage like a live instance;
    - ``generation``: the allocation generation the driver commits state as;
    - ``max_message_size``: the broker's body limit (a sink body over it is a
      dead letter);
    - ``across_queues``: stage 0 runs a round's source queues as one step, as a
      real-time task runs the queues it reads (their pre-combined partials merged
      across them where they can be); default one step per queue.

    Use it as a context manager (or call :meth:`close`).
    """

    def __init__(
        self,
        topology: Topology,
        *,
        source_queues: int = 4,
        shuffle_queues: int = 4,
        state_dir: str | Path | None = None,
        snapshot_every: int = 100,
        sink_queues: int = 1,
        pre_combine: bool = True,
        max_records_per_batch: int | None = None,
        generation: int = 0,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        across_queues: bool = False,
    ) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(
                f"expected a Topology (StreamBuilder(...).build()), got {type(topology).__name__}"
            )
        for name, number in (
            ("source_queues", source_queues),
            ("shuffle_queues", shuffle_queues),
            ("snapshot_every", snapshot_every),
            ("sink_queues", sink_queues),
        ):
            if number <= 0:
                raise ValueError(f"{name} must be positive, got {number}")
        if max_records_per_batch is not None and max_records_per_batch <= 0:
            raise ValueError(f"max_records_per_batch must be positive, got {max_records_per_batch}")
        self.topology = topology
        self.source_queues = source_queues
        self.shuffle_queues = shuffle_queues
        self.max_records_per_batch = max_records_per_batch
        self.across_queues = across_queues
        self.broker = InMemoryBroker(max_message_size=max_message_size)
        #: Stats of every core call, in order (one per queue and batch).
        self.stats: list[TaskStats] = []
        queue_ids = tuple(range(source_queues))
        self._contexts = [
            StageContext.of(
                topology,
                i,
                shuffle_queues=shuffle_queues,
                source_queues=queue_ids,
                generation=generation,
                writer=WRITER,
                snapshot_every=snapshot_every,
                pre_combine=pre_combine,
                max_message_size=max_message_size,
                # A fresh query on empty topics: everything may be combined.
                combine_from=tuple((q, 0) for q in queue_ids),
            )
            for i in range(len(topology.stages))
        ]
        for source in topology.source_topics:
            self.broker.create_topic(source, source_queues)
        for stage in topology.stages:
            if stage.head is not None:
                self.broker.create_topic(stage.input_topic, shuffle_queues)
            if stage.state_topic is not None:  # a positioned stage's: one per source queue
                count = source_queues if stage.positioned else shuffle_queues
                self.broker.create_topic(stage.state_topic, count)
        for name in (*topology.sink_topics, *topology.late_topics):
            if name not in self.broker.topics:
                self.broker.create_topic(name, sink_queues)
        if topology.dead_letter_topic not in self.broker.topics:
            self.broker.create_topic(topology.dead_letter_topic, 1)
        #: Per stage input topic, each queue's committed offset (the consumer group's).
        self._committed: dict[str, list[int]] = {
            s.input_topic: [0] * self.broker.topic(s.input_topic).queue_count
            for s in topology.stages
        }
        self._idle: set[tuple[str, int]] = set()  # (source topic, queue)
        self._clock = 0
        #: The wall clock (ms) processing-time timers and periodic results go by:
        #: the test's, moved only by :meth:`advance_wall_clock`.
        self.wall_clock_ms = 0
        self._stdout = io.StringIO()
        self._stores: dict[tuple[int, int], QueueStateStore] = {}
        self._dir: Path | None = Path(tempfile.mkdtemp(prefix="stream-assets-test-", dir=state_dir))

    # -- lifecycle ---------------------------------------------------------

    def close(self) -> None:
        """Close every state store and delete the temporary directory; safe to call twice."""
        for store in self._stores.values():
            store.close()
        self._stores.clear()
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> TopologyTestDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def state_dir(self) -> Path:
        """The temporary directory holding the RocksDB stores."""
        if self._dir is None:
            raise RuntimeError("the test driver is closed")
        return self._dir

    @property
    def contexts(self) -> tuple[StageContext, ...]:
        """The stage contexts the core runs with, one per stage."""
        return tuple(self._contexts)

    # -- input -------------------------------------------------------------

    def pipe(
        self,
        value: Any,
        *,
        event_time: int | None = None,
        queue: int | None = None,
        key: str | None = None,
        topic: str | None = None,
        tags: str | None = None,
        properties: Mapping[str, str] | None = None,
    ) -> Record:
        """Append one message to source ``topic`` (default: the first); the stored record.

        The body is :func:`encode_input` of ``value`` (bytes as they are, a str
        as UTF-8, anything else as JSON). ``event_time`` (epoch ms) is the
        message's born timestamp, which the engine uses as event time unless
        the topology has ``select_timestamp``; without it the message gets
        the last event time piped (0 before any): time stands still unless
        the test moves it. The queue is ``queue``, else the hash of ``key``
        (also stored as the message key), else round-robin. A queue that
        receives a message is no longer idle. ``tags`` and ``properties``
        are stored with the message (a user function sees them with
        ``metadata=True``).
        """
        self._check_open()
        name = topic or self.topology.source_topic
        if name not in self.topology.source_topics:
            raise ValueError(
                f"{name!r} is not a source of {self.topology.job_id} "
                f"(sources: {', '.join(self.topology.source_topics)})"
            )
        body = encode_input(value)
        if event_time is not None:
            if isinstance(event_time, bool) or not isinstance(event_time, int):
                raise TypeError(f"event_time must be an int of epoch ms, got {event_time!r}")
            self._clock = event_time
            self.broker.clock = event_time
        record = self.broker.append(
            name,
            body,
            key=key,
            queue_id=queue,
            timestamp=self._clock,
            tags=tags,
            properties=properties,
        )
        self._idle.discard((name, record.queue_id))
        return record

    def pipe_many(
        self,
        values: Iterable[Any],
        *,
        event_time: int | Callable[[Any], int] | None = None,
        queue: int | None = None,
        key: str | Callable[[Any], str] | None = None,
        topic: str | None = None,
    ) -> list[Record]:
        """:meth:`pipe` each value; ``event_time`` and ``key`` may be functions of the value.

        >>> from stream_assets.examples import wordcount
        >>> with TopologyTestDriver(wordcount.build(), source_queues=2) as driver:
        ...     records = driver.pipe_many(
        ...         [{"t": 5}, {"t": 9}], event_time=lambda v: v["t"], key=lambda v: "k"
        ...     )
        >>> [(r.born_timestamp, r.key) for r in records]
        [(5, 'k'), (9, 'k')]
        """
        records = []
        for value in values:
            ts = event_time(value) if callable(event_time) else event_time
            k = key(value) if callable(key) else key
            records.append(self.pipe(value, event_time=ts, queue=queue, key=k, topic=topic))
        return records

    # -- processing --------------------------------------------------------

    def advance(self) -> list[TaskStats]:
        """Process everything pending; returns the stats of the batches run.

        Each round runs stage 0 over every source queue's new range, then the
        stateful stage over every shuffle queue's new range, committing each
        queue's offset after its batch (as an instance does); rounds repeat
        until no stage has new input. Source queues declared idle (and not
        piped to since) stay idle.
        """
        self._check_open()
        first = len(self.stats)
        while self._round(tick=False):
            pass
        return self.stats[first:]

    run = advance

    def advance_idle(
        self, queues: Iterable[int] | None = None, topic: str | None = None
    ) -> list[TaskStats]:
        """Process what is pending, then declare ``queues`` (default: all) of source
        ``topic`` (default: every source) idle.

        As the engine does once a source queue's end offset has not moved for
        the idle timeout: the idle queues leave the watermark's minimum, and
        every stateful queue runs once more, so windows the remaining
        watermark passed fire; with every source queue idle, all open windows
        fire (and later records for them are late). A queue stays idle until
        :meth:`pipe` sends to it. Returns the stats of the batches run.
        """
        self._check_open()
        first = len(self.stats)
        chosen = set(range(self.source_queues)) if queues is None else set(queues)
        unknown = sorted(q for q in chosen if not 0 <= q < self.source_queues)
        if unknown:
            raise ValueError(f"source queues {unknown} do not exist ({self.source_queues} queues)")
        topics = self.topology.source_topics if topic is None else (topic,)
        while self._round(tick=False):
            pass
        self._idle |= {(t, q) for t in topics for q in chosen}
        self._round(tick=True)
        while self._round(tick=False):
            pass
        return self.stats[first:]

    idle = advance_idle

    def advance_wall_clock(self, to_ms: int) -> list[TaskStats]:
        """Move the wall clock to ``to_ms`` (ms since the epoch), then give every stateful
        queue a batch, as the engine's tick does: processing-time timers and periodic
        early results that are due by then fire. Returns the stats of the batches run.

        >>> driver.advance_wall_clock(60_000)  # doctest: +SKIP
        """
        self._check_open()
        if to_ms < self.wall_clock_ms:
            raise ValueError(
                f"the wall clock only moves forward: it is at {self.wall_clock_ms}, not {to_ms}"
            )
        first = len(self.stats)
        while self._round(tick=False):
            pass
        self.wall_clock_ms = to_ms
        self._round(tick=True)
        while self._round(tick=False):
            pass
        return self.stats[first:]

    def rewind(
        self, topic: str | None = None, offset: int = 0, queues: Iterable[int] | None = None
    ) -> None:
        """Move the committed offset of the stage reading ``topic`` back to ``offset``.

        The next :meth:`advance` processes that range again, as an instance
        does after a crash between its work and its offset commit. ``topic``
        defaults to the source topic; rewinding it also restarts stage 0 as a
        new query would (input below each queue's current end is then sent
        per record, never pre-combined). Rewinding a shuffle topic re-reads
        its messages in the stateful stage. Offsets only move back.
        """
        self._check_open()
        name = topic or self.topology.source_topic
        committed = self._committed.get(name)
        if committed is None:
            raise ValueError(
                f"{name!r} is not read by a stage of {self.topology.job_id} "
                f"(stage inputs: {', '.join(self._committed)})"
            )
        for q in range(len(committed)) if queues is None else queues:
            committed[q] = min(committed[q], offset)
        if name in self.topology.source_topics:
            source = self.broker.topic(name)
            ends = tuple((q, source.end(q)) for q in range(source.queue_count))
            self._contexts = [
                dataclasses.replace(c, combine_from=ends) if c.stage.input_topic == name else c
                for c in self._contexts
            ]

    def restore_state(self, queues: Iterable[int] | None = None) -> list[RestoreResult]:
        """Throw away the local RocksDB of ``queues`` (default: all) of every stage with a state
        topic and rebuild it from there, as an instance does for a queue that moved to it.
        """
        self._check_open()
        results = []
        for stage in self.topology.stages:
            if stage.state_topic is None:
                continue
            count = self.broker.topic(stage.state_topic).queue_count
            for q in range(count) if queues is None else queues:
                store = self._store(stage, q)
                store.wipe()
                results.append(self._restore(stage, q, store))
        return results

    def stores(self) -> dict[tuple[int, int], QueueStateStore]:
        """The RocksDB store of every stateful queue opened so far, by (stage, queue).

        >>> driver.stores()[(1, 0)].estimated_key_count()  # doctest: +SKIP
        42
        """
        self._check_open()
        return dict(self._stores)

    def committed(self, topic: str | None = None) -> list[int]:
        """Committed offset per queue of the stage reading ``topic`` (default: the source)."""
        return list(self._committed[topic or self.topology.source_topic])

    # -- reading -----------------------------------------------------------

    def output_records(self, topic: str | None = None) -> list[Record]:
        """Every record of ``topic`` in the order it was sent (default: the only sink topic).

        Any topic works: sinks, late records, dead letters, shuffle and state topics.
        """
        return list(self.broker.topic(topic or self._only_sink()).log)

    def outputs(
        self, topic: str | None = None, *, decode: Callable[[bytes], Any] | None = None
    ) -> list[Any]:
        """The values sent to sink ``topic`` (default: the only sink topic), in send order.

        Bodies are JSON-decoded when every sink writing the topic uses the
        default :func:`~stream_assets.serde.json_serializer`, and kept as
        bytes otherwise; ``decode`` overrides either.
        """
        name = topic or self._only_sink()
        if decode is None and self._json_topic(name):
            decode = json.loads
        records = self.output_records(name)
        return [r.body if decode is None else decode(r.body) for r in records]

    def late(self, topic: str | None = None) -> list[Any]:
        """Late records written by ``late_records_to(topic)``: dicts with ``key``,
        ``value`` and ``window_end`` (default topic: the only late-record topic)."""
        if topic is None:
            late_topics = self.topology.late_topics
            if len(late_topics) != 1:
                raise ValueError(
                    f"{self.topology.job_id} has late-record topics {list(late_topics)}; "
                    "name one (late_records_to(...) writes them)"
                )
            topic = late_topics[0]
        return [json.loads(r.body) for r in self.output_records(topic)]

    def dead_letters(self) -> list[tuple[bytes, dict[str, str]]]:
        """Dead letters in send order: (body, properties with ``reason``, ``operator``, ...)."""
        records = self.output_records(self.topology.dead_letter_topic)
        return [(r.body, dict(r.properties)) for r in records]

    def printed(self) -> list[str]:
        """Lines written to stdout while the core ran (``print()`` operators, user prints)."""
        return self._stdout.getvalue().splitlines()

    def state(self, key: Any, window: Window | None = None, operator: str | None = None) -> Any:
        """The current state of ``key`` in the first aggregate's or processor's RocksDB
        (or ``operator``'s).

        Unwindowed: the result (a dict by alias) or None. Windowed: the key's
        open (not yet fired) windows as ``{Window: result}``, or with
        ``window`` that window's result or None. A processor: its states by
        name (a map state as a dict), or None.
        """
        self._check_open()
        stages = [
            s
            for s in self._stateful_stages()
            if s.queryable is not None and operator in (None, s.queryable.op_id)
        ]
        if not stages:
            raise ValueError(f"{self.topology.job_id} has no aggregate {operator or ''}".strip())
        stage = stages[0]
        agg = stage.queryable
        assert agg is not None
        store = self._store(stage, queue_for_key(encode_key(key), self.shuffle_queues))
        return read_key_state(store, agg, key, window)

    # -- internals ---------------------------------------------------------

    def _check_open(self) -> None:
        if self._dir is None:
            raise RuntimeError("the test driver is closed")

    def _only_sink(self) -> str:
        sinks = tuple(dict.fromkeys(self.topology.sink_topics))
        if len(sinks) != 1:
            raise ValueError(
                f"{self.topology.job_id} has sink topics {list(sinks)}; name the topic "
                "(a topology ending in print() has none: see printed())"
            )
        return sinks[0]

    def _json_topic(self, topic: str) -> bool:
        serializers = [
            node.serializer
            for node in self.topology.nodes
            if isinstance(node, n.Sink) and node.topic == topic
        ]
        return bool(serializers) and all(s is json_serializer for s in serializers)

    def _stateful_stages(self) -> list[Stage]:
        return [s for s in self.topology.stages if s.stateful]

    def _limit(self, start: int, end: int) -> int:
        cap = self.max_records_per_batch
        return end if cap is None else min(end, start + cap)

    def _effective_idle(self, stage: Stage) -> tuple[int, ...]:
        """Origins of ``stage`` that are idle: declared-idle source queues processed to their
        end; a keyed upstream's queue processed to its end whose own origins are all idle."""
        idle: list[int] = []
        for up in stage.upstreams:
            upstream = self.topology.stages[up]
            topic = self.broker.topic(upstream.input_topic)
            done = self._committed[topic.name]
            if upstream.source is not None:
                queues = [q for t, q in self._idle if t == topic.name]
            elif set(self._contexts[up].origins) <= set(self._effective_idle(upstream)):
                queues = list(range(topic.queue_count))
            else:
                queues = []
            idle.extend(origin_id(up, q) for q in queues if done[q] >= topic.end(q))
        return tuple(sorted(idle))

    def _round(self, *, tick: bool) -> bool:
        """One batch per queue of every stage, in stage order; whether any had input."""
        progressed = False
        for ctx in self._contexts:
            if ctx.stage.stateful:
                progressed |= self._stateful_round(ctx, tick)
            else:
                progressed |= self._source_round(ctx)
        return progressed

    def _source_round(self, ctx: StageContext) -> bool:
        topic = self.broker.topic(ctx.stage.input_topic)
        committed = self._committed[topic.name]
        source = ctx.stage.source
        tags = TagFilter.parse(None if source is None else source.tags)  # as the broker's
        ranges = [
            (q, committed[q], self._limit(committed[q], topic.end(q)))
            for q in range(topic.queue_count)
        ]
        ranges = [(q, start, end) for q, start, end in ranges if end > start]
        with contextlib.redirect_stdout(self._stdout):
            if self.across_queues and not ctx.stage.positioned:
                parts = [
                    (q, start, end, self._records(ctx, q, start, end, tags))
                    for q, start, end in ranges
                ]
                self.stats += run_source_batches(ctx, parts, SendBuffer(self.broker))
                for q, _start, end in ranges:
                    committed[q] = end
            else:
                for q, start, end in ranges:  # each queue committed after its own batch
                    self.stats.append(self._source_batch(ctx, q, start, end, tags))
                    committed[q] = end
        return bool(ranges)

    def _records(
        self, ctx: StageContext, q: int, start: int, end: int, tags: TagFilter
    ) -> list[Record]:
        """Offsets ``start`` .. ``end`` of source queue ``q`` that ``tags`` selects."""
        read = self.broker.topic(ctx.stage.input_topic).read(q, start, end)
        return [r for r in read if tags.matches(r.tags)]

    def _source_batch(
        self, ctx: StageContext, q: int, start: int, end: int, tags: TagFilter
    ) -> TaskStats:
        if ctx.stage.positioned:  # its position committed with its transaction
            return run_positioned_source_batch(ctx, q, start, end, self._ports(ctx.stage, q), tags)
        records = self._records(ctx, q, start, end, tags)
        return run_source_batch(ctx, q, start, end, records, SendBuffer(self.broker))

    def _stateful_round(self, ctx: StageContext, tick: bool) -> bool:
        stage = ctx.stage
        topic = self.broker.topic(stage.input_topic)
        committed = self._committed[topic.name]
        ranges = [
            (q, committed[q], self._limit(committed[q], topic.end(q)))
            for q in range(topic.queue_count)
        ]
        # As the engine's source: idleness only in a batch reading every queue to its end.
        to_end = all(end == topic.end(q) for q, _start, end in ranges)
        idle = self._effective_idle(stage) if to_end else ()
        progressed = False
        for q, start, end in ranges:
            if end <= start and not tick:
                continue
            ports = self._ports(stage, q)
            with contextlib.redirect_stdout(self._stdout):
                stats = run_stateful_batch(ctx, q, start, end, ports, idle, self.wall_clock_ms)
            self.stats.append(stats)
            committed[q] = end
            progressed |= end > start
        return progressed

    def _store(self, stage: Stage, queue_id: int) -> QueueStateStore:
        store = self._stores.get((stage.index, queue_id))
        if store is None:
            head = stage.head or stage.source
            assert head is not None
            store = QueueStateStore(
                self.state_dir, self.topology.job_id, head.op_id, queue_id
            ).open()
            self._stores[(stage.index, queue_id)] = store
        return store

    def _ports(self, stage: Stage, queue_id: int) -> QueuePorts:
        """What the engine's stateful batch runs against here: the driver's open store
        (lent, not closed, per attempt), the in-memory topics, a send buffer over them."""
        assert stage.state_topic is not None
        store = self._store(stage, queue_id)
        view = _TopicView(self.broker)
        return QueuePorts(
            store=lambda: contextlib.nullcontext(store),
            admin=view,
            reader=view,
            state_queue=state_queue(view, stage.state_topic, queue_id),
            input_queue=view.queue(stage.input_topic, queue_id),
            sender=lambda tx: SendBuffer(self.broker, transaction=tx),
            sink_port=self.broker,
            # The test's own check-back commits a dead owner's messages at once (a
            # broker takes 20-25 s): a test without one fails soon, not in minutes.
            sink_wait_s=10.0,
        )

    def _restore(self, stage: Stage, queue_id: int, store: QueueStateStore) -> RestoreResult:
        assert stage.state_topic is not None
        view = _TopicView(self.broker)
        return restore_queue(store, stage.state_topic, queue_id, view, view)
