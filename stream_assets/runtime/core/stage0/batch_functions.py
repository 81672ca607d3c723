"""Runs one batch operator (``map_batches``, ``flat_map_batches``, ``filter_batches``).

One definition of what a batch function may return, for both ways it runs:
over a whole batch (:mod:`~stream_assets.runtime.core.stage0.batch_count_path`) and over
one value at a time (:mod:`~stream_assets.runtime.core.stage0.chain`, each value alone in
a one-element array). A function is elementwise, so both give each value the
same answer; a function that breaks that contract (wrong length, wrong type)
fails here, naming what it returned.

Example::

    >>> import pyarrow as pa
    >>> from stream_assets.operators.batches import lower_words
    >>> from stream_assets.plan import nodes as n
    >>> out, parents = run_batch_step(n.FlatMapBatches("f", lower_words), pa.array(["A b", "c"]))
    >>> out.to_pylist(), parents.to_pylist()
    (['a', 'b', 'c'], [0, 0, 1])
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from stream_assets.plan import nodes as n


def run_batch_step(node: n.BatchFunction, values: pa.Array) -> tuple[pa.Array, pa.Array | None]:
    """The values after ``node``, and for each the index of the input value it came from
    (None: one for one, as a map keeps them). Raises what the function raised, or a
    TypeError/ValueError for an answer of the wrong shape."""
    out = _array(node.fn(values), node)
    if len(out) != len(values):
        raise ValueError(
            f"{node.op_id}: a batch function must answer each of its {len(values)} values "
            f"in order, it returned {len(out)}"
        )
    if isinstance(node, n.MapBatches):
        return out, None
    if isinstance(node, n.FlatMapBatches):
        if not (pa.types.is_list(out.type) or pa.types.is_large_list(out.type)):
            raise TypeError(
                f"{node.op_id}: flat_map_batches must return a list array (one list per "
                f"value), got {out.type}"
            )
        return pc.list_flatten(out), pc.list_parent_indices(out)
    if not pa.types.is_boolean(out.type):
        raise TypeError(f"{node.op_id}: filter_batches must return a boolean array, got {out.type}")
    keep = pc.fill_null(out, False)
    return values.filter(keep), pc.indices_nonzero(keep)


def run_on_value(node: n.BatchFunction, value: Any) -> list[Any]:
    """The values ``node`` makes of one value (run alone, in a one-element array)."""
    out, _parents = run_batch_step(node, pa.array([value]))
    return out.to_pylist()  # type: ignore[no-any-return]


def _array(result: Any, node: n.BatchFunction) -> pa.Array:
    if isinstance(result, pa.ChunkedArray):
        return result.combine_chunks()
    if not isinstance(result, pa.Array):
        raise TypeError(
            f"{node.op_id}: a batch function must return a pyarrow.Array, got "
            f"{type(result).__name__}"
        )
    return result
