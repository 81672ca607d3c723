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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    CredentialsRefusedError,
    RemotingError,
    RocketMQError,
    TopicNotFoundError,
)
from stream_assets.rocketmq.remoting import (
    ConnectionPool,
    Credentials,
    RemotingCommand,
    RemotingConnection,
    RequestCode,
    ResponseCode,
    parse_fastjson,
    parse_fastjson_keyed,
)
from stream_assets.settings import RocketMQSettings

_TOPIC_NAME = re.compile(r"^[%|a-zA-Z0-9_-]{1,127}$")
_MASTER_ID = "0"
_PERM_READ_WRITE = 6
_ADDR_CACHE_S = 10.0
#: How many failed queues a commit error lists by name.
_NAMED_FAILURES = 5

#: One pipelined request: (request code, ext fields, body).
_Request = tuple[int, dict[str, str], bytes]


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


class BrokerRoute(NamedTuple):
    """One broker group's part of a topic's route."""

    #: The master's address; "" while the group has no master (its slave serves reads).
    master: str
    read_queues: int
    write_queues: int
    #: A slave's address ("" if none): where reads go while the master is down.
    replica: str = ""

    @property
    def read_addr(self) -> str:
        """Where reads go: the master, else a slave (as RocketMQ's own clients do)."""
        return self.master or self.replica


@dataclass(frozen=True)
class TopicRoute:
    """Where a topic's queues live: broker group name -> :class:`BrokerRoute`.

    A group whose master is down but whose slave is registered stays in the
    route (``master == ""``): its queues are still readable, and dropping it
    would renumber every queue after it.
    """

    topic: str
    brokers: dict[str, BrokerRoute]

    @property
    def read_queues(self) -> list[MessageQueue]:
        """Every readable queue, ordered by broker name then queue id."""
        return [
            MessageQueue(self.topic, name, qid)
            for name in sorted(self.brokers)
            for qid in range(self.brokers[name].read_queues)
        ]

    @property
    def write_queue_count(self) -> int:
        """How many queues a producer spreads over."""
        return sum(b.write_queues for b in self.brokers.values())


