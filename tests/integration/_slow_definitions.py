"""The code location, slow to load once: as its import is on a machine under heavy load.

A code server started on this module (``dagster code-server start -m
tests.integration._slow_definitions``) sleeps for the seconds written in the file
``STREAM_ASSETS_TEST_SLOW_LOAD_FILE`` names, then loads ``stream_assets.definitions``.
The first process to load it takes the file (the code server's own), so the run
workers that load it later start as usual. The sleep is the injected fault itself,
not a wait for anything.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from stream_assets.definitions import defs

_delay = os.environ.get("STREAM_ASSETS_TEST_SLOW_LOAD_FILE")
if _delay:
    with contextlib.suppress(FileNotFoundError):
        taken = Path(_delay).rename(f"{_delay}.taken-by-{os.getpid()}")
        time.sleep(float(taken.read_text()))

__all__ = ["defs"]
