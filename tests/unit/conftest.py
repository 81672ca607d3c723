"""Unit tests see none of the calling shell's STREAM_ASSETS_* configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No STREAM_ASSETS_* variable of the calling shell leaks into a unit test."""
    for name in list(os.environ):
        if name.startswith("STREAM_ASSETS_"):
            monkeypatch.delenv(name)
    yield
