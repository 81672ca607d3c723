"""How the things a topology keeps on the broker are named, and what their state holds.

A stateful operator's id names its shuffle topic (``<job>__shuffle__<id>``), its
state topic (``<job>__state__<id>``) and its local stores; a sink's id is part
of every message key it writes. Both must survive unrelated edits, so neither
counts operators: a stateful operator is called by the ``name=`` its user gave
(or its ``key_by``'s), else by its kind and its place among the unnamed
operators of that kind (``aggregate``, ``aggregate_2``; ``process``,
``join``, ``join_table``); a sink by its topic (``sink_<topic>``, then
``sink_<topic>_2``). Adding, removing or changing stateless operators, sinks
or other branches leaves them as they are. Stateless operators keep
positional ids (``map-3``): they name nothing persistent.

The previous release named everything positionally (``aggregate-3``: the
operator's index among all operators; the shuffle topic after the first
``key_by``): :func:`positional_ids` recomputes those names, so a job started
under it keeps its topics (:mod:`~stream_assets.control.upgrade`).

:func:`state_format` describes what a stateful operator's state holds, so a
restart can tell whether a changed topology can carry it over.

>>> default_stateful_id("aggregate", 1), default_stateful_id("aggregate", 2)
('aggregate', 'aggregate_2')
>>> default_sink_id("wordcount-out", 1)
'sink_wordcount-out'
"""

from __future__ import annotations

import re
from typing import Any

from stream_assets.plan import nodes as n

#: Operator names become part of topic names (``<job id>__state__<name>``): with a job
#: id of up to 80 characters, this keeps every topic under RocketMQ's 127.
_OPERATOR_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,32}$")


def validate_operator_name(name: str) -> str:
    """``name`` if it can name an operator's topics, else a ValueError that says why."""
    if not isinstance(name, str) or not _OPERATOR_NAME.match(name):
        raise ValueError(
            f"operator name {name!r} is not valid: use 1-32 letters, digits, '_' or '-' "
            "(it becomes part of the operator's shuffle and state topic names)"
        )
    return name


def default_stateful_id(kind: str, ordinal: int) -> str:
    """The id of the ``ordinal``-th (from 1) unnamed stateful operator of ``kind``."""
    return kind if ordinal == 1 else f"{kind}_{ordinal}"


def default_sink_id(topic: str, ordinal: int) -> str:
    """The id of the ``ordinal``-th (from 1) sink writing ``topic``."""
    return f"sink_{topic}" if ordinal == 1 else f"sink_{topic}_{ordinal}"


def sink_transaction_group(job_id: str) -> str:
    """The producer group of a job's exactly-once sink messages: the broker accepts
    their commit only from it and asks it (any instance of the job) what became of one.

    >>> sink_transaction_group("wordcount")
    'wordcount__sink-tx'
    """
    return f"{job_id}__sink-tx"


def stateful_kind(head: n.Stateful) -> str:
    """``aggregate``, ``join``, ``join_table`` or ``process``."""
    if isinstance(head, n.Join):
        return "join"
    if isinstance(head, n.TableJoin):
        return "join_table"
    if isinstance(head, n.Process):
        return "process"
    return "aggregate"


def positional_ids(nodes: tuple[n.Node, ...]) -> dict[str, str]:
    """The ids the previous release gave the stateful operators and sinks of ``nodes``
    (its kind and its index among all operators), by their id now.

    >>> from stream_assets.examples import wordcount
    >>> positional_ids(wordcount.build().nodes)
    {'aggregate': 'aggregate-3', 'sink_wordcount-out': 'sink-4'}
    """
    old: dict[str, str] = {}
    for index, node in enumerate(nodes):
        if isinstance(node, n.Stateful):
            old[node.op_id] = f"{stateful_kind(node)}-{index}"
        elif isinstance(node, n.Sink):
            old[node.op_id] = f"sink-{index}"
    return old


def state_format(head: n.Stateful) -> dict[str, Any]:
    """What ``head``'s state holds, as plain JSON: two heads with the same format can
    read each other's state; anything else (TTL, lateness, early results) may change.

    >>> from stream_assets.examples import wordcount
    >>> state_format(wordcount.build().stages[1].head)
    {'kind': 'aggregate', 'window': None, 'accumulators': [['count', 'Count']]}
    """
    form: dict[str, Any] = {"kind": stateful_kind(head), "window": _window(head.window)}
    if isinstance(head, n.Join):
        form["join"] = head.kind
    elif isinstance(head, n.Aggregate):
        parts = getattr(head.accumulator, "parts", None)
        accumulators = parts if parts is not None else [("", head.accumulator)]
        form["accumulators"] = [[alias, type(acc).__qualname__] for alias, acc in accumulators]
    elif isinstance(head, n.Process):
        processor = type(head.processor)
        form["processor"] = f"{processor.__module__}.{processor.__qualname__}"
    return form


def describe_change(before: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between two :func:`state_format` results, in words.

    >>> describe_change({"kind": "aggregate", "accumulators": [["count", "Count"]]},
    ...                 {"kind": "aggregate", "accumulators": [["sum", "Sum"]]})
    "accumulators [['count', 'Count']] -> [['sum', 'Sum']]"
    """
    changed = [
        f"{field} {before.get(field)} -> {now.get(field)}"
        for field in sorted({*before, *now})
        if before.get(field) != now.get(field)
    ]
    return "; ".join(changed)


def _window(spec: Any) -> dict[str, Any] | None:
    """A window spec as JSON (its own ``to_dict``)."""
    if spec is None:
        return None
    to_dict = getattr(spec, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else {"spec": repr(spec)}
