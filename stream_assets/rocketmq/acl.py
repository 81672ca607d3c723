"""RocketMQ ACL 2.0: users and grants over the remoting protocol, and a fail-fast check.

A broker with ACL 2.0 (RocketMQ 5.3.x, ``authenticationEnabled`` /
``authorizationEnabled``, see docs/acl.md) keeps its users and their ACLs in
its own store, so an admin creates them on *every* broker node (masters and
slaves), as ``mqadmin createUser -c`` does; the name server checks nothing.
These functions speak the broker's admin requests (``AUTH_CREATE_USER``,
``AUTH_CREATE_ACL``, ...) signed with the admin's own credentials.

:func:`topology_grants` lists what a topology's (non-admin) user needs;
:func:`check_credentials` (for a topology: :func:`check_topology_credentials`)
makes the cheapest authenticated calls an instance will make and raises
:class:`~stream_assets.rocketmq.errors.CredentialsRefusedError` (naming the
user, the operation and the resource, never the secret) when the broker
refuses them, before anything expensive starts.

Example::

    >>> admin = RocketMQAdmin(admin_settings)  # doctest: +SKIP
    >>> create_user(admin, "wordcount-app", SecretStr(password))  # doctest: +SKIP
    >>> grant(admin, "wordcount-app", topology_grants(wordcount.build()))  # doctest: +SKIP
    >>> app = RocketMQAdmin(app_settings)  # doctest: +SKIP
    >>> check_credentials(app, ["sourceTopic"], "wordcount")  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from pydantic import SecretStr

from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.discarded import DISCARD_TOPIC
from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    CredentialsRefusedError,
    RemotingError,
    TopicNotFoundError,
)
from stream_assets.rocketmq.remoting import RemotingCommand, RequestCode, parse_fastjson

#: org.apache.rocketmq.remoting.protocol.RequestCode (5.3.3), the ACL 2.0 admin requests.
AUTH_CREATE_USER = 3001
AUTH_UPDATE_USER = 3002
AUTH_DELETE_USER = 3003
AUTH_GET_USER = 3004
AUTH_CREATE_ACL = 3006
AUTH_DELETE_ACL = 3008
AUTH_GET_ACL = 3009
#: A request the broker authenticates but authorizes against no resource.
GET_BROKER_RUNTIME_INFO = 28
#: The consumer group the topology checks pull as (jobs/checks.py).
CHECKS_GROUP = "stream-assets-checks"
#: ResponseCode.NO_PERMISSION: every ACL 2.0 refusal (and a few non-ACL ones).
NO_PERMISSION = 16
#: ResponseCode.INVALID_PARAMETER: how the broker answers the publish probe it let through.
INVALID_PARAMETER = 29

#: Action names of org.apache.rocketmq.common.action.Action ("Any" is refused in grants).
ACTIONS = ("All", "Pub", "Sub", "Create", "Update", "Delete", "Get", "List")
_RESOURCE_TYPES = ("Cluster", "Namespace", "Topic", "Group")
#: A queue id no topic has: the broker authorizes the send, then rejects it unstored.
_PROBE_QUEUE_ID = 2**31 - 1

#: One remoting request: (code, ext fields, body).
Request = tuple[int, dict[str, str], bytes]


@dataclass(frozen=True)
class Grant:
    """One ACL entry: ``actions`` allowed (or denied) on ``resource``.

    ``resource`` is ``Type:name`` with Type one of Cluster, Namespace, Topic,
    Group; a name ending in ``*`` is a prefix, ``Type:*`` any of the type,
    ``*`` anything. ``why`` is for people (docs, logs), never sent.

    >>> Grant("Topic:orders", ("Sub", "Get")).entry()
    {'resource': 'Topic:orders', 'actions': ['Sub', 'Get'], 'decision': 'Allow'}
    """

    resource: str
    actions: tuple[str, ...]
    why: str = ""
    decision: str = "Allow"
    source_ips: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        kind, sep, name = self.resource.partition(":")
        if self.resource != "*" and (not sep or not name or kind not in _RESOURCE_TYPES):
            raise ValueError(
                f"ACL resource {self.resource!r}: use '*' or 'Type:name' with Type one of "
                f"{', '.join(_RESOURCE_TYPES)} (a name ending in '*' is a prefix)"
            )
        unknown = [a for a in self.actions if a not in ACTIONS]
        if not self.actions or unknown:
            raise ValueError(
                f"ACL actions {list(self.actions)} for {self.resource}: give one or more of "
                f"{', '.join(ACTIONS)}"
            )
        if self.decision not in ("Allow", "Deny"):
            raise ValueError(f"ACL decision {self.decision!r}: 'Allow' or 'Deny'")

    def entry(self) -> dict[str, Any]:
        """The broker's PolicyEntryInfo for this grant."""
        out: dict[str, Any] = {"resource": self.resource, "actions": list(self.actions)}
        if self.source_ips:
            out["sourceIps"] = list(self.source_ips)
        out["decision"] = self.decision
        return out


