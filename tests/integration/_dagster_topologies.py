"""A WordCount registered under a per-test-run name (``STREAM_ASSETS_TOPOLOGIES``).

The Dagster tests point ``STREAM_ASSETS_TOPOLOGIES`` here so the code location
(loaded by the daemon in its own processes) operates fresh topics every run.
"""

from __future__ import annotations

import os

from stream_assets.control.registry import TopologyRegistration
from stream_assets.examples import wordcount
from stream_assets.plan.topology import Topology

NAME = f"it-dg-{os.environ.get('STREAM_ASSETS_TEST_RUN_ID', 'local')}"


def build() -> Topology:
    """WordCount on this run's topics."""
    return wordcount.build(NAME, f"{NAME}-in", f"{NAME}-out")


REGISTRATIONS = [TopologyRegistration(NAME, build)]
