"""Unit tests of the pydantic-settings configuration (environment only, no broker)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from stream_assets.rocketmq.admin import credentials_of
from stream_assets.settings import (
    DEFAULT_MAX_MESSAGE_SIZE,
    BrokerSettings,
    PathsSettings,
    RocketMQSettings,
    local_dir,
)


def test_defaults() -> None:
    s = RocketMQSettings()
    assert s.namesrv_addr == "127.0.0.1:9876"
    assert s.namesrv_addrs == ["127.0.0.1:9876"]
    assert s.access_key is None and s.secret_key is None
    assert s.request_timeout_s == 5.0
    assert s.max_message_size == DEFAULT_MAX_MESSAGE_SIZE == 4 * 1024 * 1024
    b = BrokerSettings()
    assert (b.host, b.namesrv_port, b.broker_port) == ("127.0.0.1", 9876, 10911)
    assert b.auto_create_topics is False


def test_env_prefix_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR", "10.0.0.5:19876")
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_REQUEST_TIMEOUT_S", "1.5")
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_SEND_RETRIES", "0")
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_PRODUCER_GROUP", "pg")
    s = RocketMQSettings()
    assert s.namesrv_addr == "10.0.0.5:19876"
    assert s.request_timeout_s == 1.5
    assert s.send_retries == 0
    assert s.producer_group == "pg"


def test_env_is_case_insensitive_and_unprefixed_names_are_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NAMESRV_ADDR", "9.9.9.9:1")
    monkeypatch.setenv("ROCKETMQ_NAMESRV_ADDR", "9.9.9.9:2")
    monkeypatch.setenv("STREAM_ASSETS_BROKER_NAMESRV_ADDR", "9.9.9.9:3")  # other class
    assert RocketMQSettings().namesrv_addr == "127.0.0.1:9876"
    monkeypatch.setenv("stream_assets_rocketmq_namesrv_addr", "9.9.9.9:4")
    assert RocketMQSettings().namesrv_addr == "9.9.9.9:4"


def test_broker_env_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAM_ASSETS_BROKER_BROKER_PORT", "20911")
    monkeypatch.setenv("STREAM_ASSETS_BROKER_NAMESRV_PORT", "19876")
    monkeypatch.setenv("STREAM_ASSETS_BROKER_AUTO_CREATE_TOPICS", "true")
    b = BrokerSettings()
    assert (b.broker_port, b.namesrv_port, b.auto_create_topics) == (20911, 19876, True)
    assert b.namesrv_addr == "127.0.0.1:19876"


def test_local_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STREAM_ASSETS_LOCAL_DIR", str(tmp_path))
    assert PathsSettings().local_dir == tmp_path
    assert local_dir() == tmp_path
    assert RocketMQSettings().resolved_client_log_dir() == tmp_path / "logs" / "rocketmq-client"
    assert BrokerSettings().resolved_home() == tmp_path / "rocketmq"
    explicit = RocketMQSettings(client_log_dir=tmp_path / "x")
    assert explicit.resolved_client_log_dir() == tmp_path / "x"


def test_several_name_servers() -> None:
    s = RocketMQSettings(namesrv_addr="10.0.0.1:9876; 10.0.0.2:9876;ns.example.com:9877")
    assert s.namesrv_addrs == ["10.0.0.1:9876", "10.0.0.2:9876", "ns.example.com:9877"]


@pytest.mark.parametrize(
    "bad",
    [
        "localhost",
        "127.0.0.1",
        "127.0.0.1:",
        ":9876",
        "host:port",
        "host:98x6",
        "10.0.0.1:9876;10.0.0.2",
        "",
    ],
)
def test_bad_namesrv_addr_is_a_value_error_naming_it(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        RocketMQSettings(namesrv_addr=bad)
    assert isinstance(info.value, ValidationError)
    assert repr(bad) in str(info.value)
    assert "host:port" in str(info.value)


def test_bad_namesrv_addr_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR", "broker.internal")
    with pytest.raises(ValueError, match=re.escape("'broker.internal'")):
        RocketMQSettings()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("request_timeout_s", 0),
        ("send_timeout_ms", 0),
        ("send_retries", -1),
        ("max_message_size", 0),
    ],
)
def test_numeric_bounds(field: str, value: int) -> None:
    with pytest.raises(ValidationError, match=field):
        RocketMQSettings(**{field: value})


@pytest.mark.parametrize("port", [10911, 20911, 3])
def test_broker_ports_derivation(port: int) -> None:
    ports = BrokerSettings(broker_port=port).broker_ports
    assert sorted(ports.values()) == [port - 2, port, port + 1]
    assert ports["broker"] == port
    assert ports["broker VIP channel (broker port - 2)"] == port - 2
    assert ports["broker HA (broker port + 1)"] == port + 1


@pytest.mark.parametrize("port", [0, 2, 65535, 70000])
def test_broker_port_range(port: int) -> None:
    with pytest.raises(ValidationError):
        BrokerSettings(broker_port=port)


def test_secrets_not_revealed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_ACCESS_KEY", "AK-from-env-1")
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_SECRET_KEY", "SK-from-env-2")
    s = RocketMQSettings()
    assert isinstance(s.secret_key, SecretStr)
    assert isinstance(s.access_key, SecretStr)
    assert s.secret_key.get_secret_value() == "SK-from-env-2"
    assert s.access_key.get_secret_value() == "AK-from-env-1"
    shown = [repr(s), str(s), s.model_dump_json(), repr(s.model_dump()), str(s.secret_key)]
    for text in shown:
        assert "SK-from-env-2" not in text
        assert "AK-from-env-1" not in text
    creds = credentials_of(s)
    assert creds is not None
    assert "SK-from-env-2" not in repr(creds)


def test_credentials_need_both_keys_or_neither() -> None:
    assert credentials_of(RocketMQSettings()) is None
    with pytest.raises(ValueError, match="SECRET_KEY"):
        credentials_of(RocketMQSettings(access_key=SecretStr("only-ak")))
    with pytest.raises(ValueError, match="ACCESS_KEY"):
        credentials_of(RocketMQSettings(secret_key=SecretStr("only-sk")))
