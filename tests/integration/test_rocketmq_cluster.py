"""The local RocketMQ cluster, for real: routes over two groups, a controller's failover, restarts.

Runs against ``rocketmq_cluster`` (name server 29876 with its controller on
29878; broker-a master 30911 and slave 31911; broker-b master 28911). Tests that
kill or stop nodes take ``cluster_restored``, which brings every node back
afterwards, in its first role.

Messages are sent and pulled over the remoting protocol to one node's address
on purpose: the test decides which node answers (a producer would pick a queue
through the route; the reader would go to the route's master).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, cast

import pytest

from stream_assets.broker.cluster import CLUSTER, LocalCluster
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.message_codec import decode_messages
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.rocketmq.remoting import (
    RemotingCommand,
    RemotingConnection,
    RequestCode,
    ResponseCode,
    parse_fastjson,
)
from tests.integration._util import wait_for

pytestmark = pytest.mark.integration

QUEUES = 4


def _topic() -> str:
    return f"it-cluster-{uuid.uuid4().hex[:10]}"


def _call(addr: str, code: int, fields: dict[str, str], body: bytes = b"") -> RemotingCommand:
    conn = RemotingConnection(addr, timeout_s=5.0)
    try:
        return conn.call(code, fields, body)
    finally:
        conn.close()


def _send(addr: str, broker: str, topic: str, queue_id: int, body: bytes) -> int:
    """Store ``body`` in ``topic[queue_id]`` of the broker at ``addr``; its queue offset."""
    reply = _call(
        addr,
        RequestCode.SEND_MESSAGE_V2,
        {
            "a": "it-cluster-producer",
            "b": topic,
            "c": "TBW102",
            "d": str(QUEUES),
            "e": str(queue_id),
            "f": "0",
            "g": str(int(time.time() * 1000)),
            "h": "0",
            "i": "",
            "j": "0",
            "k": "false",
            "m": "false",
            "n": broker,
        },
        body,
    )
    assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
    assert int(reply.ext_fields["queueId"]) == queue_id
    return int(reply.ext_fields["queueOffset"])


def _pull(addr: str, topic: str, queue_id: int, offset: int) -> RemotingCommand:
    """QueueReader's PULL_MESSAGE, sent to ``addr``."""
    return _call(
        addr,
        RequestCode.PULL_MESSAGE,
        {
            "consumerGroup": "it-cluster-reader",
            "topic": topic,
            "queueId": str(queue_id),
            "queueOffset": str(offset),
            "maxMsgNums": "32",
            "sysFlag": "4",
            "commitOffset": "0",
            "suspendTimeoutMillis": "0",
            "subscription": "*",
            "subVersion": "0",
            "expressionType": "TAG",
        },
    )


def _max_offset(addr: str, topic: str, queue_id: int) -> int:
    reply = _call(addr, RequestCode.GET_MAX_OFFSET, {"topic": topic, "queueId": str(queue_id)})
    return int(reply.ext_fields["offset"]) if reply.code == ResponseCode.SUCCESS else -1


