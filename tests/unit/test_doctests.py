"""Every docstring example of the engine, Dagster resources and jobs, and the
benchmarks' helpers runs, and holds.

Examples marked ``# doctest: +SKIP`` need a broker or Spark; everything else is
executed here, so a docstring cannot drift from the code it shows.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from types import ModuleType

import pytest

import benchmarks
import stream_assets


def _modules() -> list[str]:
    names: list[str] = []
    # stream_assets.jobs and stream_assets.resources (the top-level jobs/ and resources/
    # folders) are walked as subpackages.
    names.append(stream_assets.__name__)
    names.extend(m.name for m in pkgutil.walk_packages(stream_assets.__path__, "stream_assets."))
    # The figures a benchmark prints come from these helpers (percentiles, medians).
    names.extend(m.name for m in pkgutil.walk_packages(benchmarks.__path__, "benchmarks."))
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module: ModuleType = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


def test_examples_exist() -> None:
    attempted = sum(
        doctest.testmod(importlib.import_module(n), report=False).attempted for n in _modules()
    )
    assert attempted > 50, f"only {attempted} docstring examples ran: discovery is broken"
