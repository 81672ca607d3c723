"""Runs a stage's stateless operators, a graph of them, over one input at a time.

An element is ``(value, ts)``. From the stage's head, elements flow along the
plan's edges: a map turns each into one, a flat_map into many, a filter keeps
some (their batch forms, ``map_batches`` and the rest, run here on one value
at a time), a :class:`~stream_assets.plan.nodes.Split` sends each to one of
its picks, a node with several children (a stream handle used twice) gives
each child every element, and a union passes on whatever reaches it. Sinks
and prints hand their elements to ``outputs``; a ``key_by`` is an *exit* of
the stage, and :meth:`OperatorGraph.run` returns what reached each exit. The
position of an element among its input's elements at one exit is its
sub-index (the third part of a record's origin).

A user function that raises stops that input only: :class:`UserFunctionError`
names the operator, and the caller sends the input to the dead-letter topic.

Example::

    >>> from stream_assets.plan import nodes as n
    >>> f = n.FlatMap("f", str.split, inputs=("src",))
    >>> m = n.Map("m", str.upper, inputs=("f",))
    >>> k = n.KeyBy("k", len, inputs=("m",))
    >>> graph = OperatorGraph({"src": ("f",), "f": ("m",), "m": ("k",)},
    ...                       {"f": f, "m": m, "k": k}, root="src", exits=("k",), outputs=None)
    >>> graph.run("a b", 0)
    [[('A', 0), ('B', 0)]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from stream_assets.operators.metadata import Metadata
from stream_assets.plan import nodes as n
from stream_assets.runtime.core.stage0.batch_functions import run_on_value

Element = tuple[Any, int]
#: Called for each terminal (sink/print) output: (node, value, ts).
Outputs = Callable[[n.Node, Any, int], None]


class UserFunctionError(Exception):
    """A user function raised; ``op_id`` names the operator."""

    def __init__(self, op_id: str, cause: BaseException) -> None:
        self.op_id = op_id
        self.cause = cause
        super().__init__(f"{op_id}: {type(cause).__name__}: {cause}")


class OperatorGraph:
    """The stateless part of a stage: ``children`` by op id from ``root``, ``exits`` last."""

    def __init__(
        self,
        children: Mapping[str, tuple[str, ...]],
        nodes: Mapping[str, n.Node],
        *,
        root: str,
        exits: tuple[str, ...],
        outputs: Outputs | None,
    ) -> None:
        self.children = children
        self.nodes = nodes
        self.root = root
        self.exit_index = {op_id: i for i, op_id in enumerate(exits)}
        self.outputs = outputs
        self.wants_metadata = any(
            isinstance(node, n.UserFunction) and node.metadata for node in nodes.values()
        )
        self._meta: Metadata | None = None
        self._results: list[list[Element]] = []
        #: The root's children where every one is a sink or print and there is no exit
        #: (a keyed stage's results going straight out, as WordCount's): each result
        #: goes to them without the walk, which was a fifth of emitting it.
        self._terminals_only: tuple[n.Node, ...] | None = None
        below = [nodes[c] for c in children.get(root, ())]
        if (
            outputs is not None
            and not exits
            and all(isinstance(x, n.Sink | n.Print) for x in below)
        ):
            self._terminals_only = tuple(below)

    def run(self, value: Any, ts: int, meta: Metadata | None = None) -> list[list[Element]]:
        """The elements that reach each exit (in ``exits`` order) for one input."""
        if self._terminals_only is not None:
            self._output_directly(self._terminals_only, value, ts)
            return []
        self._meta = meta
        self._results = [[] for _ in self.exit_index]
        self._push(self.root, [(value, ts)])
        return self._results

    def _output_directly(self, nodes: tuple[n.Node, ...], value: Any, ts: int) -> None:
        """What :meth:`_apply` does for a sink or print child of the root, without the walk."""
        outputs = self.outputs
        assert outputs is not None
        for node in nodes:
            try:
                outputs(node, value, ts)
            except UserFunctionError:
                raise
            except Exception as exc:
                raise UserFunctionError(node.op_id, exc) from exc

    def terminals(self) -> list[n.Node]:
        """The sinks and prints reachable from the root within the stage, in plan order
        (each once): where a deletion goes, past every user function."""
        found: list[n.Node] = []
        seen: set[str] = set()
        todo = [self.root]
        while todo:
            for child in self.children.get(todo.pop(0), ()):
                if child in seen or child in self.exit_index:
                    continue
                seen.add(child)
                if isinstance(self.nodes[child], n.Sink | n.Print):
                    found.append(self.nodes[child])
                todo.append(child)
        return found

    def _push(self, op_id: str, elements: list[Element]) -> None:
        for child in self.children.get(op_id, ()):
            node = self.nodes[child]
            exit_at = self.exit_index.get(child)
            if exit_at is not None:
                self._results[exit_at].extend(elements)
            elif isinstance(node, n.Split):
                for index, picked in enumerate(self._split(node, elements)):
                    if picked:
                        self._push_pick(child, index, picked)
            else:
                out = self._apply(node, elements)
                if out:
                    self._push(child, out)

    def _push_pick(self, split_id: str, index: int, elements: list[Element]) -> None:
        for child in self.children.get(split_id, ()):
            node = self.nodes[child]
            if isinstance(node, n.Pick) and node.index == index:
                self._push(child, elements)

    def _split(self, node: n.Split, elements: list[Element]) -> list[list[Element]]:
        outs: list[list[Element]] = [[] for _ in range(len(node.predicates) + 1)]
        try:
            for value, ts in elements:
                for i, predicate in enumerate(node.predicates):
                    if predicate(value):
                        outs[i].append((value, ts))
                        break
                else:
                    if node.default:
                        outs[-1].append((value, ts))
        except Exception as exc:
            raise UserFunctionError(node.op_id, exc) from exc
        return outs

    def _call(self, node: n.UserFunction, value: Any, ts: int) -> Any:
        if not node.metadata:
            return node.fn(value)
        meta = self._meta or Metadata(topic="")
        if meta.event_time != ts:
            meta = dataclasses.replace(meta, event_time=ts)
        return node.fn(value, meta)

    def _apply(self, op: n.Node, elements: list[Element]) -> list[Element]:
        out: list[Element] = []
        try:
            if isinstance(op, n.Map):
                out = [(self._call(op, v, ts), ts) for v, ts in elements]
            elif isinstance(op, n.FlatMap):
                for v, ts in elements:
                    out.extend((item, ts) for item in self._call(op, v, ts))
            elif isinstance(op, n.Filter):
                out = [(v, ts) for v, ts in elements if self._call(op, v, ts)]
            elif isinstance(op, n.Foreach):
                for v, ts in elements:
                    self._call(op, v, ts)
                out = elements
            elif isinstance(op, n.SelectTimestamp):
                out = [(v, int(self._call(op, v, ts))) for v, ts in elements]
            elif isinstance(op, n.BatchFunction):
                # One value at a time: the batch path (batch_count_path) runs whole batches.
                out = [(item, ts) for v, ts in elements for item in run_on_value(op, v)]
            elif isinstance(op, n.Union | n.Pick):
                out = elements
            elif isinstance(op, n.Sink | n.Print):
                if self.outputs is not None:
                    for v, ts in elements:
                        self.outputs(op, v, ts)
            else:
                raise TypeError(f"operator {type(op).__name__} is not stateless")
        except UserFunctionError:
            raise
        except Exception as exc:
            raise UserFunctionError(op.op_id, exc) from exc
        return out
