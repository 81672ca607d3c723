"""Built-in batch functions for ``map_batches`` / ``flat_map_batches``: Arrow compute.

A batch function takes a ``pyarrow.Array`` of a batch's values and answers for
each value in order; it runs in C over the whole batch. It must be
elementwise (a value's answer may not depend on its neighbours): where a
batch function raises, the engine runs the batch again value by value (each
value alone in a one-element array), so the value that fails goes to the dead
letters on its own, whatever batch it came in. Any ``pyarrow.compute``
function of one array that keeps its length is such a function.

Arrow's text functions follow Unicode, not Python: ``utf8_split_whitespace``
splits on Unicode white space only (Python's ``str.split`` also splits on the
ASCII separators 0x1C-0x1F), and ``utf8_lower`` maps each code point alone
(``"İ".lower()`` is two code points in Python, one here).

Example::

    >>> import pyarrow as pa
    >>> lower_words(pa.array(["To be", "or NOT"])).to_pylist()
    [['to', 'be'], ['or', 'not']]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def split_words(lines: Any) -> pa.Array:
    """Each text's words, split on runs of white space (a list array), as ``str.split()``.

    >>> split_words(pa.array([" a  b ", ""])).to_pylist()
    [['a', 'b'], []]
    """
    return _without_empty(pc.utf8_split_whitespace(lines))


def lower_words(lines: Any) -> pa.Array:
    """Each text's words, lower-cased (a list array): WordCount's split."""
    return split_words(pc.utf8_lower(lines))


def _without_empty(lists: pa.ListArray) -> pa.ListArray:
    """``lists`` without their empty strings: Arrow's split gives one before leading and
    after trailing white space, and one for a text that is nothing else."""
    flat = pc.list_flatten(lists)
    keep = pc.not_equal(pc.binary_length(flat), 0)
    if pc.all(keep).as_py() is not False:
        return lists
    parents = pc.list_parent_indices(lists).filter(keep).to_numpy()
    offsets = np.zeros(len(lists) + 1, dtype=np.int32)
    np.cumsum(np.bincount(parents, minlength=len(lists)), out=offsets[1:])
    mask = lists.is_null() if lists.null_count else None
    return pa.ListArray.from_arrays(pa.array(offsets), flat.filter(keep), mask=mask)
