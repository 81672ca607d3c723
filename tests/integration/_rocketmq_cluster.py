"""Fixtures: a real local RocketMQ cluster (name server with a controller, broker-a master +
slave, broker-b master).

In controller mode, as production RocketMQ 5 clusters run: a killed master's
in-sync slave is promoted by the controller.

Started once per session from empty stores (data under
.local/test-rocketmq-cluster), or reused if it already runs and serves; a
cluster this session started is stopped at its end, one it found serving is
left running. Ports default to the cluster's
own (29876, controller 29878; brokers 30911, 31911, 28911, each also using port
- 2 and port + 1) and can be moved with ``STREAM_ASSETS_TEST_CLUSTER_NAMESRV_PORT``,
``..._CONTROLLER_PORT``,
``..._BROKER_A_MASTER_PORT``, ``..._BROKER_A_SLAVE_PORT`` and
``..._BROKER_B_MASTER_PORT``.

Registered for tests/integration by an import in its conftest. A test that
kills or stops nodes takes ``cluster_restored``: every node runs again after it,
in the roles it started in (a promoted slave hands the master role back).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from stream_assets.broker.cluster import LocalCluster
from stream_assets.settings import ClusterSettings, local_dir

_ENV = "STREAM_ASSETS_TEST_CLUSTER_"


def _port(name: str, default: int) -> int:
    return int(os.environ.get(_ENV + name, str(default)))


def integration_cluster_settings() -> ClusterSettings:
    """Settings of the integration-test cluster."""
    return ClusterSettings(
        namesrv_port=_port("NAMESRV_PORT", 29876),
        controller=True,
        controller_port=_port("CONTROLLER_PORT", 29878),
        broker_a_master_port=_port("BROKER_A_MASTER_PORT", 30911),
        broker_a_slave_port=_port("BROKER_A_SLAVE_PORT", 31911),
        broker_b_master_port=_port("BROKER_B_MASTER_PORT", 28911),
        home=local_dir() / "test-rocketmq-cluster",
        auto_create_topics=False,
    )


@pytest.fixture(scope="session")
def rocketmq_cluster() -> Iterator[LocalCluster]:
    """The started integration-test cluster (every node registered)."""
    cluster = LocalCluster(integration_cluster_settings())
    was_serving = cluster.status().serving
    if not was_serving:
        cluster.stop()  # a node left running alone by an interrupted session
        cluster.wipe()  # every session starts from empty stores
    cluster.start()
    for group in cluster.groups:  # a controller keeps the roles of the last run
        cluster.hand_back_master(group)
    yield cluster
    if not was_serving:
        cluster.stop()


@pytest.fixture
def cluster_restored(rocketmq_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The session cluster; every node runs and is registered again after the test."""
    yield rocketmq_cluster
    if not rocketmq_cluster.status().serving:
        rocketmq_cluster.start()
    for group in rocketmq_cluster.groups:
        rocketmq_cluster.hand_back_master(group)