def spread_queues(total: int, brokers: Iterable[str]) -> dict[str, int]:
    """How ``total`` queues are laid out over broker groups: evenly, the first
    groups by name taking one more when it does not divide; a group gets none
    when there are more groups than queues.

    >>> spread_queues(8, ["broker-b", "broker-a"])
    {'broker-a': 4, 'broker-b': 4}
    >>> spread_queues(5, ["broker-a", "broker-b"]), spread_queues(1, ["a", "b"])
    ({'broker-a': 3, 'broker-b': 2}, {'a': 1})
    """
    names = sorted(brokers)
    if not names:
        raise ValueError("no broker group to lay queues out on")
    share, extra = divmod(total, len(names))
    counts = {name: share + (1 if i < extra else 0) for i, name in enumerate(names)}
    return {name: count for name, count in counts.items() if count > 0}


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

    def __init__(self, settings: RocketMQSettings) -> None:
        self.settings = settings
        self._pool = ConnectionPool(self.settings.request_timeout_s, credentials_of(self.settings))
        # Broker addresses rarely change; offset calls would otherwise ask the
        # name server once per call.
        self._addr_cache: dict[tuple[str, str], tuple[BrokerRoute, float]] = {}

    def close(self) -> None:
        """Close every connection."""
        self._pool.close()

    def _check(self, reply: RemotingCommand, what: str) -> None:
        key = self.settings.access_key
        _check(reply, what, key.get_secret_value() if key is not None else None)

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
        self._check(reply, f"route of topic {topic!r}")
        data = cast(dict[str, Any], parse_fastjson(reply.body))
        groups = {b["brokerName"]: _group_addrs(b) for b in data.get("brokerDatas", [])}
        brokers = {
            q["brokerName"]: BrokerRoute(
                groups[q["brokerName"]][0],
                int(q["readQueueNums"]),
                int(q["writeQueueNums"]),
                groups[q["brokerName"]][1],
            )
            for q in data.get("queueDatas", [])
            if any(groups.get(q["brokerName"], ("", "")))
        }
        return TopicRoute(topic, brokers)

    def get_kv(self, namespace: str, key: str) -> str | None:
        """A value stored on the name server (its KV config, kept on its disk), or None.

        With several name servers, the first that holds it answers.
        """
        errors: list[BrokerUnreachableError] = []
        for addr in self.settings.namesrv_addrs:
            try:
                reply = self._pool.get(addr, "name server").call(
                    RequestCode.GET_KV_CONFIG, {"namespace": namespace, "key": key}
                )
            except BrokerUnreachableError as exc:
                errors.append(exc)
                continue
            if reply.code == ResponseCode.QUERY_NOT_FOUND:
                continue
            self._check(reply, f"name server KV {namespace}/{key}")
            return reply.ext_fields.get("value")
        if errors and len(errors) == len(self.settings.namesrv_addrs):
            raise errors[0]
        return None

    def put_kv(self, namespace: str, key: str, value: str) -> None:
        """Store ``value`` on every name server (each keeps its own copy on disk)."""
        for addr in self.settings.namesrv_addrs:
            reply = self._pool.get(addr, "name server").call(
                RequestCode.PUT_KV_CONFIG, {"namespace": namespace, "key": key, "value": value}
            )
            self._check(reply, f"store name server KV {namespace}/{key} on {addr}")

    def delete_kv(self, namespace: str, key: str) -> None:
        """Remove a value from every name server (absent already: nothing to do)."""
        for addr in self.settings.namesrv_addrs:
            reply = self._pool.get(addr, "name server").call(
                RequestCode.DELETE_KV_CONFIG, {"namespace": namespace, "key": key}
            )
            self._check(reply, f"delete name server KV {namespace}/{key} on {addr}")

    def topic_names(self) -> set[str]:
        """Every topic the name server knows (system topics included)."""
        reply = self._namesrv_call(RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER, {})
        self._check(reply, "topic list")
        data = cast(dict[str, Any], parse_fastjson(reply.body))
        return {str(t) for t in data.get("topicList", [])}

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
        self._check(reply, "cluster info")
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

    def cluster_brokers(self, cluster: str | None = None) -> dict[str, dict[int, str]]:
        """Broker name -> {broker id: address} of every registered node, slaves included
        (id 0 is the master), for one cluster or all of them.

        Example::

            >>> admin.cluster_brokers("DefaultCluster")  # doctest: +SKIP
            {'broker-a': {0: '127.0.0.1:30911', 1: '127.0.0.1:31911'}, 'broker-b': {0: ...}}
        """
        reply = self._namesrv_call(RequestCode.GET_BROKER_CLUSTER_INFO, {})
        self._check(reply, "cluster info")
        data = cast(dict[str, Any], parse_fastjson(reply.body))
        clusters = data.get("clusterAddrTable") or {}
        if cluster is not None and cluster not in clusters:
            raise RocketMQError(f"no cluster {cluster!r}; known: {sorted(clusters)}")
        names = None if cluster is None else set(clusters[cluster])
        return {
            name: {int(i): str(addr) for i, addr in (b.get("brokerAddrs") or {}).items()}
            for name, b in (data.get("brokerAddrTable") or {}).items()
            if names is None or name in names
        }

    def broker_config(self, broker_name: str) -> dict[str, str]:
        """The running configuration of ``broker_name``'s master (every setting, as text).

        >>> admin.broker_config("broker-a")["transactionCheckMax"]  # doctest: +SKIP
        '720'
        """
        reply = self._master(broker_name).call(RequestCode.GET_BROKER_CONFIG, {})
        self._check(reply, f"configuration of {broker_name}")
        lines = reply.body.decode().splitlines()
        return {k.strip(): v.strip() for k, _, v in (x.partition("=") for x in lines) if _}

    def update_broker_config(self, broker_name: str, values: Mapping[str, str]) -> None:
        """Change settings of ``broker_name``'s master while it runs (those the broker
        reads at run time take effect at once; it also writes them to its config file)."""
        body = "".join(f"{k}={v}\n" for k, v in values.items()).encode()
        reply = self._master(broker_name).call(RequestCode.UPDATE_BROKER_CONFIG, {}, body)
        self._check(reply, f"update the configuration of {broker_name} ({', '.join(values)})")

    def _master(self, broker_name: str) -> RemotingConnection:
        master = self.cluster_brokers().get(broker_name, {}).get(0)
        if master is None:
            raise BrokerUnreachableError(
                f"broker group {broker_name}", self.settings.namesrv_addr, "it has no master now"
            )
        return self._pool.get(master, f"broker {broker_name}")

    # -- topics ------------------------------------------------------------

    def create_topic(
        self,
        topic: str,
        queues: int,
        cluster: str | None = None,
        wait_s: float = 30.0,
        spread: bool = False,
    ) -> TopicRoute:
        """Create or update ``topic`` with ``queues`` read and write queues on every master
        (and on its slaves, which can serve reads of it at once).

        With ``spread``, ``queues`` is the topic's total instead, laid out by
        :func:`spread_queues` over the masters (how the engine creates its own
        topics, so a shuffle topic has exactly the configured count however
        many broker groups there are). Waits (bounded by ``wait_s``) until the
        name server's route shows the new queue counts, so a producer or
        reader started next sees them.
        """
        validate_topic_name(topic)
        if queues <= 0:
            raise ValueError(f"topic {topic!r}: queue count must be positive, got {queues}")
        nodes = self.cluster_brokers(cluster)
        masters = {name: ids[0] for name, ids in nodes.items() if 0 in ids}
        if not masters:
            raise RocketMQError(f"no master broker is registered with {self.settings.namesrv_addr}")
        counts = spread_queues(queues, masters) if spread else dict.fromkeys(masters, queues)
        for name, count in counts.items():
            # Slaves too: a slave copies its master's topic configs only every 60 s,
            # and until then refuses reads of the topic (TOPIC_NOT_EXIST) -- the
            # very reads it is there for while its master is down.
            for broker_id, addr in sorted(nodes[name].items()):
                reply = self._pool.get(addr, f"broker {name}").call(
                    RequestCode.UPDATE_AND_CREATE_TOPIC,
                    {
                        "topic": topic,
                        "defaultTopic": "TBW102",
                        "readQueueNums": str(count),
                        "writeQueueNums": str(count),
                        "perm": str(_PERM_READ_WRITE),
                        "topicFilterType": "SINGLE_TAG",
                        "topicSysFlag": "0",
                        "order": "false",
                    },
                )
                self._check(reply, f"create topic {topic!r} on broker {name} (id {broker_id})")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                route = self.route(topic)
                if all(
                    (b := route.brokers.get(name)) is not None
                    and (b.read_queues, b.write_queues) == (count, count)
                    for name, count in counts.items()
                ):
                    return route
            except TopicNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise RocketMQError(
                    f"topic {topic!r} was created on the brokers but the name server did not "
                    f"show its queues ({counts}) within {wait_s:.0f}s"
                )
            time.sleep(0.1)

    def delete_topic(self, topic: str, cluster: str | None = None) -> None:
        """Delete ``topic`` from every broker (slaves too) and every name server.

        Its consume queues and config go at once; its messages stay in the
        commit log until the broker's own retention removes them. A topic
        that does not exist is no error. The engine never deletes a topic; this
        is for what a check or a benchmark made for itself (each run a new
        topic, so left alone they pile up: loading hundreds of them made a
        local broker's start take over 90 s).

        Example::

            >>> admin.delete_topic("scratch-1")  # doctest: +SKIP
            >>> admin.topic_exists("scratch-1")  # doctest: +SKIP
            False
        """
        validate_topic_name(topic)
        self._on_every_node(
            cluster, RequestCode.DELETE_TOPIC_IN_BROKER, {"topic": topic}, f"delete topic {topic!r}"
        )
        for addr in self.settings.namesrv_addrs:
            reply = self._pool.get(addr, "name server").call(
                RequestCode.DELETE_TOPIC_IN_NAMESRV, {"topic": topic}
            )
            self._check(reply, f"delete topic {topic!r} on name server {addr}")

    def group_names(self, cluster: str | None = None) -> set[str]:
        """Every consumer group some master broker knows (system groups included)."""
        names: set[str] = set()
        for name, addr in self.master_brokers(cluster).items():
            reply = self._pool.get(addr, f"broker {name}").call(
                RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG, {}
            )
            self._check(reply, f"consumer groups of broker {name}")
            data = cast(dict[str, Any], parse_fastjson(reply.body))
            names.update(str(g) for g in data.get("subscriptionGroupTable") or {})
        return names

    def delete_group(self, group: str, cluster: str | None = None) -> None:
        """Delete consumer group ``group`` and its committed offsets from every broker.

        A group that does not exist is no error; as with :meth:`delete_topic`,
        for what a check or a benchmark made for itself.
        """
        self._on_every_node(
            cluster,
            RequestCode.DELETE_SUBSCRIPTIONGROUP,
            {"groupName": group, "cleanOffset": "true"},
            f"delete group {group!r}",
        )

    def _on_every_node(
        self, cluster: str | None, code: int, fields: dict[str, str], what: str
    ) -> None:
        """Send one request to every broker node, slaves included, checking each reply."""
        for name, ids in self.cluster_brokers(cluster).items():
            for broker_id, addr in sorted(ids.items()):
                reply = self._pool.get(addr, f"broker {name}").call(code, fields)
                self._check(reply, f"{what} on broker {name} (id {broker_id})")

    def queues(self, topic: str) -> list[MessageQueue]:
        """The topic's readable queues."""
        return self.route(topic).read_queues

    # -- offsets -----------------------------------------------------------

    def _broker_call(
        self, queue: MessageQueue, code: int, fields: dict[str, str], read: bool = False
    ) -> RemotingCommand:
        addr = self.read_addr(queue) if read else self.broker_addr(queue)
        try:
            return self._pool.get(addr, f"broker {queue.broker_name}").call(code, fields)
        except BrokerUnreachableError:
            self.forget_route(queue)
            raise

    def _group_route(self, queue: MessageQueue) -> BrokerRoute:
        """``queue``'s broker group in its topic's route (cached for a few seconds).

        A group missing from the route is unreachable (down, or not registered
        with the name server yet), never "no such queue": the caller rides it out.
        """
        cache_key = (queue.topic, queue.broker_name)
        cached = self._addr_cache.get(cache_key)
        if cached is not None and time.monotonic() - cached[1] < _ADDR_CACHE_S:
            return cached[0]
        route = self.route(queue.topic)
        group = route.brokers.get(queue.broker_name)
        if group is None:
            raise BrokerUnreachableError(
                f"broker group {queue.broker_name}",
                self.settings.namesrv_addr,
                f"the name server's route of topic {queue.topic!r} has no queues on it "
                f"(it serves {', '.join(sorted(route.brokers)) or 'no group'}): neither its "
                "master nor its slave is registered",
            )
        self._addr_cache[cache_key] = (group, time.monotonic())
        return group

    def forget_route(self, queue: MessageQueue) -> None:
        """Drop the cached addresses of ``queue``'s group, for every topic: the next call
        asks the name server (after a failure: a killed master is dropped from the route
        at once, and its slave serves the reads, or is promoted under a controller).
        Every topic's, because the group's addresses are the same in all of them: one
        failed call spares the others a timeout each on the dead address."""
        for key in [k for k in self._addr_cache if k[1] == queue.broker_name]:
            self._addr_cache.pop(key, None)

    def broker_addr(self, queue: MessageQueue) -> str:
        """The master address serving ``queue``: where writes and commits go.

        Raises :class:`BrokerUnreachableError` while the group has no master.
        """
        group = self._group_route(queue)
        if not group.master:
            self.forget_route(queue)
            raise BrokerUnreachableError(
                f"broker group {queue.broker_name}",
                group.replica,
                "its master is down (its slave serves reads only); writes wait for the master",
            )
        return group.master

    def read_addr(self, queue: MessageQueue) -> str:
        """Where reads of ``queue`` go: its master, else its slave."""
        return self._group_route(queue).read_addr

    def _offset_call(self, queue: MessageQueue, code: int, extra: dict[str, str], what: str) -> int:
        fields = {"topic": queue.topic, "queueId": str(queue.queue_id), **extra}
        reply = self._broker_call(queue, code, fields, read=True)
        self._check(reply, f"{what} of {queue.topic}[{queue.queue_id}] on {queue.broker_name}")
        return int(reply.ext_fields["offset"])

    def min_offset(self, queue: MessageQueue) -> int:
        """The first offset still stored in ``queue``."""
        return self._offset_call(queue, RequestCode.GET_MIN_OFFSET, {}, "min offset")

    def max_offset(self, queue: MessageQueue) -> int:
        """One past the last offset stored in ``queue`` (its message count so far)."""
        return self._offset_call(queue, RequestCode.GET_MAX_OFFSET, {}, "max offset")

    def queue_offsets(self, topic: str) -> list[QueueOffsets]:
        """Min and max offsets of every queue of ``topic``, in queue order."""
        return list(self.topic_offsets(topic).values())

    def topic_offsets(
        self, topic: str, queues: Iterable[MessageQueue] | None = None
    ) -> dict[MessageQueue, QueueOffsets]:
        """Min and max offsets of ``queues`` (default: every readable queue of ``topic``).

        One request per broker (GET_TOPIC_STATS_INFO) instead of two per queue;
        the broker reads the same store offsets as for :meth:`min_offset` and
        :meth:`max_offset` (a negative one, of a queue it has no file for, as
        0). Keys are in the order of ``queues``; with ``queues`` given the name
        server is not asked for the route (broker addresses are cached).

        Example::

            >>> offsets = admin.topic_offsets("orders")  # doctest: +SKIP
            >>> {q.queue_id: o.max_offset for q, o in offsets.items()}  # doctest: +SKIP
            {0: 120, 1: 98, 2: 0, 3: 7}
        """
        wanted = self._queues_of(topic, queues)
        found: dict[MessageQueue, QueueOffsets] = {}
        for addr, on_broker in self._by_broker(wanted, read=True):
            broker = on_broker[0].broker_name
            reply = self._broker_call(
                on_broker[0], RequestCode.GET_TOPIC_STATS_INFO, {"topic": topic}, read=True
            )
            self._check(reply, f"offsets of topic {topic!r} on broker {broker}")
            table = _offset_table(reply.body, topic)
            for queue in on_broker:
                entry = table.get(queue.queue_id)
                if entry is None:
                    raise RocketMQError(
                        f"broker {broker} at {addr} reported no offsets for "
                        f"{topic}[{queue.queue_id}]: it holds {len(table)} queues of the topic. "
                        "Was the topic's queue count changed while this ran?"
                    )
                found[queue] = QueueOffsets(queue, int(entry["minOffset"]), int(entry["maxOffset"]))
        return {q: found[q] for q in wanted}

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
        return self.group_offsets(group, queue.topic, [queue])[queue]

    def group_offsets(
        self,
        group: str,
        topic: str,
        queues: Iterable[MessageQueue] | None = None,
        *,
        from_master: bool = False,
    ) -> dict[MessageQueue, int | None]:
        """``group``'s committed offset on each of ``queues`` (default: every readable
        queue of ``topic``); None for a queue it never committed.

        Asked of each group's master, or of its slave while the master is down;
        ``from_master``: of the master only (raises while a group has none), for
        an answer that is the group's truth, not a copy up to a sync interval old.

        One round trip per broker: a QUERY_CONSUMER_OFFSET per queue, pipelined.
        Not GET_CONSUME_STATS, although it answers for a whole topic in one
        request: it reports a queue the group never committed as offset 0
        (and an unknown group as all zeros, with success), so "never committed"
        could not be told from "committed 0" -- which differ once the queue's
        min offset is past 0. Keys are in the order of ``queues``.

        Example::

            >>> committed = admin.group_offsets("wordcount", "orders")  # doctest: +SKIP
            >>> {q.queue_id: o for q, o in committed.items()}  # doctest: +SKIP
            {0: 120, 1: 97, 2: None, 3: 7}
        """
        wanted = self._queues_of(topic, queues)
        found: dict[MessageQueue, int | None] = {}
        # Read from the slave while the master is down: its copy of the offsets
        # may be a sync interval old, which replays a little (de-duplicated).
        for addr, on_broker in self._by_broker(wanted, read=not from_master):
            requests: list[_Request] = [
                (
                    RequestCode.QUERY_CONSUMER_OFFSET,
                    {
                        "consumerGroup": group,
                        "topic": q.topic,
                        "queueId": str(q.queue_id),
                        # Else the broker may answer 0 for a queue nobody committed.
                        "setZeroIfNotFound": "false",
                    },
                    b"",
                )
                for q in on_broker
            ]
            replies = self._broker_call_many(addr, on_broker, requests)
            for queue, reply in zip(on_broker, replies, strict=True):
                if reply.code == ResponseCode.QUERY_NOT_FOUND:
                    found[queue] = None
                    continue
                self._check(
                    reply, f"consumer offset of {group!r} on {queue.topic}[{queue.queue_id}]"
                )
                found[queue] = int(reply.ext_fields["offset"])
        return {q: found[q] for q in wanted}

    def create_consumer_group(self, group: str, queue: MessageQueue) -> None:
        """Create (or update) subscription group ``group`` on ``queue``'s broker."""
        addr = self.broker_addr(queue)
        reply = self._pool.get(addr, f"broker {queue.broker_name}").call(
            RequestCode.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, {}, body=_group_config(group)
        )
        self._check(reply, f"create consumer group {group!r}")

    def commit_consumer_offset(self, group: str, queue: MessageQueue, offset: int) -> None:
        """Store ``offset`` as ``group``'s position on ``queue`` (acknowledged by the broker)."""
        self.commit_consumer_offsets(group, {queue: offset})

    def commit_consumer_offsets(self, group: str, offsets: Mapping[MessageQueue, int]) -> None:
        """Store each queue's offset as ``group``'s position there, acknowledged by the broker.

        Pipelined: per broker, one round trip for the first queue of each topic,
        one for all the others. The broker creates a group's offset map for a
        topic without a lock, so commits racing into a map not yet there can
        overwrite each other, each acknowledged: sent all at once, the first
        commits of 10 groups in 100 lost an offset (8 queues, RocketMQ 5.3.3).
        Once the map exists, concurrent commits are safe.

        If the broker does not know ``group`` yet (RocketMQ 5 registers a group
        only when it pulls), it is created and the commits repeated. Raises if
        any commit failed, naming the queues and offsets; others may have been
        stored, and repeating the whole call is safe.

        Example::

            >>> admin.commit_consumer_offsets("wordcount", {q0: 120, q1: 97})  # doctest: +SKIP
        """
        for queue, offset in offsets.items():
            if offset < 0:
                raise ValueError(
                    f"consumer offset must be >= 0, got {offset} for "
                    f"{queue.topic}[{queue.queue_id}]"
                )
        for addr, on_broker in self._by_broker(offsets):
            firsts: dict[str, MessageQueue] = {}
            for queue in on_broker:
                firsts.setdefault(queue.topic, queue)
            others = [q for q in on_broker if firsts[q.topic] != q]
            for queues in (list(firsts.values()), others):
                if queues:
                    self._commit_pipelined(addr, group, {q: offsets[q] for q in queues})

    def _commit_pipelined(self, addr: str, group: str, offsets: dict[MessageQueue, int]) -> None:
        """All of ``offsets`` (queues of the broker at ``addr``) in one round trip."""
        queues = list(offsets)
        requests: list[_Request] = [
            (
                RequestCode.UPDATE_CONSUMER_OFFSET,
                {
                    "consumerGroup": group,
                    "topic": q.topic,
                    "queueId": str(q.queue_id),
                    "commitOffset": str(offsets[q]),
                },
                b"",
            )
            for q in queues
        ]
        replies = self._broker_call_many(addr, queues, requests)
        refused = [
            i for i, r in enumerate(replies) if r.code == ResponseCode.SUBSCRIPTION_GROUP_NOT_EXIST
        ]
        if refused:
            # 5.x registers a group only when it pulls; commit-before-pull needs it created.
            self.create_consumer_group(group, queues[refused[0]])
            again = self._broker_call_many(
                addr, [queues[i] for i in refused], [requests[i] for i in refused]
            )
            for i, reply in zip(refused, again, strict=True):
                replies[i] = reply
        failed = [
            (q, r) for q, r in zip(queues, replies, strict=True) if r.code != ResponseCode.SUCCESS
        ]
        if failed:
            named = ", ".join(
                f"{q.topic}[{q.queue_id}] at {offsets[q]}" for q, _ in failed[:_NAMED_FAILURES]
            )
            more = (
                f" and {len(failed) - _NAMED_FAILURES} more"
                if len(failed) > _NAMED_FAILURES
                else ""
            )
            first = failed[0][1]
            raise RemotingError(
                f"commit offset for {group!r} on {named}{more}", first.code, first.remark
            )

    # -- batching ----------------------------------------------------------

    def _queues_of(self, topic: str, queues: Iterable[MessageQueue] | None) -> list[MessageQueue]:
        """``queues`` without repeats (checked to be ``topic``'s), or all of the topic's."""
        if queues is None:
            return self.queues(topic)
        wanted = list(dict.fromkeys(queues))
        strangers = [q for q in wanted if q.topic != topic]
        if strangers:
            raise ValueError(f"queues {strangers} are not queues of topic {topic!r}")
        return wanted

    def _by_broker(
        self, queues: Iterable[MessageQueue], read: bool = False
    ) -> list[tuple[str, list[MessageQueue]]]:
        """``queues`` grouped by broker, with the address serving each (the master;
        for ``read``, the master or else a slave); order kept."""
        where = self.read_addr if read else self.broker_addr
        grouped: dict[tuple[str, str], list[MessageQueue]] = {}
        for queue in queues:
            grouped.setdefault((queue.broker_name, where(queue)), []).append(queue)
        return [(addr, on_broker) for (_, addr), on_broker in grouped.items()]

    def _broker_call_many(
        self, addr: str, queues: list[MessageQueue], requests: list[_Request]
    ) -> list[RemotingCommand]:
        """``requests`` to the broker at ``addr`` (serving ``queues``) in one round trip.

        Every caller sends requests that are safe to repeat (reads, offset
        stores), so a failure is retried once on a fresh connection, as
        :meth:`RemotingConnection.call` does: the broker closes channels idle
        for two minutes, and the pooled socket may be one. A timeout is not
        retried: that would double the bound on a broker that does not answer.
        """
        conn = self._pool.get(addr, f"broker {queues[0].broker_name}")
        try:
            try:
                return conn.call_many(requests)
            except BrokerUnreachableError as exc:
                if isinstance(exc.__cause__, TimeoutError):
                    raise
                return conn.call_many(requests)
        except BrokerUnreachableError:
            for queue in queues:
                self.forget_route(queue)
            raise


