"""Every fixed port we listen on lies below the machine's ephemeral port range.

Outgoing connections (Spark, py4j, Dagster's gRPC, our own clients) take their
local ports from that range, so a broker given a fixed port inside it fails to
start now and then, for no reason of its own: CI once lost the ACL tests to a
client that happened to hold 39876.
"""

from __future__ import annotations

import socket

import pytest

from stream_assets.broker import jvm
from stream_assets.settings import BrokerSettings, ClusterSettings, DeploySettings
from tests import conftest
from tests.integration import _rocketmq_cluster, test_acl, test_prod_like


def _broker_ports(port: int) -> list[int]:
    # A RocketMQ broker also listens on port - 2 (VIP channel) and port + 1 (HA).
    return [port - 2, port, port + 1]


def _listening(settings: object) -> dict[str, int]:
    ports: dict[str, int] = {}
    for name, value in vars(settings).items():
        if not name.endswith("_port") or not isinstance(value, int) or value == 0:
            continue
        is_broker = name.startswith("broker")
        for i, port in enumerate(_broker_ports(value) if is_broker else [value]):
            ports[f"{type(settings).__name__}.{name}[{i}]"] = port
    return ports


def _every_fixed_port() -> dict[str, int]:
    ports: dict[str, int] = {}
    for settings in (
        BrokerSettings(),
        ClusterSettings(),
        DeploySettings(),
        DeploySettings(**test_prod_like.PORTS),
        _rocketmq_cluster.integration_cluster_settings(),
    ):
        ports |= {f"{k}@{len(ports)}": v for k, v in _listening(settings).items()}
    ports["test broker name server"] = conftest.TEST_NAMESRV_PORT
    for i, port in enumerate(_broker_ports(conftest.TEST_BROKER_PORT)):
        ports[f"test broker[{i}]"] = port
    ports["ACL name server"] = test_acl.NAMESRV_PORT
    for i, port in enumerate(_broker_ports(test_acl.BROKER_PORT)):
        ports[f"ACL broker[{i}]"] = port
    return ports


def test_fixed_ports_lie_below_the_ephemeral_range() -> None:
    ephemeral = jvm.ephemeral_ports()
    if ephemeral is None:
        # Linux's default, for a machine that does not say.
        ephemeral = range(32768, 61000)
    inside = {k: p for k, p in _every_fixed_port().items() if p in ephemeral}
    assert not inside, f"fixed ports inside {ephemeral.start}-{ephemeral.stop - 1}: {inside}"


def test_the_fixed_ports_of_one_setup_do_not_clash() -> None:
    # The three test brokers run at once in one session.
    test_ports = [
        conftest.TEST_NAMESRV_PORT,
        *_broker_ports(conftest.TEST_BROKER_PORT),
        test_acl.NAMESRV_PORT,
        *_broker_ports(test_acl.BROKER_PORT),
        *_listening(_rocketmq_cluster.integration_cluster_settings()).values(),
    ]
    assert len(test_ports) == len(set(test_ports))


def test_a_taken_ephemeral_port_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jvm, "ephemeral_ports", lambda: range(1024, 65536))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(jvm.BrokerStartError, match="ephemeral range 1024-65535") as err:
            jvm.check_port_free("127.0.0.1", port, "name server", "choose another")
    assert f"port {port} (name server)" in str(err.value)