def _raw_route(admin: RocketMQAdmin, topic: str) -> dict[str, Any]:
    """The name server's route of ``topic`` as it sends it (brokerDatas, queueDatas)."""
    conn = RemotingConnection(admin.settings.namesrv_addr, timeout_s=5.0)
    try:
        reply = conn.call(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
    finally:
        conn.close()
    assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
    return cast(dict[str, Any], parse_fastjson(reply.body))


def test_a_topic_has_queues_on_both_groups(rocketmq_cluster: LocalCluster) -> None:
    cluster = rocketmq_cluster
    topic = _topic()
    master, slave = cluster.addr("broker-a"), cluster.addr("broker-a", "slave")
    with RocketMQAdmin(cluster.client_settings()) as admin:
        brokers = admin.cluster_brokers(CLUSTER)
        # Under a controller the slave's id is the one the controller gave it (> 0).
        assert brokers["broker-b"] == {0: cluster.addr("broker-b")}
        assert brokers["broker-a"][0] == master
        assert sorted(brokers["broker-a"].values()) == sorted([master, slave])
        assert cluster.sync_state("broker-a") == {master, slave}
        route = admin.create_topic(topic, queues=QUEUES)
        for group in ("broker-a", "broker-b"):
            assert route.brokers[group][:3] == (cluster.addr(group), QUEUES, QUEUES)
        assert [(q.broker_name, q.queue_id) for q in route.read_queues] == [
            (group, qid) for group in ("broker-a", "broker-b") for qid in range(QUEUES)
        ]
        assert route.write_queue_count == 2 * QUEUES


def test_a_killed_master_is_replaced_by_its_in_sync_slave_which_takes_writes(
    cluster_restored: LocalCluster, report: Any
) -> None:
    cluster = cluster_restored
    master, slave = cluster.addr("broker-a"), cluster.addr("broker-a", "slave")
    topic = _topic()
    with RocketMQAdmin(cluster.client_settings()) as admin:
        admin.create_topic(topic, queues=QUEUES)  # on the slave too
    body = b"\x00\xffbefore-the-kill-" + uuid.uuid4().bytes
    # Acknowledged only once every in-sync replica has it (allAckInSyncStateSet).
    offset = _send(master, "broker-a", topic, 2, body)

    began = time.monotonic()
    killed = cluster.kill("broker-a", "master")
    assert killed == cluster.node("broker-a", "master")
    with RocketMQAdmin(cluster.client_settings()) as admin:
        wait_for(
            lambda: admin.cluster_brokers(CLUSTER).get("broker-a") == {0: slave},
            30.0,
            "the controller to promote broker-a's slave",
        )
        promoted_s = time.monotonic() - began
        route = _raw_route(admin, topic)
    report(f"SIGKILL of broker-a's master until its slave is the master: {promoted_s:.2f}s")
    assert cluster.node_in_role("broker-a") == cluster.node("broker-a", "slave")
    # Same group name and queues, the promoted node's address as brokerId 0.
    groups = {b["brokerName"]: b["brokerAddrs"] for b in route["brokerDatas"]}
    assert groups == {"broker-a": {"0": slave}, "broker-b": {"0": cluster.addr("broker-b")}}
    queues = {
        q["brokerName"]: (q["readQueueNums"], q["writeQueueNums"]) for q in route["queueDatas"]
    }
    assert queues == {"broker-a": (QUEUES, QUEUES), "broker-b": (QUEUES, QUEUES)}

    # It holds the acknowledged message, and takes the next one at the next offset.
    after = _send(slave, "broker-a", topic, 2, b"after the kill")
    assert after == offset + 1
    reply = _pull(slave, topic, 2, offset)
    assert reply.code == ResponseCode.SUCCESS, (reply.code, reply.remark)
    records = decode_messages(reply.body)
    assert [(r.queue_offset, r.body) for r in records] == [
        (offset, body),
        (after, b"after the kill"),
    ]
    assert _pull(slave, topic, 2, after + 1).code == ResponseCode.PULL_NOT_FOUND


def test_a_restarted_master_comes_back_as_the_slave_and_replicates(
    cluster_restored: LocalCluster,
) -> None:
    cluster = cluster_restored
    topic = _topic()
    with RocketMQAdmin(cluster.client_settings()) as admin:
        admin.create_topic(topic, queues=QUEUES)
    first = cluster.addr("broker-a")
    body = b"before the crash " + uuid.uuid4().bytes
    offset = _send(first, "broker-a", topic, 1, body)

    killed = cluster.kill("broker-a")
    assert not cluster.status().node("broker-a").serving
    cluster.start_nodes([killed])  # returns once it is registered and in sync

    assert cluster.status().serving
    promoted = cluster.addr("broker-a", "slave")
    with RocketMQAdmin(cluster.client_settings()) as admin:
        brokers = admin.cluster_brokers(CLUSTER)["broker-a"]
        assert brokers[0] == promoted and first in brokers.values()  # no failing back
        assert admin.route(topic).brokers["broker-a"][:3] == (promoted, 4, 4)
        reader = QueueReader(admin, group="it-cluster-reader")
        try:
            got: list[Record] = list(reader.read(MessageQueue(topic, "broker-a", 1), offset))
        finally:
            reader.close()
    assert [(r.queue_offset, r.body) for r in got] == [(offset, body)]
    # The restarted node replicates from the new master.
    after = _send(promoted, "broker-a", topic, 1, b"after the restart")
    wait_for(lambda: _max_offset(first, topic, 1) > after, 30.0, "the old master to replicate")


def test_a_stopped_group_leaves_the_cluster_and_comes_back(
    cluster_restored: LocalCluster,
) -> None:
    cluster = cluster_restored
    cluster.stop_group("broker-b")
    with RocketMQAdmin(cluster.client_settings()) as admin:
        assert "broker-b" not in admin.cluster_brokers(CLUSTER)
        assert admin.master_brokers(CLUSTER) == {"broker-a": cluster.addr("broker-a")}
    assert cluster.status().node("broker-b").pid is None

    cluster.start_group("broker-b")
    with RocketMQAdmin(cluster.client_settings()) as admin:
        assert admin.cluster_brokers(CLUSTER)["broker-b"] == {0: cluster.addr("broker-b")}
    assert cluster.status().serving
