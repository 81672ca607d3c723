"""Installing stream-assets claims one top-level import name: ``stream_assets``.

A user's own Dagster project very likely has ``jobs`` and ``resources`` packages of its
own; ours install as ``stream_assets.jobs`` and ``stream_assets.resources`` (the repo's
top-level ``jobs/`` and ``resources/`` folders, linked into the package).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_the_distribution_ships_only_stream_assets_with_jobs_and_resources_inside() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(str(ROOT), include=include)
    assert {p.split(".")[0] for p in packages} == {"stream_assets"}
    assert {"stream_assets.jobs", "stream_assets.resources"} <= set(packages)
    for folder in ("jobs", "resources"):
        assert (ROOT / "stream_assets" / folder).resolve() == (ROOT / folder).resolve()


def _top_level_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_nothing_imports_the_folders_by_their_top_level_names() -> None:
    """Two import names for one module would load it twice (two Dagster definitions)."""
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("stream_assets", "jobs", "resources", "tests", "benchmarks")
        for path in (ROOT / folder).rglob("*.py")
        if _top_level_imports(path) & {"jobs", "resources"}
    ]
    assert offenders == []
