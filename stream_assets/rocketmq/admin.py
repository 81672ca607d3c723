"""Control plane: topics, queues, offsets and consumer-group offsets.

Speaks the remoting protocol (:mod:`stream_assets.rocketmq.remoting`) because
the C++ client has no admin calls. These are what the engine and the scale job
use to create shuffle/state topics, find queues, and commit positions.

Example::

    >>> admin = RocketMQAdmin(RocketMQSettings())  # doctest: +SKIP
    >>> admin.create_topic("orders", queues=8)  # doctest: +SKIP
    >>> [q.queue_id for q in admin.queues("orders")]  # doctest: +SKIP
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, cast

from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    RemotingError,
    RocketMQError,
    TopicNotFoundError,
)
from stream_assets.rocketmq.remoting import (
    ConnectionPool,
    Credentials,
    RemotingCommand,
    RequestCode,
    ResponseCode,
    parse_fastjson,
)
from stream_assets.settings import RocketMQSettings

_TOPIC_NAME = re.compile(r"^[%|a-zA-Z0-9_-]{1,127}$")
_MASTER_ID = "0"
_PERM_READ_WRITE = 6
_ADDR_CACHE_S = 10.0


@dataclass(frozen=True, order=True)
class MessageQueue:
    """One queue of a topic on one broker."""

    topic: str
    broker_name: str
    queue_id: int


@dataclass(frozen=True)
class QueueOffsets:
    """The stored range of a queue: ``min_offset`` .. ``max_offset`` (exclusive)."""

    queue: MessageQueue
    min_offset: int
    max_offset: int


@dataclass(frozen=True)
class TopicRoute:
    """Where a topic's queues live: broker name -> (master address, read, write queues)."""

    topic: str
    brokers: dict[str, tuple[str, int, int]]

    @property
    def read_queues(self) -> list[MessageQueue]:
        """Every readable queue, ordered by broker name then queue id."""
        return [
            MessageQueue(self.topic, name, qid)
            for name in sorted(self.brokers)
            for qid in range(self.brokers[name][1])
        ]

    @property
    def write_queue_count(self) -> int:
        """How many queues a producer spreads over."""
        return sum(w for _, _, w in self.brokers.values())


def validate_topic_name(topic: str) -> str:
    """Return ``topic`` or raise a ValueError saying what RocketMQ accepts."""
    if not _TOPIC_NAME.match(topic):
        raise ValueError(
            f"invalid topic name {topic!r}: RocketMQ accepts 1-127 characters of "
            "letters, digits, '_', '-', '%' and '|'"
        )
    return topic


def credentials_of(settings: RocketMQSettings) -> Credentials | None:
    """ACL credentials from settings, or None when ACL is not configured."""
    if settings.access_key is None and settings.secret_key is None:
        return None
    if settings.access_key is None or settings.secret_key is None:
        raise ValueError(
            "set both STREAM_ASSETS_ROCKETMQ_ACCESS_KEY and STREAM_ASSETS_ROCKETMQ_SECRET_KEY, "
            "or neither"
        )
    return Credentials(settings.access_key, settings.secret_key)


