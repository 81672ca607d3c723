"""Which topology modules are shipped to executors, and how they are packaged.

The trees are real modules on disk, each test with names of its own (so
``sys.modules`` never mixes them up); "an executor" is a fresh Python whose
path holds only what was shipped (stream-assets is installed there, as on an
executor).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import types
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import wordcount
from stream_assets.plan.topology import Topology
from stream_assets.runtime.drive.user_code import (
    UnshippableModuleError,
    imports_of,
    package_module,
    ship_user_code,
    user_modules,
)
from stream_assets.serde import text_deserializer


class FakeContext:
    """Records addPyFile calls (a unit test: the cluster test uses a real SparkContext)."""

    def __init__(self) -> None:
        self.files: list[str] = []

    def addPyFile(self, path: str) -> None:
        self.files.append(path)


def _topology(fn: Callable[[str], Any]) -> Topology:
    builder = StreamBuilder("u")
    (
        builder.source("in", text_deserializer)
        .flat_map(fn)
        .key_by(str.lower)
        .count()
        .to_rstream()
        .sink("out")
    )
    return builder.build()


class Tree:
    """Modules written under ``root`` (on ``sys.path`` while the test runs)."""

    def __init__(self, root: Path, suffix: str) -> None:
        self.root = root
        self.suffix = suffix

    def name(self, stem: str) -> str:
        """``stem`` made unique to this test."""
        return f"{stem}_{self.suffix}"

    def write(self, relative: str, source: str) -> Path:
        path = self.root / relative.format(s=self.suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source.format(s=self.suffix)))
        return path

    def imported(self, name: str) -> Any:
        return importlib.import_module(self.name(name))


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    suffix = tmp_path.name.replace("-", "_")[-12:]
    root = tmp_path / "src"
    root.mkdir()
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield Tree(root, suffix)
    finally:
        sys.path.remove(str(root))
        for mod in [m for m in sys.modules if m.endswith(suffix) or f"{suffix}." in m]:
            del sys.modules[mod]


@pytest.fixture
def user_package(tree: Tree) -> Any:
    tree.write("usr_{s}/__init__.py", "from .fns import split\n")
    tree.write("usr_{s}/fns.py", "def split(line):\n    return line.split()\n")
    return tree.imported("usr")


def _on_an_executor(files: list[str], tmp_path: Path, code: str) -> str:
    """Run ``code`` in a fresh Python that has only ``files`` (addPyFile's) on its path."""
    shipped = tmp_path / "executor"
    shipped.mkdir()
    path = []
    for file in map(Path, files):
        if file.suffix == ".zip":
            path.append(str(file))
        else:
            (shipped / file.name).write_bytes(file.read_bytes())
    path.append(str(shipped))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=shipped,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_installed_and_stdlib_modules_are_not_shipped() -> None:
    assert user_modules(wordcount.build()) == set()


def test_a_package_on_the_drivers_path_is_zipped_whole_and_added_once(
    user_package: Any, tmp_path: Path
) -> None:
    topology = _topology(user_package.split)
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


def test_the_helpers_a_topology_module_imports_are_shipped_transitively(
    tree: Tree, tmp_path: Path
) -> None:
    # topo (a module) -> helpers (a package: __init__ -> .text) -> deep (a module,
    # imported inside a function only) -> deeper (a package, by relative import)
    tree.write(
        "topo_{s}.py",
        """
        from helpers_{s}.text import words

        def split(line):
            return words(line)
        """,
    )
    tree.write("helpers_{s}/__init__.py", "from . import text\n")
    tree.write(
        "helpers_{s}/text.py",
        """
        def words(line):
            import deep_{s}
            return [deep_{s}.norm(w) for w in line.split()]
        """,
    )
    tree.write("helpers_{s}/unused.py", "import no_such_module_{s}\n")  # never imported
    tree.write("deep_{s}.py", "from deeper_{s}.norms import norm\n")
    tree.write("deeper_{s}/__init__.py", "")
    tree.write("deeper_{s}/norms.py", "from .case import lower as norm\n")
    tree.write("deeper_{s}/case.py", "def lower(w):\n    return w.lower()\n")
    topo = tree.imported("topo")
    assert tree.name("deep") not in sys.modules  # only a function imports it

    topology = _topology(topo.split)
    expected = {tree.name(n) for n in ("topo", "helpers", "deep", "deeper")}
    assert user_modules(topology) == expected
    assert tree.name("deep") not in sys.modules  # found, not imported

    sc = FakeContext()
    assert ship_user_code(sc, topology) == sorted(expected)
    by_name = {Path(f).name.split("-")[0].removesuffix(".py"): f for f in sc.files}
    assert by_name[tree.name("topo")].endswith(f"topo_{tree.suffix}.py")  # a module: its file
    with zipfile.ZipFile(by_name[tree.name("helpers")]) as z:  # a package: stays one
        assert {f"{tree.name('helpers')}/__init__.py", f"{tree.name('helpers')}/text.py"} <= set(
            z.namelist()
        )
    out = _on_an_executor(
        sc.files, tmp_path, f"import topo_{tree.suffix} as t; print(t.split('Hello World'))"
    )
    assert out.strip() == "['hello', 'world']"


def test_optional_and_typing_only_imports_are_not_needed(tree: Tree) -> None:
    tree.write(
        "topo_{s}.py",
        """
        from typing import TYPE_CHECKING

        try:
            import fast_{s} as impl
        except ImportError:
            import slow_{s} as impl
        if TYPE_CHECKING:
            import typing_only_{s}

        def split(line):
            return impl.split(line)
        """,
    )
    tree.write("fast_{s}.so", "not really an extension")
    tree.write("slow_{s}.py", "def split(line):\n    return line.split()\n")
    tree.write("typing_only_{s}.py", "import no_such_module_{s}\n")
    # `import fast` fails on the driver too (not a real extension): the fallback runs.
    topo = tree.imported("topo")
    topology = _topology(topo.split)
    # The extension is optional (refusing would stop a topology that runs), the
    # fallback is shipped, the typing-only module is not needed.
    assert user_modules(topology) == {tree.name("topo"), tree.name("slow")}


def test_a_needed_compiled_extension_is_refused_naming_it_and_the_fix(tree: Tree) -> None:
    tree.write("topo_{s}.py", "import helper_{s}\n\ndef split(line):\n    return [line]\n")
    tree.write("helper_{s}/__init__.py", "def _load():\n    from . import _speedups\n")
    tree.write("helper_{s}/_speedups.so", "built in place")
    topo = tree.imported("topo")
    sc = FakeContext()
    with pytest.raises(UnshippableModuleError) as caught:
        ship_user_code(sc, _topology(topo.split))
    message = str(caught.value)
    assert f"'helper_{tree.suffix}._speedups'" in message
    assert f"imported by helper_{tree.suffix}" in message
    assert "compiled extension" in message and "pip install" in message
    assert caught.value.name == f"helper_{tree.suffix}._speedups"
    assert sc.files == []  # nothing added: the instance does not start


def test_a_module_without_a_file_is_refused_naming_it(tree: Tree) -> None:
    name = tree.name("made_at_run_time")
    module = types.ModuleType(name)
    exec("def split(line):\n    return line.split()\n", module.__dict__)
    module.split.__module__ = name
    sys.modules[name] = module
    with pytest.raises(UnshippableModuleError, match=f"'{name}'.*no file on the driver"):
        user_modules(_topology(module.split))


def test_what_a_scripts_main_imports_is_shipped_though_main_is_not(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tree.write(
        "run_{s}.py",
        "import helpers_{s}\n\ndef split(line):\n    return helpers_{s}.split(line)\n",
    )
    tree.write("helpers_{s}.py", "def split(line):\n    return line.split()\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    exec(script.read_text(), main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert main.split.__module__ == "__main__"
    assert user_modules(_topology(main.split)) == {tree.name("helpers")}


def test_a_module_loaded_under_another_name_is_shipped_under_its_module_name(
    tree: Tree, tmp_path: Path
) -> None:
    path = tree.write("file_{s}.py", "def split(line):\n    return line.split()\n")
    name = tree.name("loaded_as")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    shipped = package_module(name, tmp_path)
    assert shipped.name == f"{name}.py"


def test_imports_are_read_with_relative_names_resolved() -> None:
    found = imports_of(
        "import a.b as c\nfrom .. import up\nfrom .x import *\nfrom m import (n, o)\n",
        "pkg.sub",
    )
    assert [i.name for i in found] == ["a.b", "pkg", "pkg.up", "pkg.sub.x", "m", "m.n", "m.o"]
