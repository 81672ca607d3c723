"""Runs a stage's stateless operators over one element at a time.

An element is ``(value, ts)``; a flat_map can turn one element into many, and
the position of an output among its source record's outputs is its sub-index
(the third part of a record's origin). A user function that raises stops that
record only: :class:`UserFunctionError` names the operator, and the caller
sends the original bytes to the dead-letter topic.

Example::

    >>> from stream_assets.plan import nodes as n
    >>> chain = OperatorChain((n.FlatMap("f", str.split), n.Map("m", str.upper)), outputs=None)
    >>> chain.run("a b", 0)
    [('A', 0), ('B', 0)]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stream_assets.plan import nodes as n

Element = tuple[Any, int]
#: Called for each terminal (sink/print) output: (node, value, ts).
Outputs = Callable[[n.Node, Any, int], None]


class UserFunctionError(Exception):
    """A user function raised; ``op_id`` names the operator."""

    def __init__(self, op_id: str, cause: BaseException) -> None:
        self.op_id = op_id
        self.cause = cause
        super().__init__(f"{op_id}: {type(cause).__name__}: {cause}")


class OperatorChain:
    """The stateless part of a stage, applied element by element."""

    def __init__(self, ops: tuple[n.Node, ...], outputs: Outputs | None) -> None:
        self.ops = ops
        self.outputs = outputs

    def run(self, value: Any, ts: int) -> list[Element]:
        """Every element that leaves the chain (to the shuffle) for one input."""
        elements: list[Element] = [(value, ts)]
        for op in self.ops:
            elements = self._apply(op, elements)
            if not elements:
                break
        return elements

    def _apply(self, op: n.Node, elements: list[Element]) -> list[Element]:
        out: list[Element] = []
        try:
            for value, ts in elements:
                if isinstance(op, n.Map):
                    out.append((op.fn(value), ts))
                elif isinstance(op, n.FlatMap):
                    out.extend((item, ts) for item in op.fn(value))
                elif isinstance(op, n.Filter):
                    if op.fn(value):
                        out.append((value, ts))
                elif isinstance(op, n.Foreach):
                    op.fn(value)
                    out.append((value, ts))
                elif isinstance(op, n.SelectTimestamp):
                    out.append((value, int(op.fn(value))))
                elif isinstance(op, n.Sink | n.Print):
                    if self.outputs is not None:
                        self.outputs(op, value, ts)
                else:
                    raise TypeError(f"operator {type(op).__name__} is not stateless")
        except UserFunctionError:
            raise
        except Exception as exc:
            raise UserFunctionError(op.op_id, exc) from exc
        return out
