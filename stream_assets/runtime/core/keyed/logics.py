"""Which :class:`~stream_assets.runtime.core.keyed.logic.KeyedLogic` runs a keyed head.

>>> type(logic_for(head)).__name__  # doctest: +SKIP
'WindowedAggregate'
"""

from __future__ import annotations

from stream_assets.plan import nodes as n
from stream_assets.runtime.core.keyed.aggregates import (
    PlainAggregate,
    SessionAggregate,
    WindowedAggregate,
)
from stream_assets.runtime.core.keyed.logic import KeyedLogic
from stream_assets.runtime.core.keyed.process import ProcessLogic
from stream_assets.runtime.core.keyed.table_join import TableJoinLogic


def logic_for(head: n.Stateful) -> KeyedLogic:
    """A fresh logic for one batch of ``head`` (a logic may keep what its batch touched)."""
    if isinstance(head, n.Process):
        return ProcessLogic(head)
    if isinstance(head, n.TableJoin):
        return TableJoinLogic(head)
    if not isinstance(head, n.Aggregate):
        raise TypeError(f"{head.op_id}: {type(head).__name__} is not a stateful operator")
    if head.window is None:
        return PlainAggregate(head)
    if head.window.is_merging:
        return SessionAggregate(head)
    return WindowedAggregate(head)
