"""The keyed core stays readable: no function over 60 lines (ruff bounds complexity at 15).

The per-queue core once was one 181-line function switching on the head's
type; this keeps its successor (stream_assets/keyed/) in pieces a reader can
hold in their head.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stream_assets.keyed

_KEYED = Path(stream_assets.keyed.__file__).parent
_MAX_LINES = 60


@pytest.mark.parametrize("path", sorted(_KEYED.glob("*.py")), ids=lambda p: p.name)
def test_no_long_function_in_the_keyed_core(path: Path) -> None:
    tree = ast.parse(path.read_text())
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > _MAX_LINES
    ]
    assert not long, f"{path.name}: split {long}"
