"""Ship the user's topology code, and every module it imports, to the executors.

Spark pickles a task's functions by reference (module + name) whenever their
module can be imported, so an executor imports the module of every user
function, and with it every module that module imports, and theirs. Modules
of the standard library and of installed distributions (stream-assets itself,
libraries, anything under site-packages) must be installed on the executors
like any dependency. Every other module of that closure -- a topology module
on the driver's ``sys.path``, the helper modules it imports, a script's
package -- is shipped: a top-level package zipped whole (it stays a package,
data files included), a top-level module as its ``.py``, each added with
``SparkContext.addPyFile`` so it reaches every executor, present and future.

How the closure is found (:func:`user_modules`): the source of each module to
ship is parsed with :mod:`ast` for its imports, wherever they are (module
level, inside functions, relative ones), except under ``if TYPE_CHECKING:``;
each name is located with the import system's own finders
(:func:`importlib.util.find_spec`; for a submodule, the path finder on its
parent's package path), so nothing is imported or run. Why these: :mod:`ast`
is the interpreter's own parser, current with every Python version, and the
finders resolve a name as ``import`` will (``sys.path``, namespace packages,
path hooks). :mod:`modulefinder` scans bytecode with its own copy of import
resolution and follows every import through the standard library and
site-packages (pyspark, pyarrow, pandas: seconds, for nothing); ``sys.modules``
holds whatever the driver process imported (Dagster, a test runner, other code
locations), not what the topology needs, and lacks what a function imports
only when it runs.

An import the driver cannot resolve either is left out (an optional import, a
dead branch): it fails on an executor exactly as it would on the driver. A
needed module that cannot be shipped makes the instance refuse to start with
:class:`UnshippableModuleError`, naming the module, who imports it and what
to do: a compiled extension (Python cannot import one from the zip Spark
ships), a module without a ``.py`` file on the driver's disk (defined
interactively, built at run time, bytecode only, inside an archive). One
imported only under ``try: ... except ImportError`` is left to that ``except``.
Not seen: modules imported by a name computed at run time
(``importlib.import_module(name)``); import them in a shipped module, or
install them.

Example::

    >>> from stream_assets.examples import wordcount
    >>> sorted(user_modules(wordcount.build()))  # an installed distribution: nothing to ship
    []
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import shutil
import site
import sys
import sysconfig
import tempfile
import uuid
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from stream_assets.plan.topology import Topology

#: Names never shipped: the interpreter's own (``__main__`` is pickled by value,
#: though its imports are followed).
_NEVER = frozenset({"__main__", "builtins"})
#: Exception names whose ``except`` makes the imports in its ``try`` optional.
_IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


class UnshippableModuleError(ImportError):
    """A module the topology's code needs cannot be shipped to the executors.

    ``name`` is the module; the message says who imports it and what to do.
    """


def _modules_of(value: Any) -> Iterator[str]:
    if isinstance(value, functools.partial):
        yield from _modules_of(value.func)
        return
    if isinstance(value, str | bytes | int | float | bool) or value is None:
        return
    module = getattr(value, "__module__", None) if callable(value) else None
    if module is None or not callable(value) or isinstance(value, type):
        module = type(value).__module__
    if isinstance(module, str):
        yield module


def topology_modules(topology: Topology) -> set[str]:
    """Modules of the topology's functions and values (full names, any origin)."""
    return {
        module
        for node in topology.nodes
        for f in dataclasses.fields(node)
        for module in _modules_of(getattr(node, f.name))
    }


# -- finding modules without importing them ---------------------------------------