# -- request encoding ---------------------------------------------------------


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def create_user_request(
    username: str, password: SecretStr, user_type: str = "Normal", update: bool = False
) -> Request:
    """``AUTH_CREATE_USER`` (or ``AUTH_UPDATE_USER``): header ``username``, body a UserInfo.

    ``user_type`` is ``Normal`` or ``Super`` (only a super user may create
    one). The password travels in the body, which the admin's signature
    covers but nothing encrypts: use a network you trust, as for every
    RocketMQ remoting call.
    """
    _check_name(username)
    if user_type not in ("Normal", "Super"):
        raise ValueError(f"user type {user_type!r}: 'Normal' or 'Super'")
    if not password.get_secret_value():
        raise ValueError(f"user {username!r}: the password must not be empty")
    body = {
        "username": username,
        "password": password.get_secret_value(),
        "userType": user_type,
        "userStatus": "enable",
    }
    code = AUTH_UPDATE_USER if update else AUTH_CREATE_USER
    return code, {"username": username}, _json(body)


def delete_user_request(username: str) -> Request:
    """``AUTH_DELETE_USER``: the user and its ACL."""
    _check_name(username)
    return AUTH_DELETE_USER, {"username": username}, b""


def create_acl_request(username: str, grants: Sequence[Grant]) -> Request:
    """``AUTH_CREATE_ACL``: header ``subject`` (``User:name``), body an AclInfo of one
    ``Custom`` policy. On a user that has an ACL already, the broker merges:
    an entry for a resource it holds replaces that entry, others are added.
    """
    _check_name(username)
    if not grants:
        raise ValueError(f"no grants for user {username!r}")
    subject = f"User:{username}"
    body = {
        "subject": subject,
        "policies": [{"policyType": "Custom", "entries": [g.entry() for g in grants]}],
    }
    return AUTH_CREATE_ACL, {"subject": subject}, _json(body)


def delete_acl_request(username: str, resource: str | None = None) -> Request:
    """``AUTH_DELETE_ACL``: the user's whole ACL, or its entry for one resource."""
    _check_name(username)
    fields = {"subject": f"User:{username}"}
    if resource is not None:
        fields |= {"policyType": "Custom", "resource": resource}
    return AUTH_DELETE_ACL, fields, b""


def _check_name(username: str) -> None:
    if not username or any(c in username for c in ":*, \t\n"):
        raise ValueError(f"user name {username!r}: non-empty, without ':', '*', ',' or blanks")


# -- admin calls -----------------------------------------------------------------


def broker_nodes(admin: RocketMQAdmin, cluster: str | None = None) -> dict[str, str]:
    """Every broker node (masters and slaves) registered with the name server:
    address -> ``"broker <name> (id <n>)"``. ACL 2.0 keeps users per node.
    """
    errors: list[BrokerUnreachableError] = []
    pool = admin.new_pool()
    try:
        for namesrv in admin.settings.namesrv_addrs:
            try:
                reply = pool.get(namesrv, "name server").call(
                    RequestCode.GET_BROKER_CLUSTER_INFO, {}
                )
            except BrokerUnreachableError as exc:
                errors.append(exc)
                continue
            if reply.code != 0:
                raise RemotingError("cluster info", reply.code, reply.remark)
            data = cast(dict[str, Any], parse_fastjson(reply.body))
            names: set[str] | None = None
            if cluster is not None:
                names = set(data.get("clusterAddrTable", {}).get(cluster, []))
            return {
                addr: f"broker {name} (id {node})"
                for name, b in sorted(data.get("brokerAddrTable", {}).items())
                if names is None or name in names
                for node, addr in sorted(b.get("brokerAddrs", {}).items())
            }
    finally:
        pool.close()
    raise errors[0]