def _group_addrs(broker_data: dict[str, Any]) -> tuple[str, str]:
    """(master address or "", first slave's address or "") of a route's BrokerData."""
    addrs = {int(k): str(v) for k, v in (broker_data.get("brokerAddrs") or {}).items()}
    slaves = sorted(k for k in addrs if k != int(_MASTER_ID))
    return addrs.get(int(_MASTER_ID), ""), addrs[slaves[0]] if slaves else ""


def _offset_table(body: bytes, topic: str) -> dict[int, dict[str, Any]]:
    """Queue id -> entry of the ``offsetTable`` of a TopicStatsTable body, for ``topic``.

    The table is a fastjson map keyed by MessageQueue objects (see
    :func:`~stream_assets.rocketmq.remoting.parse_fastjson_keyed`).
    """
    data = cast(dict[str, Any], parse_fastjson_keyed(body))
    table: dict[int, dict[str, Any]] = {}
    for key, entry in cast(dict[str, Any], data.get("offsetTable") or {}).items():
        queue = json.loads(key)
        if not isinstance(queue, dict) or "queueId" not in queue:
            raise ValueError(f"offset table key {key!r} is not a message queue")
        if queue.get("topic") == topic:
            table[int(queue["queueId"])] = entry
    return table


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


def _check(reply: RemotingCommand, what: str, access_key: str | None = None) -> None:
    if reply.code != ResponseCode.SUCCESS:
        # An ACL refusal names the user and the settings to fix, not just a code.
        refused = CredentialsRefusedError.from_reply(
            reply.code, reply.remark, access_key, what, "the resource above"
        )
        if refused is not None:
            raise refused
        raise RemotingError(what, reply.code, reply.remark)
