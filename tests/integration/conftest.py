"""Fixtures for tests that run topologies on Spark: one SparkSession per test session.

``Instance.start()`` calls ``SparkSession.builder.getOrCreate()`` and
``Instance.stop()`` stops only its queries, so every instance of the session
shares one SparkSession; it is stopped (``Instance.close()``) once, at the
end of the session. A test's instances are stopped when the test ends, even
when it fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stream_assets.plan.topology import Topology
from stream_assets.runtime.spark.instance import Instance
from stream_assets.settings import EngineSettings, RocketMQSettings
from tests.integration._rocketmq_cluster import cluster_restored, rocketmq_cluster  # noqa: F401

#: Quiet Spark: no console progress bars in the test output.
SPARK_CONF = {"spark.ui.showConsoleProgress": "false"}


class EngineHarness:
    """Builds Instances against the test broker and owns the shared SparkSession."""

    def __init__(self, client_settings: RocketMQSettings) -> None:
        self.client_settings = client_settings
        self._running: list[Instance] = []
        self._last: Instance | None = None

    def instance(
        self,
        topology: Topology,
        state_dir: Path,
        group: str | None = None,
        *,
        assignment: dict[str, list[int]] | None = None,
        generation: int = 0,
        **engine: Any,
    ) -> Instance:
        """A (not yet started) Instance with test defaults: shuffle_queues=4, 200 ms trigger.

        ``engine`` holds EngineSettings fields; ``assignment`` and ``generation`` are the
        instance's (a rebalance's), not settings.
        """
        settings = EngineSettings(
            state_dir=state_dir,
            **{
                "shuffle_queues": 4,
                "sink_queues": 4,
                "trigger_interval_ms": 200,
                "spark_conf": SPARK_CONF,
                **engine,
            },
        )
        return Instance(
            topology,
            group=group,
            rocketmq=self.client_settings,
            engine=settings,
            assignment=assignment,
            generation=generation,
        )

    def start(self, instance: Instance) -> Instance:
        """Start ``instance`` (creating the SparkSession on first use)."""
        self._running.append(instance)
        self._last = instance
        instance.start()
        return instance

    def stop(self, instance: Instance) -> None:
        """Gracefully stop ``instance`` (its queries only; the SparkSession stays)."""
        if instance in self._running:
            self._running.remove(instance)
        instance.stop()

    def stop_all(self) -> None:
        """Stop every instance still running."""
        while self._running:
            self.stop(self._running[-1])

    def close(self) -> None:
        """Stop everything and the SparkSession."""
        self.stop_all()
        if self._last is not None:
            self._last.close()
            self._last = None


@pytest.fixture(scope="session")
def engine_session(client_settings: RocketMQSettings) -> Iterator[EngineHarness]:
    """The session's harness; stops the one shared SparkSession at the end."""
    harness = EngineHarness(client_settings)
    yield harness
    harness.close()


@pytest.fixture
def engine(engine_session: EngineHarness) -> Iterator[EngineHarness]:
    """The shared harness; instances a test started are stopped when it ends."""
    yield engine_session
    engine_session.stop_all()


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> Any:
    """Print a figure to the terminal even when output is captured, tagged by test module."""
    tag = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")

    def emit(text: str) -> None:
        with capsys.disabled():
            print(f"\n[{tag}] {text}", flush=True)

    return emit
