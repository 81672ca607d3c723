"""Which topology modules are shipped to executors, and how they are packaged."""

from __future__ import annotations

import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import wordcount
from stream_assets.runtime.user_code import package_module, ship_user_code, user_modules
from stream_assets.serde import text_deserializer


class FakeContext:
    """Records addPyFile calls (a unit test: the cluster test uses a real SparkContext)."""

    def __init__(self) -> None:
        self.files: list[str] = []

    def addPyFile(self, path: str) -> None:
        self.files.append(path)


@pytest.fixture
def user_package(tmp_path: Path) -> Any:
    name = f"usr_{tmp_path.name.replace('-', '_')[-12:]}"
    root = tmp_path / "src" / name
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("from .fns import split\n")
    (root / "fns.py").write_text(textwrap.dedent("def split(line):\n    return line.split()\n"))
    sys.path.insert(0, str(tmp_path / "src"))
    try:
        yield __import__(name)
    finally:
        sys.path.remove(str(tmp_path / "src"))
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]


def test_installed_and_stdlib_modules_are_not_shipped() -> None:
    assert user_modules(wordcount.build()) == set()


def test_a_package_on_the_drivers_path_is_zipped_whole_and_added_once(
    user_package: Any, tmp_path: Path
) -> None:
    builder = StreamBuilder("u")
    (
        builder.source("in", text_deserializer)
        .flat_map(user_package.split)
        .key_by(str.lower)
        .count()
        .to_rstream()
        .sink("out")
    )
    topology = builder.build()
    assert user_modules(topology) == {user_package.__name__}
    archive = package_module(user_package.__name__, tmp_path)
    with zipfile.ZipFile(archive) as z:
        names = set(z.namelist())
    assert {f"{user_package.__name__}/__init__.py", f"{user_package.__name__}/fns.py"} <= names
    sc = FakeContext()
    assert ship_user_code(sc, topology) == [user_package.__name__]
    assert ship_user_code(sc, topology) == []  # the same SparkContext has it already
    assert len(sc.files) == 1


def test_a_module_without_source_is_refused_with_its_name() -> None:
    with pytest.raises(ModuleNotFoundError, match="not_imported_anywhere"):
        package_module("not_imported_anywhere", Path("/tmp"))
