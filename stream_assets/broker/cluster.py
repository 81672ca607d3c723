"""A local Apache RocketMQ *cluster*: one name server and several broker groups.

The same official jars as :class:`~stream_assets.broker.local.LocalBroker`
(resolved by Maven through ``infra/rocketmq/pom.xml``), one JVM per node, each
node with its own ports and its own directory (config, pid file, stdout, store,
RocketMQ's own logs) under one home (``.local/rocketmq-cluster`` by default)::

    DefaultCluster
      broker-a  master (brokerId 0, ASYNC_MASTER)  port 30911, HA 30912, VIP 30909
                slave  (brokerId 1, SLAVE)         port 31911, HA 31912, VIP 31909
      broker-b  master (brokerId 0, ASYNC_MASTER)  port 28911, HA 28912, VIP 28909
    name server                                    port 29876

Ports, heaps and extra config keys (per name server, per broker, per node: e.g.
ACL 2.0's ``authenticationEnabled``) come from
:class:`~stream_assets.settings.ClusterSettings`. Every broker gets the tuning
of the single local broker.

With ``ClusterSettings.controller`` the name server also runs RocketMQ 5's
controller, and every broker runs under it (controller mode): the controller
gives the roles and ids (the node started first in a new cluster becomes
master), and promotes a lost master's in-sync slave within a second, under
the same group name; ``kill``/``node_in_role`` follow the roles as they are
now, and ``hand_back_master`` restores the first ones. Writes are acknowledged
once every in-sync replica has them (``allAckInSyncStateSet``), and a start
returns once each group's nodes are in its SyncStateSet.

Without it, replication is RocketMQ's plain master/slave: the
slave copies the master's commit log over HA as it is written, and its topic
config, consumer offsets and subscription groups by pulling them from the
master every 60 s (a fixed interval in 5.3.3; the first pull comes about 60 s
after the slave starts). A slave refuses every pull unless ``slaveReadEnable``
is set on it, so the slaves here set it (masters keep the default, false, so
they never redirect readers to the slave). A slave answers a pull for a topic
only once it holds that topic's config, i.e. after that sync, or after the
topic was created on the slave too.

Waiting is on events only: a node is up when the name server's cluster info
lists its address under its broker id, down when its JVM is gone and the name
server no longer lists it. A broker registers as it boots only if its client
has already connected to the name server (a race inside 5.3.3: the connection
is made by a background scan); otherwise 10 s later, by its first periodic
registration (every 30 s after that). So a node takes 3-15 s to come up, and
``start()`` from cold about 20-40 s on two cores (masters, then slaves).
The name server drops a killed broker as soon as its connection closes
(milliseconds); it would expire a silent one after 120 s.

Example::

    >>> cluster = LocalCluster(ClusterSettings())  # doctest: +SKIP
    >>> cluster.start().serving  # doctest: +SKIP
    True
    >>> cluster.kill("broker-a")  # SIGKILL broker-a's master  # doctest: +SKIP
    >>> cluster.addr("broker-a", "slave")  # doctest: +SKIP
    '127.0.0.1:31911'
    >>> cluster.start_node("broker-a")  # doctest: +SKIP
    >>> cluster.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stream_assets.broker import jvm
from stream_assets.broker.jvm import BrokerStartError, Progress
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.rocketmq.remoting import (
    ConnectionPool,
    RemotingCommand,
    RequestCode,
    ResponseCode,
)
from stream_assets.settings import ClusterSettings, RocketMQSettings

CLUSTER = "DefaultCluster"
NAMESRV = "namesrv"
Role = Literal["master", "slave"]
ROLES: tuple[Role, ...] = ("master", "slave")

_PORT_HINT = (
    "choose other ports with STREAM_ASSETS_CLUSTER_NAMESRV_PORT / "
    "STREAM_ASSETS_CLUSTER_BROKER_A_MASTER_PORT / ..._BROKER_A_SLAVE_PORT / "
    "..._BROKER_B_MASTER_PORT"
)
#: A killed or stopped node is dropped by the name server when its channel
#: closes (at once), else when its registration expires (120 s, scanned every 5 s).
_DEREGISTER_WAIT_S = 150.0
_POLL_S = 0.1


@dataclass(frozen=True)
class ClusterNode:
    """One broker JVM of the cluster: a group's master or slave."""

    group: str
    role: Role
    port: int

    @property
    def name(self) -> str:
        """``<group>-<role>``: its directory, pid file and config key."""
        return f"{self.group}-{self.role}"

    @property
    def broker_id(self) -> int:
        """0 for the master, 1 for the slave."""
        return 0 if self.role == "master" else 1

    @property
    def ha_port(self) -> int:
        """Its haListenPort (the master serves replication there)."""
        return self.port + 1

    def ports(self) -> dict[str, int]:
        """Every port the node listens on, by what it is."""
        return {
            f"{self.name}": self.port,
            f"{self.name} VIP channel (port - 2)": self.port - 2,
            f"{self.name} HA (port + 1)": self.ha_port,
        }


