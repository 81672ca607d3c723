"""Ship the user's topology code to the executors.

Spark pickles a task's functions by reference (module + name) whenever their
module can be imported, so an executor needs the module of every user function
in the topology. Modules of an installed distribution (stream-assets itself,
libraries) must be installed on the executors like any dependency; anything
else -- a topology module on the driver's ``sys.path``, a script's package --
is zipped from where the driver imported it and added with
``SparkContext.addPyFile``, so it reaches every executor, present and future.

Example::

    >>> from stream_assets.examples import wordcount
    >>> sorted(user_modules(wordcount.build()))  # an installed distribution: nothing to ship
    []
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stream_assets.plan.topology import Topology


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


def user_modules(topology: Topology) -> set[str]:
    """Top-level modules holding the topology's functions that executors cannot import.

    Standard-library modules, ``__main__`` (pickled by value) and modules of
    installed distributions are left out.
    """
    installed = set(importlib.metadata.packages_distributions())
    tops: set[str] = set()
    for node in topology.nodes:
        for f in dataclasses.fields(node):
            for module in _modules_of(getattr(node, f.name)):
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in ("builtins", "__main__"):
                    continue
                if top not in installed:
                    tops.add(top)
    return tops


def package_module(top: str, into: Path) -> Path:
    """A file ``addPyFile`` takes for top-level module ``top``: its package zipped, or its .py.

    Raises ``ModuleNotFoundError`` naming the module when the driver cannot
    locate its source (e.g. it was defined interactively).
    """
    module = sys.modules.get(top)
    if module is None:
        raise ModuleNotFoundError(f"topology code module {top!r} is not imported on the driver")
    paths = list(getattr(module, "__path__", []))
    if paths:
        target = into / f"{top}-{uuid.uuid4().hex[:8]}.zip"
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
            for base in paths:
                root = Path(base)
                for file in sorted(root.rglob("*")):
                    if file.is_file() and "__pycache__" not in file.parts:
                        archive.write(file, Path(top) / file.relative_to(root))
        return target
    source = getattr(module, "__file__", None)
    if not source or not source.endswith(".py"):
        raise ModuleNotFoundError(
            f"topology code module {top!r} has no source file to ship to the executors; "
            "define the topology's functions in a module or package on disk"
        )
    return Path(source)


#: Modules already added, per SparkContext: executors import a module once per
#: Python worker, so adding it again (another instance in the same session) is clutter.
_shipped: dict[int, set[str]] = {}


def ship_user_code(spark_context: Any, topology: Topology) -> list[str]:
    """Add every module of :func:`user_modules` to ``spark_context``; returns their names."""
    done = _shipped.setdefault(id(spark_context), set())
    tops = sorted(user_modules(topology) - done)
    if tops:
        into = Path(tempfile.mkdtemp(prefix="stream-assets-pyfiles-"))
        for top in tops:
            spark_context.addPyFile(str(package_module(top, into)))
        done.update(tops)
    return tops