def module_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """Where module ``name`` is, as ``import name`` would find it; None if nowhere.

    An imported module's own spec; otherwise the finders, parent by parent,
    without importing anything (``importlib.util.find_spec`` would import the
    parents of a dotted name).
    """
    module = sys.modules.get(name)
    if module is not None:
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            return spec  # type: ignore[no-any-return]
        file = getattr(module, "__file__", None)
        # A module object built at run time: its file if it says one, else no origin.
        found = importlib.util.spec_from_file_location(name, file) if file else None
        return found or importlib.machinery.ModuleSpec(name, None)
    parent = name.rpartition(".")[0]
    if not parent:
        try:
            return importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
    parent_spec = module_spec(parent)
    if parent_spec is None or parent_spec.submodule_search_locations is None:
        return None
    return importlib.machinery.PathFinder.find_spec(
        name, list(parent_spec.submodule_search_locations)
    )


@functools.cache
def _environment_dirs() -> tuple[Path, ...]:
    """Directories of this interpreter's standard library and installed packages."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs.update(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.add(site.getusersitepackages())
    return tuple(Path(d).resolve() for d in dirs)


def _places(spec: importlib.machinery.ModuleSpec) -> list[str]:
    """Files and directories ``spec`` names."""
    places = list(spec.submodule_search_locations or [])
    if spec.has_location and spec.origin:
        places.append(spec.origin)
    return places


def in_environment(top: str, installed: Iterable[str] = ()) -> bool:
    """Whether top-level module ``top`` is the environment's, so every executor has it.

    The standard library, an installed distribution (``installed``: their
    top-level names), or a module found under site-packages or the standard
    library's directory (a ``.pth`` entry without metadata, say).

    >>> in_environment("json"), in_environment("pyspark")
    (True, True)
    """
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top in installed:
        return True
    spec = module_spec(top)
    if spec is None:
        return False
    places = [Path(p).resolve() for p in _places(spec)]
    return bool(places) and all(
        any(p.is_relative_to(d) for d in _environment_dirs()) for p in places
    )


# -- reading imports ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Import:
    """A module name an import statement may load; ``optional`` under ``except ImportError``."""

    name: str
    optional: bool = False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type
    if kinds is None:
        return True
    names = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
    return any(
        (isinstance(n, ast.Name) and n.id in _IMPORT_ERRORS)
        or (isinstance(n, ast.Attribute) and n.attr in _IMPORT_ERRORS)
        for n in names
    )


class _ImportCollector(ast.NodeVisitor):
    """Every name one module's import statements may load (see :func:`imports_of`)."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.found: list[Import] = []
        self._optional = False

    def _add(self, name: str) -> None:
        self.found.append(Import(name, self._optional))

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            # Typing-only imports never run; only the else branch does.
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try | ast.TryStar) -> None:
        outer = self._optional
        self._optional = outer or any(_catches_import_error(h) for h in node.handlers)
        for stmt in node.body:
            self.visit(stmt)
        self._optional = outer
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            try:
                base = importlib.util.resolve_name(
                    "." * node.level + (node.module or ""), self.package
                )
            except (ImportError, ValueError):
                return  # beyond the top-level package: fails on the driver too
        elif node.module is None:
            return
        else:
            base = node.module
        self._add(base)
        for alias in node.names:
            if alias.name != "*":
                self._add(f"{base}.{alias.name}")  # a submodule, or a name (not found: dropped)


def imports_of(source: str | bytes, package: str) -> list[Import]:
    """The module names ``source``'s imports may load, relative ones resolved in ``package``.

    ``from m import x`` gives ``m`` and ``m.x`` (``x`` may be a submodule).

    >>> [i.name for i in imports_of("import a.b\\nfrom .c import d", "pkg")]
    ['a.b', 'pkg.c', 'pkg.c.d']
    >>> imports_of("try:\\n    import fast\\nexcept ImportError:\\n    fast = None", "")
    [Import(name='fast', optional=True)]
    """
    collector = _ImportCollector(package)
    collector.visit(ast.parse(source))
    return collector.found


# -- the closure -------------------------------------------------------------------


