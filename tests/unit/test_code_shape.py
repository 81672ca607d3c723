"""The runtime's layering holds, and its functions stay readable.

- ``runtime.core`` (the per-queue core) and ``runtime.drive`` (what any driver
  needs) never reach Spark, not even through a function-local import of a
  module they import: a second driver, or the test driver, takes them without
  a JVM. Imports go downwards only: ``spark`` -> ``drive`` -> ``core``.
- No function over 60 lines in the runtime (ruff bounds complexity at 15): the
  per-queue core once was one 181-line function switching on the head's type.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stream_assets

_ROOT = Path(stream_assets.__file__).parent
_RUNTIME = _ROOT / "runtime"
_MAX_LINES = 60
_SPARK = ("pyspark", "py4j")


def _module_name(path: Path) -> str:
    parts = path.relative_to(_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_path(name: str) -> Path | None:
    base = _ROOT.parent.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at top level or inside a function."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path.parent)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from package import module` imports the module too
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _closure(start: str) -> dict[str, str]:
    """Module -> the module that first imported it, over stream_assets' own modules."""
    seen = {start: ""}
    todo = [start]
    while todo:
        name = todo.pop()
        path = _module_path(name)
        if path is None:
            continue
        for imported in _imports(path):
            parents = imported.split(".")
            # importing a.b.c runs a/__init__ and a.b/__init__ first
            for depth in range(1, len(parents) + 1):
                candidate = ".".join(parents[:depth])
                if candidate not in seen:
                    seen[candidate] = name
                    if candidate.startswith("stream_assets"):
                        todo.append(candidate)
    return seen


def _chain(seen: dict[str, str], name: str) -> str:
    steps = [name]
    while seen.get(steps[-1]):
        steps.append(seen[steps[-1]])
    return " <- ".join(steps)


_PURE = sorted((*(_RUNTIME / "core").rglob("*.py"), *(_RUNTIME / "drive").rglob("*.py")))


@pytest.mark.parametrize("path", _PURE, ids=lambda p: str(p.relative_to(_RUNTIME)))
def test_core_and_drive_never_reach_spark(path: Path) -> None:
    seen = _closure(_module_name(path))
    wrong = [
        _chain(seen, name)
        for name in seen
        if name.split(".")[0] in _SPARK or name.startswith("stream_assets.runtime.spark")
    ]
    assert not wrong, f"{path.name} reaches Spark: {wrong[:3]}"


@pytest.mark.parametrize(
    "path", sorted((_RUNTIME / "core").rglob("*.py")), ids=lambda p: str(p.relative_to(_RUNTIME))
)
def test_core_never_imports_its_drivers(path: Path) -> None:
    seen = _closure(_module_name(path))
    wrong = [_chain(seen, n) for n in seen if n.startswith("stream_assets.runtime.drive")]
    assert not wrong, f"{path.name} imports a driver layer: {wrong[:3]}"


@pytest.mark.parametrize(
    "path", sorted(_RUNTIME.rglob("*.py")), ids=lambda p: str(p.relative_to(_RUNTIME))
)
def test_no_long_function_in_the_runtime(path: Path) -> None:
    tree = ast.parse(path.read_text())
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > _MAX_LINES
    ]
    assert not long, f"{path.name}: split {long}"


def test_the_checker_sees_a_function_local_spark_import() -> None:
    # the rule would pass vacuously if the walker missed imports inside functions
    seen = _closure("stream_assets.runtime.spark.instance")
    assert "pyspark" in seen and "stream_assets.runtime.core.keyed.attempt" in seen
