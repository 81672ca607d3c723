"""LocalCluster.wipe: every node's data goes, the resolved classpath stays, and a running
node refuses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream_assets.broker import cluster as cluster_module
from stream_assets.broker.cluster import LocalCluster
from stream_assets.broker.jvm import BrokerStartError
from stream_assets.settings import ClusterSettings


def _cluster(home: Path) -> LocalCluster:
    return LocalCluster(ClusterSettings(home=home), progress=lambda _m: None)


def test_wipe_deletes_every_nodes_data_and_keeps_the_classpath(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    names = ["namesrv", *(n.name for n in cluster.nodes)]
    for name in names:
        store = cluster.node_dir(name) / "store" / "commitlog"
        store.mkdir(parents=True)
        (store / "00000000000000000000").write_bytes(b"x" * 64)
    classpath = tmp_path / "classpath-5.3.3.txt"
    classpath.write_text("a.jar")
    cluster.wipe()
    assert not any(cluster.node_dir(name).exists() for name in names)
    assert classpath.read_text() == "a.jar"


def test_wipe_refuses_while_a_node_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _cluster(tmp_path)
    (cluster.node_dir("broker-a-master") / "store").mkdir(parents=True)
    monkeypatch.setattr(cluster_module.LocalCluster, "pids", lambda self: {"broker-a-master": 7})
    with pytest.raises(BrokerStartError, match="broker-a-master run: stop the cluster first"):
        cluster.wipe()
    assert (cluster.node_dir("broker-a-master") / "store").exists()