class RocketMQAdmin:
    """Control-plane calls against a name server and its brokers."""

    def __init__(self, settings: RocketMQSettings | None = None) -> None:
        self.settings = settings or RocketMQSettings()
        self._pool = ConnectionPool(self.settings.request_timeout_s, credentials_of(self.settings))
        # Broker addresses rarely change; offset calls would otherwise ask the
        # name server once per call.
        self._addr_cache: dict[tuple[str, str], tuple[str, float]] = {}

    def close(self) -> None:
        """Close every connection."""
        self._pool.close()

    def new_pool(self) -> ConnectionPool:
        """A separate connection pool with this admin's timeout and credentials."""
        return ConnectionPool(self.settings.request_timeout_s, credentials_of(self.settings))

    def __enter__(self) -> RocketMQAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- name server -------------------------------------------------------

    def _namesrv_call(self, code: int, fields: dict[str, str]) -> RemotingCommand:
        errors: list[BrokerUnreachableError] = []
        for addr in self.settings.namesrv_addrs:
            try:
                return self._pool.get(addr, "name server").call(code, fields)
            except BrokerUnreachableError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise BrokerUnreachableError(
            "name servers", self.settings.namesrv_addr, "; ".join(str(e) for e in errors)
        )

    def route(self, topic: str) -> TopicRoute:
        """The topic's route; raises :class:`TopicNotFoundError` if it has none."""
        reply = self._namesrv_call(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
        if reply.code == ResponseCode.TOPIC_NOT_EXIST:
            raise TopicNotFoundError(topic, self.settings.namesrv_addr)
        _check(reply, f"route of topic {topic!r}")
        data = cast(dict[str, Any], parse_fastjson(reply.body))
        masters = {
            b["brokerName"]: b["brokerAddrs"][_MASTER_ID]
            for b in data.get("brokerDatas", [])
            if _MASTER_ID in b.get("brokerAddrs", {})
        }
        brokers = {
            q["brokerName"]: (
                masters[q["brokerName"]],
                int(q["readQueueNums"]),
                int(q["writeQueueNums"]),
            )
            for q in data.get("queueDatas", [])
            if q["brokerName"] in masters
        }
        return TopicRoute(topic, brokers)

    def topic_exists(self, topic: str) -> bool:
        """Whether the name server knows a route for ``topic``."""
        try:
            self.route(topic)
        except TopicNotFoundError:
            return False
        return True

    def master_brokers(self, cluster: str | None = None) -> dict[str, str]:
        """Broker name -> master address, for one cluster or all of them."""
        reply = self._namesrv_call(RequestCode.GET_BROKER_CLUSTER_INFO, {})
        _check(reply, "cluster info")
        data = cast(dict[str, Any], parse_fastjson(reply.body))
        names: set[str] | None = None
        if cluster is not None:
            clusters = data.get("clusterAddrTable", {})
            if cluster not in clusters:
                raise RocketMQError(f"no cluster {cluster!r}; known: {sorted(clusters)}")
            names = set(clusters[cluster])
        return {
            name: b["brokerAddrs"][_MASTER_ID]
            for name, b in data.get("brokerAddrTable", {}).items()
            if _MASTER_ID in b.get("brokerAddrs", {}) and (names is None or name in names)
        }

    # -- topics ------------------------------------------------------------

    def create_topic(
        self,
        topic: str,
        queues: int,
        cluster: str | None = None,
        wait_s: float = 30.0,
    ) -> TopicRoute:
        """Create or update ``topic`` with ``queues`` read and write queues on every master.

        Waits (bounded by ``wait_s``) until the name server's route shows the
        new queue count, so a producer or reader started next sees it.
        """
        validate_topic_name(topic)
        if queues <= 0:
            raise ValueError(f"topic {topic!r}: queue count must be positive, got {queues}")
        masters = self.master_brokers(cluster)
        if not masters:
            raise RocketMQError(f"no master broker is registered with {self.settings.namesrv_addr}")
        for name, addr in sorted(masters.items()):
            reply = self._pool.get(addr, f"broker {name}").call(
                RequestCode.UPDATE_AND_CREATE_TOPIC,
                {
                    "topic": topic,
                    "defaultTopic": "TBW102",
                    "readQueueNums": str(queues),
                    "writeQueueNums": str(queues),
                    "perm": str(_PERM_READ_WRITE),
                    "topicFilterType": "SINGLE_TAG",
                    "topicSysFlag": "0",
                    "order": "false",
                },
            )
            _check(reply, f"create topic {topic!r} on broker {name}")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                route = self.route(topic)
                if all(
                    route.brokers.get(name, ("", 0, 0))[1:] == (queues, queues) for name in masters
                ):
                    return route
            except TopicNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise RocketMQError(
                    f"topic {topic!r} was created on the brokers but the name server did not "
                    f"show {queues} queues within {wait_s:.0f}s"
                )
            time.sleep(0.1)

    def queues(self, topic: str) -> list[MessageQueue]:
        """The topic's readable queues."""
        return self.route(topic).read_queues

    # -- offsets -----------------------------------------------------------

    def _broker_call(
        self, queue: MessageQueue, code: int, fields: dict[str, str]
    ) -> RemotingCommand:
        addr = self.broker_addr(queue)
        try:
            return self._pool.get(addr, f"broker {queue.broker_name}").call(code, fields)
        except BrokerUnreachableError:
            self._addr_cache.pop((queue.topic, queue.broker_name), None)
            raise

    def broker_addr(self, queue: MessageQueue) -> str:
        """The master address serving ``queue`` (cached for a few seconds)."""
        cache_key = (queue.topic, queue.broker_name)
        cached = self._addr_cache.get(cache_key)
        if cached is not None and time.monotonic() - cached[1] < _ADDR_CACHE_S:
            return cached[0]
        route = self.route(queue.topic)
        if queue.broker_name not in route.brokers:
            raise RocketMQError(
                f"topic {queue.topic!r} has no queues on broker {queue.broker_name!r}"
            )
        addr = route.brokers[queue.broker_name][0]
        self._addr_cache[cache_key] = (addr, time.monotonic())
        return addr

    def _offset_call(self, queue: MessageQueue, code: int, extra: dict[str, str], what: str) -> int:
        fields = {"topic": queue.topic, "queueId": str(queue.queue_id), **extra}
        reply = self._broker_call(queue, code, fields)
        _check(reply, f"{what} of {queue.topic}[{queue.queue_id}]")
        return int(reply.ext_fields["offset"])

    def min_offset(self, queue: MessageQueue) -> int:
        """The first offset still stored in ``queue``."""
        return self._offset_call(queue, RequestCode.GET_MIN_OFFSET, {}, "min offset")

    def max_offset(self, queue: MessageQueue) -> int:
        """One past the last offset stored in ``queue`` (its message count so far)."""
        return self._offset_call(queue, RequestCode.GET_MAX_OFFSET, {}, "max offset")

    def queue_offsets(self, topic: str) -> list[QueueOffsets]:
        """Min and max offsets of every queue of ``topic``."""
        return [QueueOffsets(q, self.min_offset(q), self.max_offset(q)) for q in self.queues(topic)]

    def offset_for_timestamp(self, queue: MessageQueue, timestamp_ms: int) -> int:
        """The first offset of ``queue`` whose store timestamp is >= ``timestamp_ms``.

        Past the last message it is the max offset; before the first, the min.
        """
        return self._offset_call(
            queue,
            RequestCode.SEARCH_OFFSET_BY_TIMESTAMP,
            {"timestamp": str(timestamp_ms), "boundaryType": "LOWER"},
            "offset by timestamp",
        )

    # -- consumer group offsets -------------------------------------------

    def query_consumer_offset(self, group: str, queue: MessageQueue) -> int | None:
        """The committed offset of ``group`` on ``queue``, or None if it never committed."""
        fields = {
            "consumerGroup": group,
            "topic": queue.topic,
            "queueId": str(queue.queue_id),
            "setZeroIfNotFound": "false",
        }
        reply = self._broker_call(queue, RequestCode.QUERY_CONSUMER_OFFSET, fields)
        if reply.code == ResponseCode.QUERY_NOT_FOUND:
            return None
        _check(reply, f"consumer offset of {group!r} on {queue.topic}[{queue.queue_id}]")
        return int(reply.ext_fields["offset"])

    def create_consumer_group(self, group: str, queue: MessageQueue) -> None:
        """Create (or update) subscription group ``group`` on ``queue``'s broker."""
        addr = self.broker_addr(queue)
        reply = self._pool.get(addr, f"broker {queue.broker_name}").call(
            RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {}, body=_group_config(group)
        )
        _check(reply, f"create consumer group {group!r}")

    def commit_consumer_offset(self, group: str, queue: MessageQueue, offset: int) -> None:
        """Store ``offset`` as ``group``'s position on ``queue`` (acknowledged by the broker)."""
        if offset < 0:
            raise ValueError(f"consumer offset must be >= 0, got {offset}")
        fields = {
            "consumerGroup": group,
            "topic": queue.topic,
            "queueId": str(queue.queue_id),
            "commitOffset": str(offset),
        }
        reply = self._broker_call(queue, RequestCode.UPDATE_CONSUMER_OFFSET, fields)
        if reply.code == ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST:
            # 5.x registers a group only when it pulls; commit-before-pull needs it created.
            self.create_consumer_group(group, queue)
            reply = self._broker_call(queue, RequestCode.UPDATE_CONSUMER_OFFSET, fields)
        _check(reply, f"commit offset {offset} for {group!r} on {queue.topic}[{queue.queue_id}]")


def _group_config(group: str) -> bytes:
    return json.dumps(
        {
            "groupName": group,
            "consumeEnable": True,
            "consumeFromMinEnable": True,
            "consumeBroadcastEnable": False,
            "retryQueueNums": 1,
            "retryMaxTimes": 16,
            "brokerId": 0,
            "whichBrokerWhenConsumeSlowly": 1,
        }
    ).encode()


def _check(reply: RemotingCommand, what: str) -> None:
    if reply.code != ResponseCode.SUCCESS:
        raise RemotingError(what, reply.code, reply.remark)
