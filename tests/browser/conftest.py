"""Browser tests: remember each test's outcome so the page fixture can screenshot a failure."""

from __future__ import annotations

from collections.abc import Generator

import pytest

#: Set on a test item when its call phase failed (read by the ``page`` fixture's teardown).
CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report