def _on_every_node(
    admin: RocketMQAdmin,
    request: Request,
    what: str,
    nodes: dict[str, str] | None,
    accept: Iterable[str] = (),
) -> list[RemotingCommand]:
    """``request`` on every broker node; refusals raise; ``accept``: remarks taken as done."""
    nodes = broker_nodes(admin) if nodes is None else nodes
    if not nodes:
        raise BrokerUnreachableError(
            "brokers", admin.settings.namesrv_addr, "no broker is registered with the name server"
        )
    accepted = tuple(accept)
    replies = []
    pool = admin.new_pool()
    try:
        for addr, label in sorted(nodes.items(), key=lambda kv: kv[1]):
            reply = pool.get(addr, label).call(*request)
            if reply.code != 0 and not any(a in (reply.remark or "") for a in accepted):
                raise_if_refused(reply, access_key_of(admin), what, label)
                raise RemotingError(f"{what} on {label} at {addr}", reply.code, reply.remark)
            replies.append(reply)
    finally:
        pool.close()
    return replies


def create_user(
    admin: RocketMQAdmin,
    username: str,
    password: SecretStr,
    user_type: str = "Normal",
    exist_ok: bool = False,
    nodes: dict[str, str] | None = None,
) -> None:
    """Create ``username`` on every broker node (``nodes``: default all registered).

    ``admin`` must carry a super user's credentials. With ``exist_ok`` an
    existing user gets ``password`` and ``user_type`` instead of an error.
    """
    request = create_user_request(username, password, user_type)
    nodes = broker_nodes(admin) if nodes is None else nodes
    accept = ("The user is existed",) if exist_ok else ()
    replies = _on_every_node(admin, request, f"create user {username!r}", nodes, accept)
    if exist_ok and any(r.code != 0 for r in replies):
        update = create_user_request(username, password, user_type, update=True)
        _on_every_node(admin, update, f"update user {username!r}", nodes)


def delete_user(admin: RocketMQAdmin, username: str, nodes: dict[str, str] | None = None) -> None:
    """Delete ``username`` and its ACL from every broker node (absent: no error)."""
    _on_every_node(admin, delete_user_request(username), f"delete user {username!r}", nodes)


def grant(
    admin: RocketMQAdmin,
    username: str,
    grants: Sequence[Grant],
    nodes: dict[str, str] | None = None,
) -> None:
    """Add ``grants`` to ``username``'s ACL on every broker node (the user must exist there)."""
    _on_every_node(admin, create_acl_request(username, grants), f"grant ACL to {username!r}", nodes)


def revoke(
    admin: RocketMQAdmin, username: str, resource: str, nodes: dict[str, str] | None = None
) -> None:
    """Remove ``username``'s ACL entry for ``resource`` on every broker node."""
    request = delete_acl_request(username, resource)
    _on_every_node(admin, request, f"revoke {resource} from {username!r}", nodes)


# -- switching it on ---------------------------------------------------------------

_AUTH = "org.apache.rocketmq.auth"


def broker_conf(
    admin_user: str,
    admin_password: SecretStr,
    inner: tuple[str, SecretStr] | None = None,
) -> dict[str, str]:
    """The broker.conf keys that switch ACL 2.0 on (docs/acl.md explains each).

    ``admin_user`` is created as a Super user at the broker's first start;
    ``inner`` (access key, secret) is what a broker's own client signs with:
    needed on every node of a master/slave group.

    >>> conf = broker_conf("root", SecretStr("pw"))
    >>> conf["authenticationEnabled"], conf["initAuthenticationUser"]
    ('true', '{"username":"root","password":"pw"}')
    """
    conf = {
        "authenticationEnabled": "true",
        "authenticationProvider": f"{_AUTH}.authentication.provider.DefaultAuthenticationProvider",
        "authenticationMetadataProvider": (
            f"{_AUTH}.authentication.provider.LocalAuthenticationMetadataProvider"
        ),
        "authorizationEnabled": "true",
        "authorizationProvider": f"{_AUTH}.authorization.provider.DefaultAuthorizationProvider",
        "authorizationMetadataProvider": (
            f"{_AUTH}.authorization.provider.LocalAuthorizationMetadataProvider"
        ),
        "initAuthenticationUser": _json(
            {"username": admin_user, "password": admin_password.get_secret_value()}
        ).decode(),
    }
    if inner is not None:
        conf["innerClientAuthenticationCredentials"] = _json(
            {"accessKey": inner[0], "secretKey": inner[1].get_secret_value()}
        ).decode()
    return conf


# -- what a topology needs ---------------------------------------------------------