def _unshippable(spec: importlib.machinery.ModuleSpec) -> str | None:
    """Why the module of ``spec`` cannot be shipped, and what to do; None if it can."""
    install = (
        "install the project that holds it (e.g. `pip install /path/to/project`) in the "
        "Python of the driver and of every executor: installed distributions are not shipped"
    )
    origin = spec.origin if spec.has_location else None
    if spec.submodule_search_locations is not None:
        if not any(Path(p).is_dir() for p in spec.submodule_search_locations):
            return f"its package is not a directory on disk ({spec.origin}); {install}"
        if origin is None:
            return None  # a namespace package: directories only
    if origin is None:
        return (
            "it has no file on the driver (defined interactively or built at run time); "
            "define it in a .py file in a directory on sys.path, or " + install
        )
    if origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        return (
            f"it is a compiled extension ({origin}), which Python cannot import from the "
            f"zip Spark ships; {install}"
        )
    if not origin.endswith(".py") or not Path(origin).is_file():
        return f"it has no .py source on disk ({origin}); ship its source, or {install}"
    return None


def _package_of(name: str, spec: importlib.machinery.ModuleSpec | None) -> str:
    """The package that relative imports in module ``name`` start from."""
    if spec is not None and spec.submodule_search_locations is not None:
        return name
    return name.rpartition(".")[0]


def installed_modules() -> frozenset[str]:
    """The top-level modules of the installed distributions.

    Read once per state of ``sys.path``: a scan of every distribution's files
    took 80 ms of each ``Instance.start``. Installing or removing a package
    touches its site directory, which makes the next call read them again.

    >>> "pyspark" in installed_modules()
    True
    """
    return _installed_modules(tuple((entry, _mtime_ns(entry)) for entry in sys.path))


@functools.lru_cache(maxsize=4)
def _installed_modules(_paths: tuple[tuple[str, int], ...]) -> frozenset[str]:
    return frozenset(importlib.metadata.packages_distributions())


def _mtime_ns(entry: str) -> int:
    try:
        return Path(entry or ".").stat().st_mtime_ns
    except OSError:
        return -1


class _Closure:
    """The non-installed modules that importing some modules loads (see :func:`needed_modules`)."""

    def __init__(self) -> None:
        self.installed = installed_modules()
        self.needed: dict[str, importlib.machinery.ModuleSpec] = {}
        #: Module -> whether it was reached only optionally so far.
        self._seen: dict[str, bool] = {}
        self._environment: dict[str, bool] = {}

    def _is_environment(self, top: str) -> bool:
        if top not in self._environment:
            self._environment[top] = in_environment(top, self.installed)
        return self._environment[top]

    def add(self, name: str, optional: bool = False, via: str = "the topology's functions") -> None:
        todo = [(name, optional, via)]
        while todo:
            name, optional, via = todo.pop()
            top = name.partition(".")[0]
            if name in self._seen and (optional or not self._seen[name]):
                continue
            self._seen[name] = optional
            if name == "__main__":
                # Pickled by value, never shipped; what it imports is needed all the same.
                todo.extend(self._imports_of_main())
                continue
            if top in _NEVER or self._is_environment(top):
                continue
            spec = module_spec(name)
            if spec is None:
                continue  # the driver cannot import it either
            problem = _unshippable(spec)
            if problem is not None:
                if optional:
                    continue  # the importing `try` expects it may be missing
                raise UnshippableModuleError(
                    f"topology code module {name!r} (imported by {via}) cannot be shipped "
                    f"to the executors: {problem}",
                    name=name,
                    path=spec.origin,
                )
            self.needed[name] = spec
            parent = name.rpartition(".")[0]
            if parent:
                todo.append((parent, optional, via))
            if spec.has_location and spec.origin and spec.origin.endswith(".py"):
                source = Path(spec.origin).read_bytes()
                todo.extend(
                    (i.name, optional or i.optional, name)
                    for i in self._parsed(source, _package_of(name, spec))
                )

    @staticmethod
    def _parsed(source: bytes, package: str) -> list[Import]:
        try:
            return imports_of(source, package)
        except SyntaxError:
            return []  # it cannot import on the driver either

    def _imports_of_main(self) -> list[tuple[str, bool, str]]:
        main = sys.modules.get("__main__")
        file = getattr(main, "__file__", None)
        if main is None or not file or not str(file).endswith(".py"):
            return []  # interactive: nothing on disk to read
        spec = getattr(main, "__spec__", None)
        package = spec.parent if spec is not None else ""
        found = self._parsed(Path(file).read_bytes(), package)
        return [(i.name, i.optional, "__main__") for i in found]


