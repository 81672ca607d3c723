"""Stage 0's specialised path: a straight chain of maps into a pre-combined count.

WordCount's shape, and the commonest keyed stage: ``source -> map/flat_map/filter
... -> key_by -> count()``. Through the general path each word cost a trip
through the operator graph (a ``(value, ts)`` tuple per element), a route
lookup, a six-tuple, a packability check and a slot update, all in Python:
stage 0 ran at 10 % of ``collections.Counter`` over the same lines
(``benchmarks/profile_batch.py``). Here a record's values go through the
chain as plain lists (the timestamp is the record's: no operator of such a
chain changes it), are keyed with one ``map``, checked and counted in C
(``Counter.update``), and routed once per distinct key at send time.

Nothing here changes a verdict: a record is taken only when the general path
would take it whole (every key a ``str``, every value a ``str``, all encodable
and small enough for a shuffle entry, so nothing can become a dead letter
later); any other record goes the general way, and a user function that
raises raises here as there, naming the same operator. Where a shuffle
queue's batch cannot go combined after all (``ShuffleOut.send_all``), the
taken records are keyed again, in order, from their values: key functions are
pure, as replays already require.

Example::

    >>> from stream_assets.examples import wordcount
    >>> from stream_assets.runtime.core.context import StageContext, TaskStats
    >>> from stream_assets.runtime.core.stage0.shuffle_out import ShuffleOut
    >>> ctx = StageContext.of(wordcount.build(), 0, shuffle_queues=2, source_queues=(0,))
    >>> shuffle = ShuffleOut(ctx, sender=None, stats=TaskStats(), src=0, combine=True)
    >>> path = CountPath.of(ctx.stage, shuffle)
    >>> path.take("to be or not to be", 7, offset=0) is None  # counted
    True
    >>> path.counts.most_common(2)
    [('to', 2), ('be', 2)]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from itertools import repeat
from typing import Any

from stream_assets.operators.aggregates import whole_value
from stream_assets.plan import nodes as n
from stream_assets.plan.topology import Stage
from stream_assets.runtime.core.stage0.chain import UserFunctionError
from stream_assets.runtime.core.stage0.shuffle_out import ENTRY_OVERHEAD, ShuffleOut

#: What a key string may take beyond its UTF-8 bytes in msgpack (a str 32 header).
_STR_HEADER = 5
#: What a per-record shuffle entry takes beyond its key's and value's UTF-8 bytes.
ENTRY_ROOM = ENTRY_OVERHEAD + _STR_HEADER
#: The most UTF-8 bytes one character takes.
_UTF8_MAX = 4
_INT64_MIN, _UINT64_END = -(1 << 63), 1 << 64

Chain = Callable[[Any], list[Any]]


class CountPath:
    """Counts the records of one batch that fit the shape; :meth:`take` says which.

    A record it does not count goes on the general way with the values that
    reached the exit: the chain's functions run once per record either way.
    """

    def __init__(self, chain: Chain, key_fn: Callable[[Any], Any], shuffle: ShuffleOut) -> None:
        self._chain = chain
        self._key_fn = key_fn
        self._shuffle = shuffle
        #: Most UTF-8 bytes of a key plus its value sure to fit one shuffle entry.
        self._room = shuffle.entry_limit - ENTRY_ROOM
        #: str key -> occurrences in this batch; and the latest event time of each.
        self.counts: Counter[str] = Counter()
        self.latest: dict[str, int] = {}
        self._top = _INT64_MIN  # the latest event time of any counted record

    @classmethod
    def of(cls, stage: Stage, shuffle: ShuffleOut) -> CountPath | None:
        """The path for ``stage``'s batch, or None where the stage or batch has another shape:
        see :func:`counted_chain`; the chain's operators are maps, flat_maps and filters,
        none of which asks for metadata."""
        found = counted_chain(stage, shuffle)
        if found is None:
            return None
        key_by, nodes = found
        ops = [x for x in nodes if isinstance(x, n.Map | n.FlatMap | n.Filter) and not x.metadata]
        if len(ops) != len(nodes):
            return None
        return cls(_compile(ops), key_by.fn, shuffle)

    def take(self, value: Any, ts: int, offset: int) -> list[Any] | None:
        """Count the record of ``value`` (event time ``ts``) if it fits: None. Else the values
        that reached the exit, for the general path to key and fold. Raises
        UserFunctionError as the general path would."""
        values = self._chain(value)
        if not values:
            return None
        if type(ts) is not int or not _INT64_MIN <= ts < _UINT64_END:
            return values
        key_fn = self._key_fn
        if key_fn is whole_value:  # keyed by the value: a list and a check fewer
            keys = values
            key_width, key_chars = value_width, value_chars = utf8_width(values)
        else:
            try:
                keys = list(map(key_fn, values))
            except Exception as exc:
                raise UserFunctionError(self._shuffle.exits[0].key_by.op_id, exc) from exc
            key_width, key_chars = utf8_width(keys)
            value_width, value_chars = utf8_width(values) if key_width else (0, 0)
        if not value_width:
            return values
        # The record's characters bound its longest entry's, and nearly always fit:
        # the exact longest (two passes over the record) only when they do not.
        longest = key_chars + value_chars
        if longest * max(key_width, value_width) > self._room:
            longest = max(map(len, keys)) + max(map(len, values))
            if longest * max(key_width, value_width) > self._room:
                return values
        self.counts.update(keys)
        if ts >= self._top:
            # Later than every record so far: the latest of each of its keys.
            self._top = ts
            self.latest.update(zip(keys, repeat(ts)))
        else:
            latest = self.latest
            for key in keys:
                if ts > latest.get(key, _INT64_MIN):
                    latest[key] = ts
        self._shuffle.took(values, ts, offset)
        return None

    def merge(self) -> None:
        """Add the batch's counts to the shuffle's combined slots; before
        :meth:`ShuffleOut.send_all`."""
        merge_counts(self._shuffle, self.counts, self.latest)
        self.counts.clear()


def counted_chain(stage: Stage, shuffle: ShuffleOut) -> tuple[n.KeyBy, list[n.Node]] | None:
    """The ``key_by`` of ``stage``'s one exit and the operators from its source to it, one
    after another, if the exit's batch is pre-combined into a count with no window (so
    no record can be late); else None."""
    # counts_only: the one exit feeds an aggregate (not a join) that only counts.
    if len(stage.exits) != 1 or not shuffle.counts_only or not shuffle.combine:
        return None
    exit_ = stage.exits[0]
    if exit_.head.window is not None:
        return None
    nodes: list[n.Node] = []
    at = stage.root
    while True:
        children = stage.children.get(at, ())
        if len(children) != 1:
            return None
        at = children[0]
        if at == exit_.key_by.op_id:
            return exit_.key_by, nodes
        nodes.append(stage.nodes[at])


def merge_counts(shuffle: ShuffleOut, counts: Mapping[str, int], latest: Mapping[str, int]) -> None:
    """Add ``counts`` (str key -> occurrences, ``latest`` its latest event time) to the
    shuffle's combined slots, routing each key once."""
    route, combined, records = shuffle.router.route, shuffle.combined, shuffle.combined_records
    for key, count in counts.items():
        key_bytes, target = route(key)
        slots = combined[target]
        entry_key = (key_bytes, None, None)
        slot = slots.get(entry_key)
        if slot is None:
            slots[entry_key] = [key, None, None, None, latest[key], count]
        else:
            slot[4] = max(slot[4], latest[key])
            slot[5] += count
        records[target] += count


