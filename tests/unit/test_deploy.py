"""The production-shaped deployment's pieces that need no server: env files, secrets,
services found by their pid files, and what each host is handed.

The deployment itself, every host real, is tests/integration/test_prod_like.py.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from stream_assets.broker.jvm import write_conf
from stream_assets.deploy.daemons import Daemon, DeployError, wait_for
from stream_assets.deploy.env_files import DEPLOY_DIR, SECRET_NAMES, host_env, load_secrets
from stream_assets.deploy.postgres import PostgresHost
from stream_assets.deploy.prod_like import ProdLike
from stream_assets.settings import DeploySettings


def test_a_placeholder_without_a_value_is_named(tmp_path: Path) -> None:
    path = tmp_path / "host.env"
    path.write_text("A=${HOST}:1\nB=${NOPE}\n")
    with pytest.raises(DeployError, match=r"B uses \$\{NOPE\}, which has no value"):
        host_env(path, {"HOST": "h"})


def test_secrets_are_generated_once_private_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "secrets.env"
    first = load_secrets(path)
    assert set(first) == set(SECRET_NAMES)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len({s.get_secret_value() for s in first.values()}) == len(SECRET_NAMES)
    again = load_secrets(path)
    assert {k: v.get_secret_value() for k, v in again.items()} == {
        k: v.get_secret_value() for k, v in first.items()
    }
    # A secret shows as '**********' wherever it is printed.
    assert first["DAGSTER_PG_PASSWORD"].get_secret_value() not in repr(first)


def test_a_service_is_found_by_its_pid_file_and_stopped_with_its_children(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    script = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
        f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(300)"
    )
    service = Daemon("svc", [sys.executable, "-c", script], tmp_path)
    pid = service.start(dict(os.environ))
    assert service.pid() == pid
    assert service.start(dict(os.environ)) == pid, "a running service is not started twice"
    wait_for(child.exists, 30, "the child's pid", service)
    wait_for(lambda: bool(child.read_text()), 30, "the child's pid", service)
    grandchild = int(child.read_text())
    assert service.stop(wait_s=10)
    assert service.pid() is None and not service.pid_file.exists()
    wait_for(lambda: not Path(f"/proc/{grandchild}").exists() or _zombie(grandchild), 10, "child")
    assert service.stop() is False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_recycled_pid_is_not_taken_for_the_service(tmp_path: Path) -> None:
    service = Daemon("svc", ["true"], tmp_path)
    # Our own pid, but with another start time: as after a reboot or a recycled pid.
    service.pid_file.write_text(f"{os.getpid()} 1")
    assert service.pid() is None
    assert service.stop() is False, "stop must never signal a process that is not the service"


def test_a_dead_service_fails_the_wait_with_its_log(tmp_path: Path) -> None:
    service = Daemon(
        "broken", [sys.executable, "-c", "print('bad config'); raise SystemExit(3)"], tmp_path
    )
    service.start(dict(os.environ))
    with pytest.raises(
        DeployError, match=r"(?s)broken exited; last lines of .*broken\.log:\nbad config"
    ):
        wait_for(lambda: False, 30, "never", service)


def test_the_dagster_host_gets_storage_engine_and_secrets_from_its_env_file(tmp_path: Path) -> None:
    d = ProdLike(DeploySettings(home=tmp_path, postgres_port=25499), progress=lambda _: None)
    env = d.dagster.env
    assert env["DAGSTER_PG_PORT"] == "25499"
    assert env["STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR"] == d.settings.namesrv_addr
    assert env["STREAM_ASSETS_ROCKETMQ_ACCESS_KEY"] == d.settings.app_user
    assert env["STREAM_ASSETS_ENGINE_SPARK_MASTER"] == d.settings.spark_master_url
    conf = json.loads(env["STREAM_ASSETS_ENGINE_SPARK_CONF"])
    assert conf["spark.cores.max"] == str(d.settings.instance_cores)
    # The app user's secret and the database password come from the secrets file; the
    # admin's and the brokers' own do not reach Dagster.
    assert env["DAGSTER_PG_PASSWORD"] == d.secrets["DAGSTER_PG_PASSWORD"].get_secret_value()
    admin_secret = d.secrets["ROCKETMQ_ADMIN_PASSWORD"].get_secret_value()
    assert admin_secret not in {v for k, v in env.items() if k not in os.environ}
    # dagster.yaml names variables, never values.
    storage = yaml.safe_load((DEPLOY_DIR / "dagster" / "dagster.yaml").read_text())["storage"]
    db = storage["postgres"]["postgres_db"]
    assert db["password"] == {"env": "DAGSTER_PG_PASSWORD"} and db["username"] == {
        "env": "DAGSTER_PG_USERNAME"
    }


def test_brokers_switch_acl_on_with_an_admin_and_inner_credentials(tmp_path: Path) -> None:
    d = ProdLike(DeploySettings(home=tmp_path), progress=lambda _: None)
    conf = d.rocketmq.settings.broker_conf
    assert conf["authenticationEnabled"] == "true" and conf["authorizationEnabled"] == "true"
    admin = json.loads(str(conf["initAuthenticationUser"]))
    assert admin["username"] == d.settings.admin_user
    inner = json.loads(str(conf["innerClientAuthenticationCredentials"]))
    assert inner["secretKey"] == d.secrets["ROCKETMQ_INNER_SECRET"].get_secret_value()


def test_broker_config_files_holding_credentials_are_private(tmp_path: Path) -> None:
    path = tmp_path / "broker.conf"
    path.write_text("old=1\n")
    path.chmod(0o644)
    d = ProdLike(DeploySettings(home=tmp_path / "d"), progress=lambda _: None)
    node = d.rocketmq.nodes[0]
    write_conf(path, d.rocketmq.broker_conf(node))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "initAuthenticationUser=" in path.read_text() and "old=1" not in path.read_text()


def test_postgres_keeps_its_data_where_its_user_can_reach_it(tmp_path: Path) -> None:
    """As root, PostgreSQL runs as ``postgres``, who cannot enter a mode-700 directory (a
    mktemp checkout, pytest's tmp_path): its data then lives in a directory of its own
    under the temp dir, the same for the same home; elsewhere it stays in the home."""
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    home = closed / "deploy" / "postgres"
    host = PostgresHost(home, 1)
    if os.geteuid() == 0:
        assert host.home.parent == Path(tempfile.gettempdir())
        assert host.home.name.startswith("stream-assets-postgres-")
        assert PostgresHost(home, 1).home == host.home
        assert PostgresHost(closed / "other", 1).home != host.home
    else:
        assert host.home == home.resolve()