def needed_modules(modules: Iterable[str]) -> dict[str, importlib.machinery.ModuleSpec]:
    """Every module outside the environment that importing ``modules`` loads, by name.

    Raises :class:`UnshippableModuleError` for one that cannot be shipped.
    """
    closure = _Closure()
    for name in sorted(modules):
        closure.add(name)
    return closure.needed


def user_modules(topology: Topology) -> set[str]:
    """Top-level modules to ship: the closure of the topology's non-installed modules.

    Standard-library modules, ``__main__`` (pickled by value; its imports are
    followed) and modules of installed distributions are left out. Raises
    :class:`UnshippableModuleError` naming a needed module that cannot be
    shipped; call it before starting Spark to fail fast.
    """
    return {name.partition(".")[0] for name in needed_modules(topology_modules(topology))}


def package_module(top: str, into: Path) -> Path:
    """A file ``addPyFile`` takes for top-level module ``top``: its package zipped, or its .py.

    Raises ``ModuleNotFoundError`` when the driver cannot find ``top``, and
    :class:`UnshippableModuleError` when it is not source on disk.
    """
    spec = module_spec(top)
    if spec is None:
        raise ModuleNotFoundError(
            f"topology code module {top!r} is not importable on the driver", name=top
        )
    problem = _unshippable(spec)
    if problem is not None:
        raise UnshippableModuleError(
            f"topology code module {top!r} cannot be shipped to the executors: {problem}",
            name=top,
            path=spec.origin,
        )
    module = sys.modules.get(top)
    # A loaded package's __path__ may have been extended after its spec was made.
    paths = list(getattr(module, "__path__", None) or spec.submodule_search_locations or [])
    if paths:
        target = into / f"{top}-{uuid.uuid4().hex[:8]}.zip"
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
            # Portions of a namespace package may repeat (sys.path names "" and the cwd).
            for root in dict.fromkeys(Path(p).resolve() for p in paths if Path(p).is_dir()):
                for file in sorted(root.rglob("*")):
                    if file.is_file() and "__pycache__" not in file.parts:
                        archive.write(file, Path(top) / file.relative_to(root))
        return target
    assert spec.origin is not None  # checked by _unshippable
    source = Path(spec.origin)
    if source.stem != top:
        # Loaded from a file of another name (spec_from_file_location): the executors
        # import it by its module name.
        renamed = into / f"{top}.py"
        shutil.copyfile(source, renamed)
        return renamed
    return source


#: Modules already added, per SparkContext: executors import a module once per
#: Python worker, so adding it again (another instance in the same session) is clutter.
_shipped: dict[int, set[str]] = {}


def ship_user_code(spark_context: Any, topology: Topology) -> list[str]:
    """Add every module of :func:`user_modules` to ``spark_context``; returns their names.

    Raises :class:`UnshippableModuleError` (nothing added) when a needed module
    cannot be shipped.
    """
    done = _shipped.setdefault(id(spark_context), set())
    tops = sorted(user_modules(topology) - done)
    if tops:
        into = Path(tempfile.mkdtemp(prefix="stream-assets-pyfiles-"))
        files = [package_module(top, into) for top in tops]  # all of them, or none added
        for file in files:
            spark_context.addPyFile(str(file))
        done.update(tops)
    return tops