def utf8_width(items: list[Any]) -> tuple[int, int]:
    """Most UTF-8 bytes per character if every item is exactly a ``str`` that UTF-8 can
    encode (no lone surrogate), which msgpack then packs whatever it holds, else 0;
    and the items' characters in all. In C but for the calls.

    >>> utf8_width(["to", "be"]), utf8_width(["café"]), utf8_width(["a", 1])
    ((1, 4), (4, 4), (0, 0))
    """
    # Counted, not collected into a set: a third cheaper on a record's words.
    if list(map(type, items)).count(str) != len(items):
        return 0, 0
    joined = "".join(items)
    if joined.isascii():
        return 1, len(joined)
    try:
        joined.encode()
    except UnicodeEncodeError:
        return 0, 0
    return _UTF8_MAX, len(joined)


def _compile(ops: list[n.Map | n.FlatMap | n.Filter]) -> Chain:
    """``ops`` as one function of a value to the list of values that reach the exit."""
    steps = [_step(op) for op in ops]

    def chain(value: Any) -> list[Any]:
        values = [value]
        for step in steps:
            values = step(values)
        return values

    return chain


def _step(node: n.Map | n.FlatMap | n.Filter) -> Callable[[list[Any]], list[Any]]:
    fn, op_id = node.fn, node.op_id

    def failing(exc: Exception) -> UserFunctionError:
        return UserFunctionError(op_id, exc)

    if isinstance(node, n.Map):

        def step(values: list[Any]) -> list[Any]:
            try:
                return list(map(fn, values))
            except Exception as exc:
                raise failing(exc) from exc

    elif isinstance(node, n.FlatMap):

        def step(values: list[Any]) -> list[Any]:
            try:
                if len(values) == 1:
                    return list(fn(values[0]))
                return [out for v in values for out in fn(v)]
            except Exception as exc:
                raise failing(exc) from exc

    else:

        def step(values: list[Any]) -> list[Any]:
            try:
                return [v for v in values if fn(v)]
            except Exception as exc:
                raise failing(exc) from exc

    return step