@dataclass(frozen=True)
class NodeStatus:
    """One broker node: its pid (None if not running) and whether the name server lists it."""

    node: ClusterNode
    addr: str
    pid: int | None
    registered: bool
    #: The brokerId the name server lists it under (None: not listed). Under a
    #: controller 0 is whichever node is master now.
    listed_id: int | None = None

    @property
    def serving(self) -> bool:
        """Running and registered with the name server."""
        return self.pid is not None and self.registered


@dataclass(frozen=True)
class ClusterStatus:
    """The name server's pid and every broker node's status."""

    namesrv_addr: str
    namesrv_pid: int | None
    nodes: tuple[NodeStatus, ...]

    @property
    def serving(self) -> bool:
        """The name server runs and every node is running and registered."""
        return self.namesrv_pid is not None and all(n.serving for n in self.nodes)

    def node(self, group: str, role: Role = "master") -> NodeStatus:
        """The status of ``group``'s ``role`` node."""
        for status in self.nodes:
            if (status.node.group, status.node.role) == (group, role):
                return status
        raise KeyError(f"no {role} of broker group {group!r} in this cluster")

    def describe(self) -> str:
        """A few lines for a person."""
        head = "running" if self.serving else "not serving"
        namesrv = f"pid {self.namesrv_pid}" if self.namesrv_pid else "stopped"
        lines = [f"RocketMQ cluster {head}: name server {namesrv} at {self.namesrv_addr}"]
        for s in self.nodes:
            state = f"pid {s.pid}" if s.pid else "stopped"
            if s.pid and not s.registered:
                state += ", not registered"
            listed = s.node.broker_id if s.listed_id is None else s.listed_id
            role = "master" if listed == 0 else "slave"
            lines.append(f"  {s.node.group} {role} (brokerId {listed}) at {s.addr}: {state}")
        return "\n".join(lines)


