"""Shared fixtures: the real RocketMQ broker for integration tests.

Integration tests run against a broker of their own (ports 19876/20911, data
under .local/test-rocketmq) so they never disturb a developer's broker. It is
started once per session, or reused if already running; a broker this session
started is stopped at its end, one it found running is left running.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from stream_assets.broker.local import LocalBroker
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.settings import BrokerSettings, RocketMQSettings, local_dir

TEST_NAMESRV_PORT = int(os.environ.get("STREAM_ASSETS_TEST_NAMESRV_PORT", "19876"))
TEST_BROKER_PORT = int(os.environ.get("STREAM_ASSETS_TEST_BROKER_PORT", "20911"))


def integration_broker_settings() -> BrokerSettings:
    """Settings of the integration-test broker."""
    return BrokerSettings(
        namesrv_port=TEST_NAMESRV_PORT,
        broker_port=TEST_BROKER_PORT,
        home=local_dir() / "test-rocketmq",
        auto_create_topics=False,
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``own_deployment`` run first, before any session fixture starts.

    Such a test brings up a whole deployment of its own (11 JVMs and their
    services); beside the session's idle broker, cluster and SparkSession, which
    stay up until the session ends, it took twice as long on 2 cores (797 s
    against 384 s alone).
    """
    first = [item for item in items if item.get_closest_marker("own_deployment")]
    if first:
        items[:] = first + [item for item in items if item not in first]


@pytest.fixture(scope="session")
def broker() -> Iterator[LocalBroker]:
    """The started integration-test broker."""
    local = LocalBroker(integration_broker_settings())
    was_running = local.status().serving
    local.start()
    yield local
    if not was_running:
        local.stop()


@pytest.fixture
def restartable(broker: LocalBroker) -> Iterator[LocalBroker]:
    """The session broker; serving again after the test even if the test failed mid-restart."""
    yield broker
    if not broker.status().serving:
        broker.start()


@pytest.fixture(scope="session")
def client_settings(broker: LocalBroker) -> RocketMQSettings:
    """Client settings pointing at the test broker."""
    return broker.client_settings()


@pytest.fixture
def admin(client_settings: RocketMQSettings) -> Iterator[RocketMQAdmin]:
    """A control-plane client for the test broker."""
    with RocketMQAdmin(client_settings) as a:
        yield a