def topology_grants(
    topology: Topology, group: str | None = None, create_topics: bool = True
) -> list[Grant]:
    """The grants a topology's user needs to run it (docs/acl.md explains each).

    ``group`` is the instance's consumer group (default: the job id); the
    engine also uses ``<group>-planned``, ``-warm``, ``-reset`` and
    ``-state-query``. With ``create_topics=False`` the user gets no Create:
    an admin provisions the topology's topics beforehand
    (:func:`~stream_assets.rocketmq.provision.provision_topics` with admin settings).

    >>> from stream_assets.examples import wordcount
    >>> for g in topology_grants(wordcount.build()):
    ...     print(g.resource, ",".join(g.actions))
    Topic:sourceTopic Sub,Get,Update
    Topic:wordcount__* Pub,Sub,Get,Update,Create
    Topic:wordcount-out Pub,Create
    Group:wordcount Sub,Get,Update
    Group:wordcount-* Sub,Get,Update
    """
    group = group or topology.job_id
    create = ("Create",) if create_topics else ()
    own = f"{topology.job_id}__"
    grants = [
        Grant(
            f"Topic:{t}",
            ("Sub", "Get", "Update"),
            "source: pull (Sub); queue offsets (Get); query/commit the group's offsets "
            "(Sub or Get / Sub or Update)",
        )
        for t in topology.source_topics
    ]
    grants.append(
        Grant(
            f"Topic:{own}*",
            ("Pub", "Sub", "Get", "Update", *create),
            "the engine's shuffle, state and dead-letter topics: send (Pub), pull (Sub), "
            "offsets (Get), commit (Update)"
            + (", created on first start (Create)" if create else ""),
        )
    )
    outputs = [
        t
        for t in dict.fromkeys((*topology.sink_topics, *topology.late_topics))
        if not t.startswith(own) and t not in topology.source_topics
    ]
    # An exactly-once sink's steps and check answers read back which of a step's
    # messages a consumer sees yet.
    exactly_once = {t for stage in topology.stages for t in stage.exactly_once_topics}
    grants += [
        Grant(
            f"Topic:{t}",
            ("Pub", *(("Sub", "Get") if t in exactly_once else ()), *create),
            "sink / late records: send (Pub)"
            + ("; exactly once: read back what is visible (Sub, Get)" if t in exactly_once else "")
            + (", created if missing (Create)" if create else ""),
        )
        for t in outputs
    ]
    if exactly_once:
        grants.append(
            Grant(
                f"Topic:{DISCARD_TOPIC}",
                ("Sub", "Get"),
                "exactly-once sinks: find a step's messages the broker discarded (unanswered "
                "checks) to deliver them (Sub, Get)",
            )
        )
    why = "consumer group: pull (Sub), query offsets (Get), commit offsets (Update)"
    grants += [
        Grant(f"Group:{group}", ("Sub", "Get", "Update"), why),
        Grant(f"Group:{group}-*", ("Sub", "Get", "Update"), why + "; -planned, -warm, ..."),
    ]
    return grants


def checks_grants(topology: Topology) -> list[Grant]:
    """What the topology checks (``jobs/checks.py``) read beyond :func:`topology_grants`.

    The freshness check pulls the newest message of each sink and the lag check
    the oldest waiting one, as group ``stream-assets-checks``: give these to the
    user the Dagster code location signs as.

    >>> from stream_assets.examples import wordcount
    >>> for g in checks_grants(wordcount.build()):
    ...     print(g.resource, ",".join(g.actions))
    Topic:wordcount-out Sub,Get
    Group:stream-assets-checks Sub,Get
    """
    return [
        *(
            Grant(f"Topic:{t}", ("Sub", "Get"), "the checks: newest message (Sub), offsets (Get)")
            for t in topology.sink_topics
        ),
        Grant(f"Group:{CHECKS_GROUP}", ("Sub", "Get"), "the checks' pulls (Sub), offsets (Get)"),
    ]


# -- fail fast ----------------------------------------------------------------------


def access_key_of(admin: RocketMQAdmin) -> str | None:
    """The user name ``admin`` signs as (None without credentials); never the secret."""
    key = admin.settings.access_key
    return key.get_secret_value() if key is not None else None


def raise_if_refused(
    reply: RemotingCommand, access_key: str | None, operation: str, resource: str
) -> None:
    """Raise :class:`CredentialsRefusedError` if ``reply`` is an ACL refusal.

    Only ``NO_PERMISSION`` answers whose remark is one of ACL 2.0's count
    ("check signature failed.", "User:x is not found.", "... has no permission
    to access Topic:t ..."); the broker's other NO_PERMISSION answers (a topic
    or broker that is not writable) are left to the caller.
    """
    refused = CredentialsRefusedError.from_reply(
        reply.code, reply.remark, access_key, operation, resource
    )
    if refused is not None:
        raise refused


