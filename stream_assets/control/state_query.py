"""Interactive state queries: a key's current aggregate, read from the state topic.

A running instance keeps each stateful queue's RocksDB open in a Spark Python
worker, mid-batch at any moment, possibly on another machine. A query never
touches that store. It rebuilds the one queue that owns the key from the
queue's state topic (latest snapshot + changelog tail,
:func:`~stream_assets.state.restore.restore_queue`) into a private RocksDB in a
temporary directory, reads the key there
(:func:`~stream_assets.runtime.core.keyed.read_key_state`), and deletes the
directory. So the answer is

- **consistent**: the changelog holds whole commits only (a delta is applied
  when all its parts are present), so the answer is the state exactly as of
  one commit (``StateAnswer.seq``), never half a batch;
- **committed**: what a restore after a crash would give back, no more;
- **free for the instance**: nothing is stopped, paused or locked; the query
  only reads the broker.

At a quiet point (the instance caught up, no input arriving) that is the
state the instance holds. While input flows it lags the instance by at most
the commits written after the query began.

The key's queue is chosen exactly as stage 0 routes it:
``queue_for_key(encode_key(key), n)`` over the state topic's ``n`` queues
(the shuffle topic's count, which provisioning keeps equal to it).

Example::

    >>> answer = query_state("wordcount", "the", rocketmq=settings)  # doctest: +SKIP
    >>> answer.value, answer.queue_id, answer.read_from  # doctest: +SKIP
    ({'count': 1042}, 5, 'wordcount__state__aggregate[5] at seq 17 (offset 18)')
    >>> query_state("wordcount", "never-seen", rocketmq=settings).found  # doctest: +SKIP
    False
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream_assets.control.registry import registration
from stream_assets.plan.topology import Stage, Topology
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import TopicNotFoundError
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.layout import current_layout
from stream_assets.rocketmq.provision import plan_topology_upgrade
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.runtime.core.keyed import read_key_state
from stream_assets.runtime.core.shuffle_codec import encode_key
from stream_assets.settings import RocketMQSettings
from stream_assets.state.errors import StateError
from stream_assets.state.restore import RestoreProgress, restore_queue
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import Window

#: A progress line is reported whenever this many state messages have been read.
PROGRESS_EVERY_MESSAGES = 500


class StateQueryError(ValueError):
    """A state query that cannot be answered: the message says why and what to do."""


@dataclass(frozen=True)
class StateAnswer:
    """What a state query found, and where it read it.

    ``value`` is what :func:`~stream_assets.runtime.core.keyed.read_key_state`
    gives: for an unwindowed aggregate its result (e.g. ``{"count": 3}``) or
    None; for a windowed one with ``window`` that window's result or None;
    without ``window`` every open (not yet fired) window of the key as
    ``{Window: result}``, empty when there is none. ``seq`` is the commit of
    the state topic queue the answer reflects, ``end_offset`` where the read
    stopped.

    Example::

        >>> a = StateAnswer("wc", "aggregate-3", "wc__state__aggregate", 2, "the",
        ...                 None, False, {"count": 3}, seq=7, end_offset=8)
        >>> a.found, a.read_from
        (True, 'wc__state__aggregate[2] at seq 7 (offset 8)')
        >>> print(a.describe())
        wc: key 'the' of aggregate-3 in wc__state__aggregate[2] at seq 7 (offset 8): {"count": 3}
    """

    topology: str
    operator: str
    state_topic: str
    queue_id: int
    key: Any
    window: Window | None
    windowed: bool
    value: Any
    seq: int
    end_offset: int
    keys_in_queue: int = 0
    #: Where the snapshot the rebuild started from begins (None: deltas from the queue's start).
    snapshot_offset: int | None = None
    seconds: float = 0.0

    @property
    def found(self) -> bool:
        """Whether the queue holds state for the key (for ``window``, if given)."""
        return self.value is not None and self.value != {}

    @property
    def read_from(self) -> str:
        """Where the answer was read: state topic queue, commit seq and end offset."""
        return f"{self.state_topic}[{self.queue_id}] at seq {self.seq} (offset {self.end_offset})"

    def json_value(self) -> Any:
        """``value`` in JSON form: windows become ``"START,END"`` keys (what ``--window``
        takes), tuples lists.

        >>> a = StateAnswer("ws", "aggregate-3", "ws__state", 0, "k", None, True,
        ...                 {Window(10_000, 20_000): {"sum": 4}, Window(0, 10_000): {"sum": 1}},
        ...                 seq=3, end_offset=3)
        >>> a.json_value()
        {'0,10000': {'sum': 1}, '10000,20000': {'sum': 4}}
        """
        if self.windowed and self.window is None and isinstance(self.value, Mapping):
            return {
                f"{w.start},{w.end}": jsonable(v)
                for w, v in sorted(self.value.items(), key=lambda item: item[0].start)
            }
        return jsonable(self.value)

    def value_json(self, indent: int | None = None) -> str:
        """:meth:`json_value` as a JSON document (``null`` when nothing was found)."""
        return json.dumps(self.json_value(), indent=indent, sort_keys=True, ensure_ascii=False)

    def describe(self) -> str:
        """One line for a log: the key, where it was read, its value (or that there is none)."""
        what = f"key {self.key!r}"
        if self.window is not None:
            what += f" window [{self.window.start}, {self.window.end})"
        head = f"{self.topology}: {what} of {self.operator} in {self.read_from}"
        if not self.found:
            return f"{head}: no state" + (" (no open window)" if self.windowed else "")
        return f"{head}: {self.value_json()}"


def jsonable(value: Any) -> Any:
    """A JSON-serialisable copy of a key or result (tuples -> lists, bytes -> text).

    >>> jsonable({"key": ("eu", 7), "raw": b"ab"})
    {'key': ['eu', 7], 'raw': 'ab'}
    """
    if isinstance(value, Mapping):
        return {str(k) if not isinstance(k, str) else k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="backslashreplace")
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def parse_key(text: str, *, as_json: bool = False) -> Any:
    """The typed key a command line means: a word is a ``str``; ``as_json`` parses JSON.

    JSON arrays become tuples, as :func:`~stream_assets.runtime.core.shuffle_codec.decode_key`
    gives keys back (both encode to the same bytes, so they route alike).

    >>> parse_key("apple"), parse_key("42"), parse_key("42", as_json=True)
    ('apple', '42', 42)
    >>> parse_key('["eu", 7]', as_json=True)
    ('eu', 7)
    """
    if not as_json:
        return text
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StateQueryError(
            f"key {text!r} is not valid JSON ({exc.msg}); drop --json to query it as a string, "
            "or quote a JSON string key ('\"apple\"')"
        ) from None
    return _tuples(parsed)


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def parse_window(text: str) -> Window:
    """A window from ``"START,END"`` (epoch ms, end exclusive).

    >>> parse_window("0,10000")
    Window(start=0, end=10000)
    """
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) != 2:
            raise ValueError("two numbers expected")
        return Window(int(parts[0]), int(parts[1]))
    except (TypeError, ValueError) as exc:
        raise StateQueryError(
            f"window {text!r} is not START,END in epoch milliseconds with END > START "
            f"({exc}); e.g. --window 1700000000000,1700000010000"
        ) from None


def stateful_operators(topology: Topology) -> dict[str, Stage]:
    """The stages of ``topology`` that keep state, by their aggregate's operator id.

    >>> from stream_assets.examples import wordcount
    >>> {op: s.state_topic for op, s in stateful_operators(wordcount.build()).items()}
    {'aggregate': 'wordcount__state__aggregate'}
    """
    return {
        s.queryable.op_id: s for s in topology.stages if s.queryable is not None and s.state_topic
    }


def resolve_operator(topology: Topology, operator: str | None = None) -> Stage:
    """The stateful stage a query reads: the only one, or the one whose aggregate is ``operator``.

    >>> from stream_assets.examples import wordcount
    >>> resolve_operator(wordcount.build()).state_topic
    'wordcount__state__aggregate'
    >>> resolve_operator(wordcount.build(), "count-9")
    Traceback (most recent call last):
    ...
    stream_assets.control.state_query.StateQueryError: topology wordcount has no stateful operator 'count-9'; choose one of ['aggregate']
    """  # noqa: E501
    stages = stateful_operators(topology)
    if not stages:
        raise StateQueryError(
            f"topology {topology.job_id} keeps no state: it has no aggregate (count, sum, ...) "
            "or process() after a key_by; its results are in its sink topics"
        )
    if operator is not None:
        if operator not in stages:
            raise StateQueryError(
                f"topology {topology.job_id} has no stateful operator {operator!r}; "
                f"choose one of {sorted(stages)}"
            )
        return stages[operator]
    if len(stages) > 1:
        raise StateQueryError(
            f"topology {topology.job_id} has several stateful operators; name one "
            f"(--operator / operator=): {sorted(stages)}"
        )
    return next(iter(stages.values()))


def resolve_topology(topology: str | Topology) -> Topology:
    """``topology`` itself, or the registered topology of that name.

    >>> resolve_topology("wordcount").job_id
    'wordcount'
    >>> resolve_topology("nope")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    stream_assets.control.state_query.StateQueryError: no topology 'nope' is registered (known: [...])...
    """  # noqa: E501
    if isinstance(topology, Topology):
        return topology
    try:
        return registration(topology).topology()
    except KeyError as exc:
        raise StateQueryError(
            f"{exc.args[0]}; a topology of your own is registered by listing its module "
            "in STREAM_ASSETS_TOPOLOGIES"
        ) from None


def key_queue(key: Any, queue_count: int) -> int:
    """The queue that owns ``key`` among ``queue_count`` shuffle/state queues, as stage 0
    routes it (the stable hash of the key's canonical bytes).

    >>> key_queue("the", 8) == key_queue("the", 8), 0 <= key_queue(("eu", 7), 4) < 4
    (True, True)
    """
    try:
        key_bytes = encode_key(key)
    except Exception as exc:  # msgpack cannot carry it: no record could have this key
        raise StateQueryError(f"key {key!r} cannot be a grouping key: {exc}") from None
    return queue_for_key(key_bytes, queue_count)


def query_state(
    topology: str | Topology,
    key: Any,
    *,
    window: Window | None = None,
    operator: str | None = None,
    rocketmq: RocketMQSettings | None = None,
    admin: RocketMQAdmin | None = None,
    reader: QueueReader | None = None,
    scratch_dir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> StateAnswer:
    """The committed state of ``key`` in ``topology``, read from its state topic.

    ``topology`` is a registered name or a :class:`Topology`; ``operator``
    picks the aggregate when the topology has several. ``window`` asks for one
    window of a windowed aggregate. The broker is reached with ``admin`` and
    ``reader`` if given (they are left open), else with clients made from
    ``rocketmq`` (one of the two is needed) and closed on return.
    The queue is rebuilt in a temporary directory under ``scratch_dir``
    (default: the system's), deleted on return; ``progress`` hears how far a
    long rebuild is.

    Raises :class:`StateQueryError` (a ``ValueError``) naming what to fix: an
    unknown topology or operator, a topology without state, a state topic that
    does not exist (the topology never ran), a ``window`` on an unwindowed
    aggregate. A key never seen is an answer, with ``found`` False.

    Example::

        >>> answer = query_state("windowed-sum", "sensor-1", rocketmq=settings,
        ...                      window=Window(0, 10_000))  # doctest: +SKIP
        >>> answer.value  # doctest: +SKIP
        {'sum': 12.5}
        >>> query_state("windowed-sum", "sensor-1", rocketmq=settings).value  # doctest: +SKIP
        {Window(start=0, end=10000): {'sum': 12.5}, Window(start=10000, end=20000): {'sum': 3.0}}
    """
    started = time.perf_counter()
    built = resolve_topology(topology)
    chosen = resolve_operator(built, operator)
    if window is not None and chosen.head is not None and chosen.head.window is None:
        raise StateQueryError(
            f"operator {chosen.head.op_id} of {built.job_id} is not windowed; query it without "
            "a window"
        )
    say = progress or (lambda _line: None)
    own_admin = admin is None
    if admin is None:
        if rocketmq is None:
            raise ValueError("query_state needs the RocketMQ settings (rocketmq=) or an admin")
        admin = RocketMQAdmin(rocketmq)
    own_reader = reader is None
    try:
        # The topics (and ids) the job runs under: an earlier release's names included.
        topo = plan_topology_upgrade(admin, built, find_unclaimed=False).topology
        stage = topo.stages[chosen.index]
        agg = stage.queryable
        state_topic = stage.state_topic
        assert agg is not None and state_topic is not None  # resolve_operator picks only these
        try:
            queue_count = len(current_layout(admin, state_topic))
        except TopicNotFoundError:
            raise StateQueryError(
                f"state topic {state_topic!r} of topology {topo.job_id} does not exist on "
                f"{admin.settings.namesrv_addr}: has the topology ever run? It is created when "
                "an instance first starts (the scale job, or `stream-assets run`)"
            ) from None
        queue_id = key_queue(key, queue_count)
        if reader is None:
            reader = QueueReader(admin, f"{topo.job_id}-state-query")

        def report(p: RestoreProgress) -> None:
            if p.messages_total and p.messages_read % PROGRESS_EVERY_MESSAGES == 0:
                say(
                    f"reading {state_topic}[{queue_id}]: {p.messages_read}/{p.messages_total} "
                    f"messages, {p.keys_loaded} keys"
                )

        # A private store, never the instance's: a worker may hold that one open
        # mid-batch, and asking it to hand the store over would stall the instance.
        with (
            tempfile.TemporaryDirectory(prefix="stream-assets-query-", dir=scratch_dir) as tmp,
            QueueStateStore(tmp, topo.job_id, agg.op_id, queue_id) as store,
        ):
            try:
                result = restore_queue(store, state_topic, queue_id, admin, reader, report)
            except StateError as exc:
                raise StateQueryError(
                    f"cannot rebuild {state_topic}[{queue_id}] to answer the query: {exc}"
                ) from exc
            value = read_key_state(store, agg, key, window)
    finally:
        if own_reader and reader is not None:
            reader.close()
        if own_admin:
            admin.close()
    answer = StateAnswer(
        topology=topo.job_id,
        operator=agg.op_id,
        state_topic=state_topic,
        queue_id=queue_id,
        key=key,
        window=window,
        windowed=agg.window is not None,
        value=value,
        seq=result.seq,
        end_offset=result.end_offset,
        keys_in_queue=result.keys,
        snapshot_offset=result.snapshot_offset,
        seconds=time.perf_counter() - started,
    )
    since = "the queue's start" if result.snapshot_offset is None else "its latest snapshot"
    say(
        f"read {answer.read_from} from {since}: {result.messages_read} messages, "
        f"{result.keys} keys in {answer.seconds:.2f}s"
    )
    return answer