class LocalCluster:
    """Start, stop, kill and inspect a local RocketMQ cluster (see the module doc).

    ``client`` (e.g. carrying ACL credentials) is what the cluster's own
    name-server queries and :meth:`client_settings` start from; its
    ``namesrv_addr`` is replaced by this cluster's.
    """

    def __init__(
        self,
        settings: ClusterSettings | None = None,
        progress: Progress = jvm.print_progress,
        client: RocketMQSettings | None = None,
    ) -> None:
        self.settings = settings or ClusterSettings()
        self.home = self.settings.resolved_home()
        self.progress = progress
        self._client = client
        s = self.settings
        self.nodes: tuple[ClusterNode, ...] = (
            ClusterNode("broker-a", "master", s.broker_a_master_port),
            ClusterNode("broker-a", "slave", s.broker_a_slave_port),
            ClusterNode("broker-b", "master", s.broker_b_master_port),
        )
        unknown = sorted(set(s.node_conf) - {n.name for n in self.nodes})
        if unknown:
            raise ValueError(
                f"node_conf names unknown nodes {unknown}; the nodes are "
                f"{[n.name for n in self.nodes]}"
            )
        ports = [s.namesrv_port] + [p for n in self.nodes for p in n.ports().values()]
        if s.controller:
            ports.append(s.controller_port)
        if len(set(ports)) != len(ports):
            raise ValueError(
                f"the cluster's ports overlap: {sorted(ports)} (each broker also uses its "
                "port - 2 and port + 1)"
            )

    # -- addresses and paths -------------------------------------------------

    @property
    def namesrv_addr(self) -> str:
        """The name server's address, ``host:port``."""
        return self.settings.namesrv_addr

    @property
    def controller_addr(self) -> str:
        """The controller's address (its DLedger peer address), ``host:port``."""
        return f"{self.settings.host}:{self.settings.controller_port}"

    @property
    def groups(self) -> list[str]:
        """The broker group names, sorted."""
        return sorted({n.group for n in self.nodes})

    def client_settings(self) -> RocketMQSettings:
        """Client settings that point at this cluster's name server."""
        base = self._client or RocketMQSettings(namesrv_addr=self.namesrv_addr)
        return base.model_copy(
            update={
                "namesrv_addr": self.namesrv_addr,
                "status_command": "stream-assets cluster status",
            }
        )

    def node(self, group: str, role: Role = "master") -> ClusterNode:
        """``group``'s ``role`` node; KeyError if the cluster has none."""
        for node in self.nodes:
            if (node.group, node.role) == (group, role):
                return node
        raise KeyError(
            f"no {role} of broker group {group!r}; the nodes are {[n.name for n in self.nodes]}"
        )

    def group_nodes(self, group: str) -> list[ClusterNode]:
        """Every node of ``group``, master first."""
        nodes = [n for n in self.nodes if n.group == group]
        if not nodes:
            raise KeyError(f"no broker group {group!r}; the groups are {self.groups}")
        return sorted(nodes, key=lambda n: n.broker_id)

    def addr(self, group: str, role: Role = "master") -> str:
        """The remoting address of ``group``'s ``role`` node, ``host:port``."""
        return f"{self.settings.host}:{self.node(group, role).port}"

    def node_dir(self, name: str) -> Path:
        """The directory of node ``name`` (``namesrv`` or ``<group>-<role>``)."""
        return self.home / name

    def log_file(self, name: str) -> Path:
        """The JVM's stdout/stderr of node ``name``; RocketMQ's own logs are in
        ``<node dir>/logs/rocketmqlogs``."""
        return self.node_dir(name) / "node.out"

    def _pid_file(self, name: str) -> Path:
        return self.node_dir(name) / "node.pid"

    def classpath(self) -> str:
        """The namesrv + broker classpath, resolved once per version through Maven."""
        return jvm.resolve_classpath(self.home, self.settings.version, self.progress)

    # -- status ----------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        """Node name -> pid of every running JVM (``namesrv`` included)."""
        names = [NAMESRV, *(n.name for n in self.nodes)]
        return {name: pid for name in names if (pid := jvm.read_pid(self._pid_file(name)))}

    def _admin(self) -> RocketMQAdmin:
        return RocketMQAdmin(self.client_settings().model_copy(update={"request_timeout_s": 2.0}))

    def _registered(self) -> dict[str, dict[int, str]] | None:
        """The name server's broker table of this cluster; None if it does not answer."""
        try:
            with self._admin() as admin:
                return admin.cluster_brokers()
        except (RocketMQError, ValueError):
            return None

    def _is_registered(self, table: Mapping[str, Mapping[int, str]] | None, n: ClusterNode) -> bool:
        if table is None:
            return False
        if self.settings.controller:
            # The controller gives the ids: 0 to whichever node is master now.
            return self._addr(n) in table.get(n.group, {}).values()
        return table.get(n.group, {}).get(n.broker_id) == self._addr(n)

    def node_in_role(self, group: str, role: Role = "master") -> ClusterNode:
        """``group``'s node serving as ``role`` now: under a controller, the node the name
        server lists as the master (brokerId 0) is the master, whichever started first.

        Raises :class:`RocketMQError` while a controller-mode group has no master listed.
        """
        if not self.settings.controller:
            return self.node(group, role)
        master_addr = (self._registered() or {}).get(group, {}).get(0)
        nodes = self.group_nodes(group)
        master = next((n for n in nodes if self._addr(n) == master_addr), None)
        if master is None:
            raise RocketMQError(f"broker group {group} has no master listed by the name server")
        if role == "master":
            return master
        others = [n for n in nodes if n != master]
        if not others:
            raise KeyError(f"broker group {group!r} has no slave")
        return others[0]

    def sync_state(self, group: str) -> set[str]:
        """The addresses in ``group``'s SyncStateSet, as the controller has it (controller
        mode): the nodes the controller may promote when the master is lost."""
        return set(self._sync_state_ids(group).values())

    def _addr(self, node: ClusterNode) -> str:
        return f"{self.settings.host}:{node.port}"

    def status(self) -> ClusterStatus:
        """Which JVMs run and which nodes the name server lists (one cluster-info query)."""
        pids = self.pids()
        table = self._registered() if NAMESRV in pids else None
        return ClusterStatus(
            self.namesrv_addr,
            pids.get(NAMESRV),
            tuple(
                NodeStatus(
                    n,
                    self._addr(n),
                    pids.get(n.name),
                    self._is_registered(table, n),
                    _listed_id(table, n.group, self._addr(n)),
                )
                for n in self.nodes
            ),
        )

    # -- start -------------------------------------------------------------------

    def start(self) -> ClusterStatus:
        """Start whatever is not running; return once every node is registered.

        Idempotent. The name server starts first, then the masters, then the
        slaves: a slave learns its master's HA address only from the answer to
        its own registration (repeated every 30 s), so one registered before
        its master would not replicate for up to 30 s. (A static
        ``haMasterAddress`` does not help: 5.3.3 applies it before its HA
        client exists, and the slave then never connects.)
        """
        status = self.status()
        if status.serving:
            self.progress(status.describe())
            return status
        return self._bring_up(self.nodes, with_namesrv=True)

    def wipe(self) -> None:
        """Delete every node's data (stores, the controller's metadata, logs); the
        resolved classpath stays. For a cluster whose data need not outlive it (the
        integration tests'): its commit logs otherwise grow run after run (45 GiB on a
        development machine), until the brokers delete files to free the disk.

        Refused while a node runs: its JVM would go on writing into what is deleted.
        """
        running = sorted(self.pids())
        if running:
            raise BrokerStartError(
                f"cannot wipe {self.home} while {', '.join(running)} run: stop the cluster first"
            )
        for name in (NAMESRV, *(n.name for n in self.nodes)):
            shutil.rmtree(self.node_dir(name), ignore_errors=True)

    def start_nodes(self, nodes: Sequence[ClusterNode]) -> ClusterStatus:
        """Start ``nodes`` (those not running); return once they are registered (and, under
        a controller, in sync)."""
        return self._bring_up(nodes, with_namesrv=False)

    def start_node(self, group: str, role: Role = "master") -> ClusterStatus:
        """Start ``group``'s ``role`` node (if not running); return once it is registered.

        A slave started while its master is down replicates only once one of
        its registrations (every 30 s) finds the master registered; a slave
        that ran all along reconnects to a restarted master by itself.
        """
        return self._bring_up([self.node(group, role)], with_namesrv=False)

    def start_group(self, group: str) -> ClusterStatus:
        """Start every node of ``group`` that is not running; return once all are registered."""
        return self._bring_up(self.group_nodes(group), with_namesrv=False)

    def _bring_up(self, nodes: Sequence[ClusterNode], with_namesrv: bool) -> ClusterStatus:
        # Each wait's timeout starts when what it waits for starts: resolving the classpath
        # (a minute on a cold, busy machine) and the name server's start are not a
        # broker's.
        def deadline() -> float:
            return time.monotonic() + self.settings.start_timeout_s

        status = self.status()
        start_namesrv = status.namesrv_pid is None
        if start_namesrv and not with_namesrv:
            raise BrokerStartError(
                f"the cluster's name server ({self.namesrv_addr}) is not running; "
                "start the whole cluster with start()"
            )
        missing = [n for n in nodes if status.node(n.group, n.role).pid is None]
        # Check every port before spawning anything: a taken port must not
        # leave half a cluster behind.
        host = self.settings.host
        if start_namesrv:
            jvm.check_port_free(host, self.settings.namesrv_port, "name server", _PORT_HINT)
            if self.settings.controller:
                jvm.check_port_free(host, self.settings.controller_port, "controller", _PORT_HINT)
        for node in missing:
            for what, port in node.ports().items():
                jvm.check_port_free(host, port, what, _PORT_HINT)
        cp = self.classpath() if start_namesrv or missing else ""
        spawned: dict[str, subprocess.Popen[bytes]] = {}
        if start_namesrv:
            spawned[NAMESRV] = jvm.spawn_jvm(self._namesrv_spec(), cp, self.progress)
            self._wait("the name server to answer", lambda t: t is not None, spawned, deadline())
        # Masters before slaves, unless a controller decides the roles: it may be waiting
        # for the node that was master when the cluster stopped, whichever that is.
        by_role = [[n for n in missing if n.role == role] for role in ROLES]
        batches = [by_role[0] + by_role[1]] if self.settings.controller else by_role
        for batch in batches:
            for node in batch:
                spawned[node.name] = jvm.spawn_jvm(self._broker_spec(node), cp, self.progress)
            if batch:
                self._wait_registered(batch, spawned, deadline())
        self._wait_registered(nodes, spawned, deadline())
        if self.settings.controller:
            self._wait_in_sync({n.group for n in nodes}, spawned, deadline())
        status = self.status()
        self.progress(status.describe())
        return status

    def _wait_registered(
        self,
        nodes: Sequence[ClusterNode],
        spawned: Mapping[str, subprocess.Popen[bytes]],
        deadline: float,
    ) -> None:
        self._wait(
            f"{', '.join(n.name for n in nodes)} to register with the name server",
            lambda table: all(self._is_registered(table, n) for n in nodes),
            spawned,
            deadline,
        )

    def _wait(
        self,
        what: str,
        done: Callable[[dict[str, dict[int, str]] | None], bool],
        spawned: Mapping[str, subprocess.Popen[bytes]],
        deadline: float,
    ) -> None:
        """Poll the name server's cluster info until ``done``; fail if a JVM of ours exits."""
        while True:
            for name, proc in spawned.items():
                if jvm.exited(proc, self._pid_file(name)):
                    raise BrokerStartError(
                        f"the {name} JVM exited during start; last lines of "
                        f"{self.log_file(name)}:\n{jvm.tail(self.log_file(name))}"
                    )
            if done(self._registered()):
                return
            if time.monotonic() > deadline:
                raise BrokerStartError(
                    f"timed out after {self.settings.start_timeout_s:.0f}s waiting for {what}; "
                    f"see {self.home}/<node>/node.out and <node>/logs/rocketmqlogs"
                )
            time.sleep(_POLL_S)

    def hand_back_master(self, group: str) -> None:
        """Under a controller: make ``group``'s first node its master again after a
        failover promoted the other (the controller's designated election: no restart)."""
        if not self.settings.controller or len(self.group_nodes(group)) < 2:
            return
        first = self.node(group, "master")
        if self.node_in_role(group, "master") == first:
            return
        self._wait_in_sync({group}, {}, time.monotonic() + self.settings.start_timeout_s)
        ids = {addr: broker_id for broker_id, addr in self._sync_state_ids(group).items()}
        reply = self._controller_call(
            RequestCode.CONTROLLER_ELECT_MASTER,
            {
                "clusterName": CLUSTER,
                "brokerName": group,
                "brokerId": str(ids[self._addr(first)]),
                "designateElect": "true",
                "invokeTime": str(int(time.time() * 1000)),
            },
        )
        if reply.code != ResponseCode.SUCCESS:
            raise RocketMQError(f"the controller refused to elect {first.name}: {reply.remark}")
        self._wait(
            f"{first.name} to be {group}'s master again",
            lambda table: (table or {}).get(group, {}).get(0) == self._addr(first),
            {},
            time.monotonic() + self.settings.start_timeout_s,
        )
        self._wait_in_sync({group}, {}, time.monotonic() + self.settings.start_timeout_s)

    def _controller_call(
        self, code: int, fields: dict[str, str], body: bytes = b""
    ) -> RemotingCommand:
        pool = ConnectionPool(2.0, None)
        try:
            return pool.get(self.controller_addr, "controller").call(code, fields, body=body)
        finally:
            pool.close()

    def _sync_state_ids(self, group: str) -> dict[int, str]:
        """Controller broker id -> address of ``group``'s in-sync, alive nodes."""
        try:
            reply = self._controller_call(
                RequestCode.CONTROLLER_GET_SYNC_STATE_DATA, {}, json.dumps([group]).encode()
            )
        except RocketMQError:
            return {}
        if reply.code != ResponseCode.SUCCESS:
            return {}
        info = json.loads(reply.body or b"{}").get("replicasInfoTable", {}).get(group, {})
        return {
            int(m["brokerId"]): str(m["brokerAddress"])
            for m in info.get("inSyncReplicas", [])
            if m.get("alive")
        }

    def _wait_in_sync(
        self, groups: set[str], spawned: Mapping[str, subprocess.Popen[bytes]], deadline: float
    ) -> None:
        """Under a controller: wait until every running node of ``groups`` is in its group's
        SyncStateSet (a slave outside it is never promoted: a kill then loses the group)."""
        running = self.pids()
        for group in sorted(groups):
            addrs = {self._addr(n) for n in self.group_nodes(group) if n.name in running}
            if len(addrs) < 2:
                continue
            self._wait(
                f"{group}'s nodes to be in sync (its SyncStateSet, as the controller has it)",
                lambda _table, g=group, a=addrs: a <= self.sync_state(g),  # type: ignore[misc]
                spawned,
                deadline,
            )

    # -- stop / kill -------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every broker, then the name server; wait, killing any left after 60 s."""
        pids = self.pids()
        brokers = {n.name: pids[n.name] for n in self.nodes if n.name in pids}
        if brokers:
            jvm.terminate(brokers, self.progress)
        if NAMESRV in pids:
            jvm.terminate({NAMESRV: pids[NAMESRV]}, self.progress)
        for name in [NAMESRV, *(n.name for n in self.nodes)]:
            self._pid_file(name).unlink(missing_ok=True)

    def stop_node(self, group: str, role: Role = "master") -> None:
        """SIGTERM ``group``'s ``role`` node and wait until it is gone and unregistered."""
        self._stop_nodes([self.node(group, role)])

    def stop_group(self, group: str) -> None:
        """SIGTERM every node of ``group``; wait until all are gone and unregistered."""
        self._stop_nodes(self.group_nodes(group))

    def _stop_nodes(self, nodes: Sequence[ClusterNode]) -> None:
        pids = self.pids()
        running = {n.name: pids[n.name] for n in nodes if n.name in pids}
        if running:
            jvm.terminate(running, self.progress)
        for node in nodes:
            self._pid_file(node.name).unlink(missing_ok=True)
        self._wait_unregistered(nodes)

    def kill(self, group: str, role: Role = "master") -> ClusterNode:
        """SIGKILL ``group``'s ``role`` node (no shutdown of any kind, as a crash); under a
        controller, the node in that role now (:meth:`node_in_role`).

        Returns the node once the JVM is gone and the name server no longer
        lists it (it notices the closed channel at once; the time it took is
        reported through ``progress``).
        """
        node = self.node_in_role(group, role)
        pid = jvm.read_pid(self._pid_file(node.name))
        if pid is None:
            self.progress(f"{node.name} is not running")
        else:
            jvm.kill(pid)
            self.progress(f"killed {node.name} (pid {pid}), {group}'s {role}")
        self._pid_file(node.name).unlink(missing_ok=True)
        self._wait_unregistered([node])
        return node

    def _wait_unregistered(self, nodes: Sequence[ClusterNode]) -> None:
        """Wait until the name server lists none of ``nodes`` (if it runs at all)."""
        if jvm.read_pid(self._pid_file(NAMESRV)) is None:
            return
        began = time.monotonic()
        deadline = began + _DEREGISTER_WAIT_S
        while True:
            table = self._registered()
            if table is None or not any(self._is_registered(table, n) for n in nodes):
                break
            if time.monotonic() > deadline:
                raise RocketMQError(
                    f"the name server still lists {[n.name for n in nodes]} "
                    f"{_DEREGISTER_WAIT_S:.0f}s after they stopped"
                )
            time.sleep(_POLL_S)
        names = ", ".join(n.name for n in nodes)
        self.progress(f"the name server dropped {names} after {time.monotonic() - began:.2f}s")

    # -- config ------------------------------------------------------------------

    def _namesrv_spec(self) -> jvm.JvmSpec:
        conf = jvm.write_conf(
            self.node_dir(NAMESRV) / "namesrv.conf",
            {
                "listenPort": self.settings.namesrv_port,
                "bindAddress": self.settings.host,
                **(self._controller_conf() if self.settings.controller else {}),
                **self.settings.namesrv_conf,
            },
        )
        return self._spec(NAMESRV, jvm.NAMESRV_MAIN, self.settings.namesrv_heap, conf)

    def _controller_conf(self) -> dict[str, object]:
        """The name server's embedded controller: one DLedger peer, its files in its dir."""
        home = self.node_dir(NAMESRV)
        return {
            "enableControllerInNamesrv": True,
            "controllerDLegerGroup": "controller",
            "controllerDLegerPeers": f"n0-{self.controller_addr}",
            "controllerDLegerSelfId": "n0",
            "controllerStorePath": home / "controller-store",
            "configStorePath": home / "controller.properties",
            # Its log file is sparse, but 1 GiB by default: small for a dev box.
            "mappedFileSize": 64 * 1024 * 1024,
        }

    def broker_conf(self, node: ClusterNode) -> dict[str, object]:
        """The broker.conf of ``node`` (extra keys of the settings included)."""
        s = self.settings
        store = self.node_dir(node.name) / "store"
        values: dict[str, object] = {
            "brokerClusterName": CLUSTER,
            "brokerName": node.group,
            "brokerId": node.broker_id,
            "brokerRole": "ASYNC_MASTER" if node.role == "master" else "SLAVE",
            "namesrvAddr": self.namesrv_addr,
            "listenPort": node.port,
            "haListenPort": node.ha_port,
            "bindAddress": s.host,
            "brokerIP1": s.host,
            "brokerIP2": s.host,  # the HA address the slave connects to
            "storePathRootDir": store,
            "storePathCommitLog": store / "commitlog",
            **jvm.broker_tuning(
                max_message_size=s.max_message_size,
                commitlog_file_size=s.commitlog_file_size,
                auto_create_topics=s.auto_create_topics,
            ),
        }
        if node.role == "slave" or s.controller:
            # Without it a slave answers every pull with SYSTEM_BUSY
            # (PullMessageProcessor.rejectRequest in 5.3.3). Under a controller any node
            # may be the slave.
            values["slaveReadEnable"] = True
        if s.controller:
            values.update(
                # The controller decides who is master and gives the ids; every node
                # starts as a slave asking it.
                brokerId=-1,
                brokerRole="SLAVE",
                enableControllerMode=True,
                controllerAddr=self.controller_addr,
                # A write is acknowledged once every in-sync replica has it: a promoted
                # slave then holds every acknowledged state and shuffle message.
                allAckInSyncStateSet=True,
            )
        return {**values, **s.broker_conf, **s.node_conf.get(node.name, {})}

    def _broker_spec(self, node: ClusterNode) -> jvm.JvmSpec:
        conf = jvm.write_conf(self.node_dir(node.name) / "broker.conf", self.broker_conf(node))
        return self._spec(node.name, jvm.BROKER_MAIN, self.settings.broker_heap, conf)

    def _spec(self, name: str, main: str, heap: str, conf: Path) -> jvm.JvmSpec:
        return jvm.JvmSpec(
            name, main, heap, conf, self.node_dir(name), self.log_file(name), self._pid_file(name)
        )


def _listed_id(table: Mapping[str, Mapping[int, str]] | None, group: str, addr: str) -> int | None:
    """The brokerId ``addr`` is listed under in ``group`` (None: not listed)."""
    return next((i for i, a in (table or {}).get(group, {}).items() if a == addr), None)