def check_credentials(
    admin: RocketMQAdmin, topics: Iterable[str], group: str, publish: Iterable[str] = ()
) -> None:
    """Fail fast if the brokers refuse ``admin``'s credentials for what an instance does.

    One pipelined round trip per broker: on every master, a request that is
    authenticated but needs no grant (GET_BROKER_RUNTIME_INFO); for each of
    ``topics`` that exists, on each broker serving it, its offsets
    (GET_TOPIC_STATS_INFO: Get on the topic) and ``group``'s committed offset
    of a queue (QUERY_CONSUMER_OFFSET: the topic and the group). Each of
    ``publish`` that exists is probed with a send the broker authorizes
    (Pub on the topic) and then rejects unstored (a queue id no topic has).
    Topics that do not exist yet are skipped. Raises
    :class:`CredentialsRefusedError` naming the user, the operation and the
    resource; a broker that answers otherwise is not this check's concern.

    Example::

        >>> check_credentials(admin, ["sourceTopic"], "wordcount",
        ...                   publish=["wordcount-out"])  # doctest: +SKIP
    """
    access_key = access_key_of(admin)
    planned: dict[str, list[tuple[Request, str, str]]] = {}
    labels: dict[str, str] = {}
    for name, addr in sorted(admin.master_brokers().items()):
        labels[addr] = f"broker {name}"
        planned.setdefault(addr, []).append(
            (
                (GET_BROKER_RUNTIME_INFO, {}, b""),
                "authenticate (GET_BROKER_RUNTIME_INFO)",
                f"broker {name} at {addr}",
            )
        )
    for topic, addr in _topic_brokers(admin, topics):
        resource = f"Topic:{topic}"
        planned.setdefault(addr, []).append(
            (
                (RequestCode.GET_TOPIC_STATS_INFO, {"topic": topic}, b""),
                "read queue offsets (GET_TOPIC_STATS_INFO)",
                resource,
            )
        )
        query = {"consumerGroup": group, "topic": topic, "queueId": "0"}
        planned[addr].append(
            (
                (RequestCode.QUERY_CONSUMER_OFFSET, {**query, "setZeroIfNotFound": "false"}, b""),
                f"query the committed offset of group {group!r} (QUERY_CONSUMER_OFFSET)",
                f"{resource} / Group:{group}",
            )
        )
    for topic, addr in _topic_brokers(admin, publish):
        planned.setdefault(addr, []).append(
            (_publish_probe(admin, topic), "send (SEND_MESSAGE_V2)", f"Topic:{topic}")
        )
    pool = admin.new_pool()
    try:
        for addr, checks in planned.items():
            replies = pool.get(addr, labels.get(addr, "broker")).call_many(
                [request for request, _, _ in checks]
            )
            for (_, operation, resource), reply in zip(checks, replies, strict=True):
                raise_if_refused(reply, access_key, operation, resource)
    finally:
        pool.close()


def check_topology_credentials(admin: RocketMQAdmin, topology: Topology, group: str) -> None:
    """Fail fast if the brokers refuse ``admin``'s user anything ``topology`` does
    (:func:`check_credentials`; topics not created yet are skipped). Raises
    ``CredentialsRefusedError`` naming the user, the operation and the settings to fix.

    Example::

        >>> check_topology_credentials(admin, wordcount.build(), "wordcount")  # doctest: +SKIP
    """
    t = topology
    check_credentials(
        admin,
        [*t.source_topics, *t.shuffle_topics, *t.state_topics],
        group,
        publish=[
            *t.shuffle_topics,
            *t.state_topics,
            *t.sink_topics,
            *t.late_topics,
            t.dead_letter_topic,
        ],
    )


def _topic_brokers(admin: RocketMQAdmin, topics: Iterable[str]) -> list[tuple[str, str]]:
    """(topic, master address) for each broker serving each existing topic."""
    out = []
    for topic in dict.fromkeys(topics):
        try:
            route = admin.route(topic)
        except TopicNotFoundError:
            continue
        for broker in sorted(route.brokers):
            out.append((topic, admin.broker_addr(MessageQueue(topic, broker, 0))))
    return out


def _publish_probe(admin: RocketMQAdmin, topic: str) -> Request:
    """A SEND_MESSAGE_V2 the broker authorizes, then rejects before storing anything."""
    fields = {
        "a": admin.settings.producer_group,
        "b": topic,
        "c": "TBW102",
        "d": "4",
        "e": str(_PROBE_QUEUE_ID),
        "f": "0",
        "g": "0",
        "h": "0",
        "j": "0",
        "k": "false",
    }
    return RequestCode.SEND_MESSAGE_V2, fields, b""
