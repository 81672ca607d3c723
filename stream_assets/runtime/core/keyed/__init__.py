"""Keyed stages: the per-queue core every keyed head shares, and the heads' logic.

- :mod:`.batch`: :func:`run_keyed_batch`, one batch of one queue.
- :mod:`.logic`: :class:`KeyedLogic`, what a head implements.
- :mod:`.aggregates`, :mod:`.table_join`, :mod:`.process`: the heads (aggregates and
  windows, the stream-table join, the user's processor); :mod:`.logics` picks one.
- :mod:`.ttl`: state time to live; :mod:`.emit`: what a batch sends; :mod:`.results`:
  result values and names; :mod:`.partials`: a step's pre-combined partials, merged
  per key before they are folded.

The Spark adapter (:mod:`stream_assets.runtime.spark.task`) and the test driver
(:class:`stream_assets.testing.TopologyTestDriver`) both run :func:`run_keyed_batch`.

>>> stats = run_keyed_batch(ctx, 0, end, records, store, sender)  # doctest: +SKIP
>>> read_key_state(store, head, "apple")  # doctest: +SKIP
{'count': 3}
"""

from __future__ import annotations

from typing import Any

from stream_assets.plan import nodes as n
from stream_assets.runtime.core.keyed.batch import check_owner, run_keyed_batch
from stream_assets.runtime.core.keyed.logics import logic_for
from stream_assets.state.store import QueueStateStore
from stream_assets.windows import Window


def read_key_state(
    store: QueueStateStore, head: n.Stateful, key: Any, window: Window | None = None
) -> Any:
    """The current state of ``key`` in ``store`` (the queue that owns the key).

    Unwindowed aggregate: the result (a dict by alias) or None. Windowed: the
    key's open (not yet fired) windows as ``{Window: result}``, or with
    ``window`` that window's result or None. A processor: its states by name.
    A table join: the key's table versions.
    """
    return logic_for(head).read(store, key, window)


__all__ = ["check_owner", "read_key_state", "run_keyed_batch"]
