"""Configuration for stream-assets, read from the environment by pydantic-settings.

One configuration story for the CLI, the tests and the Dagster resources: every
field can be set by an environment variable (prefix shown per class) and the
Dagster resources in ``resources/`` are built from the same classes.

Example (the environment gives what the constructor does not)::

    >>> RocketMQSettings(namesrv_addr="10.0.0.5:9876").namesrv_addrs
    ['10.0.0.5:9876']
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

#: The repository checkout this package runs from (the package is installed
#: editable by infra/dev.sh); infra/ files and the .local/ data dir live here.
PROJECT_ROOT = Path(__file__).resolve().parent.parent

#: Default broker/client message size limit, the broker's own default.
DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024


def local_dir() -> Path:
    """Where everything stream-assets writes locally lives (broker data, logs, state)."""
    return PathsSettings().local_dir


class PathsSettings(BaseSettings):
    """Project-local data directory (env prefix ``STREAM_ASSETS_``)."""

    model_config = SettingsConfigDict(env_prefix="STREAM_ASSETS_", extra="ignore")

    local_dir: Path = Field(
        default=PROJECT_ROOT / ".local",
        description="Root for broker data, client logs, RocksDB state and Dagster storage.",
    )


class RocketMQSettings(BaseSettings):
    """How the client layer reaches RocketMQ (env prefix ``STREAM_ASSETS_ROCKETMQ_``).

    Credentials are ``SecretStr``: they never appear in ``repr``, logs or errors.
    """

    model_config = SettingsConfigDict(env_prefix="STREAM_ASSETS_ROCKETMQ_", extra="ignore")

    namesrv_addr: str = Field(
        default="127.0.0.1:9876",
        description="Name server address(es), 'host:port' separated by ';'.",
    )
    access_key: SecretStr | None = Field(default=None, description="ACL access key.")
    secret_key: SecretStr | None = Field(default=None, description="ACL secret key.")
    request_timeout_s: float = Field(
        default=5.0, gt=0, description="Bound on one remoting request (connect + reply)."
    )
    send_timeout_ms: int = Field(default=3000, gt=0, description="Producer send timeout.")
    send_retries: int = Field(
        default=3, ge=0, description="Retries of a failed sync send (tenacity, exponential)."
    )
    max_message_size: int = Field(
        default=DEFAULT_MAX_MESSAGE_SIZE,
        gt=0,
        description="Largest message body accepted; keep at or below the broker's maxMessageSize.",
    )
    producer_group: str = Field(default="stream-assets-producer")
    status_command: str = Field(
        default="stream-assets broker status",
        description="The command that shows these brokers' health, named in outage messages "
        "(`stream-assets cluster status` and the deployment set their own).",
    )
    client_log_dir: Path | None = Field(
        default=None, description="Where the C++ client writes its logs (default .local/logs)."
    )

    @field_validator("namesrv_addr")
    @classmethod
    def _check_addr(cls, value: str) -> str:
        for addr in value.split(";"):
            host, sep, port = addr.strip().rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(
                    f"namesrv_addr {value!r}: each address must be 'host:port' "
                    "(several separated by ';')"
                )
        return value

    def digest(self) -> str:
        """A short fingerprint of every field, secrets included (their values never shown).

        Client caches key on it, and Spark tasks report it, so the driver can
        check that the settings it shipped are the ones a task used.

        >>> a = RocketMQSettings(namesrv_addr="h:1", access_key="k", secret_key="s")
        >>> a.digest() == RocketMQSettings(namesrv_addr="h:1", access_key="k",
        ...                                secret_key="other").digest()
        False
        """
        return hashlib.sha256(self.revealed_json().encode()).hexdigest()[:16]

    def revealed_json(self) -> str:
        """Every field as JSON, secrets in clear: only for a file the driver keeps private.

        :meth:`from_revealed_json` reads it back without looking at the environment.
        """
        plain = {
            name: value.get_secret_value() if isinstance(value, SecretStr) else value
            for name, value in self
        }
        return json.dumps(plain, sort_keys=True, default=str)

    @classmethod
    def from_revealed_json(cls, text: str) -> RocketMQSettings:
        """Inverse of :meth:`revealed_json`: every field is given, so none comes from the env."""
        return cls.model_validate_json(text)

    @property
    def namesrv_addrs(self) -> list[str]:
        """The name server addresses as a list."""
        return [a.strip() for a in self.namesrv_addr.split(";") if a.strip()]

    def resolved_client_log_dir(self) -> Path:
        """The client log directory, defaulting under the project-local dir."""
        return self.client_log_dir or local_dir() / "logs" / "rocketmq-client"


class BrokerSettings(BaseSettings):
    """The local Apache RocketMQ namesrv + broker (env prefix ``STREAM_ASSETS_BROKER_``)."""

    model_config = SettingsConfigDict(env_prefix="STREAM_ASSETS_BROKER_", extra="ignore")

    version: str = Field(default="5.3.3", description="Apache RocketMQ version (Maven Central).")
    host: str = Field(default="127.0.0.1", description="Address both JVMs bind to and announce.")
    namesrv_port: int = Field(default=9876, gt=0, lt=65536)
    broker_port: int = Field(default=10911, gt=2, lt=65535)
    auto_create_topics: bool = Field(
        default=False,
        description="Broker autoCreateTopicEnable; off so a misspelt topic is an error.",
    )
    namesrv_heap: str = Field(default="256m")
    broker_heap: str = Field(default="1g")
    commitlog_file_size: int = Field(
        default=128 * 1024 * 1024, description="mappedFileSizeCommitLog (smaller than 1 GiB)."
    )
    max_message_size: int = Field(default=DEFAULT_MAX_MESSAGE_SIZE, gt=0)
    start_timeout_s: float = Field(default=90.0, gt=0)
    home: Path | None = Field(
        default=None, description="Data and logs of both JVMs (default .local/rocketmq)."
    )

    def resolved_home(self) -> Path:
        """The broker home, defaulting under the project-local dir."""
        return self.home or local_dir() / "rocketmq"

    @property
    def namesrv_addr(self) -> str:
        """The address clients use to reach this name server."""
        return f"{self.host}:{self.namesrv_port}"

    @property
    def broker_ports(self) -> dict[str, int]:
        """Every port the broker JVM listens on, by RocketMQ's own derivation."""
        return {
            "broker": self.broker_port,
            "broker VIP channel (broker port - 2)": self.broker_port - 2,
            "broker HA (broker port + 1)": self.broker_port + 1,
        }


class EngineSettings(BaseSettings):
    """How instances run topologies (env prefix ``STREAM_ASSETS_ENGINE_``).

    Example: each topology's instances on a Prometheus port range of their own
    (``STREAM_ASSETS_ENGINE_METRICS_PORTS='{"clicks": 9500}'`` in the env)::

        >>> engine = EngineSettings(metrics_ports={"clicks": 9500})
        >>> engine.metrics_port, engine.metrics_ports["clicks"]
        (9450, 9500)
    """

    model_config = SettingsConfigDict(env_prefix="STREAM_ASSETS_ENGINE_", extra="ignore")

    spark_master: str = Field(default="local[2]", description="Spark master URL.")
    spark_conf: dict[str, str] = Field(
        default_factory=dict, description="Extra Spark conf (JSON object in the env)."
    )
    driver_memory: str = Field(
        default="512m",
        description="Heap of the Spark driver JVM (in local mode it runs the tasks' JVM side "
        "too, which only moves small range and stats rows); applies when the instance starts "
        "the JVM. A 'spark.driver.memory' in spark_conf wins.",
    )
    jvm_class_archive: bool = Field(
        default=True,
        description="Start the Spark driver JVM from this machine's class-data archive (AppCDS) "
        "when there is one: ~2 s less to a SparkSession and ~1 s less to its first job. "
        "`stream-assets jvm-archive` (run by infra/dev.sh's setup) writes it once per JDK and "
        "Spark version; an archive the JVM cannot use is ignored.",
    )
    state_dir: Path | None = Field(
        default=None,
        description="RocksDB root. Default: on each executor, under Spark's local directory "
        "(SPARK_LOCAL_DIRS of the worker), so state is on the disk of the machine that runs "
        "the task. Set it only to a path that is local on every executor.",
    )
    shuffle_queues: int = Field(default=8, gt=0, description="Queues of shuffle/state topics.")
    sink_queues: int = Field(default=8, gt=0, description="Queues of sink topics it creates.")
    mode: Literal["micro-batch", "real-time"] = Field(
        default="real-time",
        description="How the stages run. 'real-time' (the default, chosen by measurement: "
        "docs/engine.md 'Which mode'): long-running Spark tasks, every stage at once, each "
        "processing what arrives in small steps for interval_ms and committing every step. "
        "'micro-batch': one Spark Structured Streaming micro-batch every "
        "trigger_interval_ms, a keyed record waiting for two of them; better for the "
        "highest throughput of an unkeyed exactly-once sink.",
    )
    interval_ms: int = Field(
        default=300_000,
        gt=0,
        description="Real-time mode: how long one Spark job of long-running tasks lasts (a "
        "checkpoint interval, not a unit of latency); a stop, a rebalance, a change in the "
        "application's task slots or a failed task ends it early. Each end pauses every "
        "queue for a few hundred ms while the next job starts (docs/engine.md).",
    )
    step_max_records: int = Field(
        default=2_000,
        gt=0,
        description="Real-time mode: at most this many records per stage in one step of a "
        "task while it keeps up (2 000 against 10 000: p99 at half the max 149 ms against "
        "268 ms passthrough, 981 ms against 1 462 ms WordCount; docs/benchmarks.md); a stage "
        "that is behind doubles it step by step, up to 4x, until a step takes less "
        "(docs/engine.md).",
    )
    real_time_tasks: int = Field(
        default=0,
        ge=0,
        description="Real-time mode: long-running tasks an instance runs (each takes a task "
        "slot for the whole interval). 0: as many as its Spark application has slots (at "
        "most one per queue), shared fairly among the real-time instances this process "
        "runs on that application (docs/engine.md).",
    )
    idle_poll_ms: int = Field(
        default=20,
        gt=0,
        description="Real-time mode: the longest a task waits between polls of its queues' "
        "offsets when nothing arrived (it polls again at once while records arrive, and "
        "backs off from 1 ms to this when they stop).",
    )
    held_send_bytes: int = Field(
        default=64 << 20,
        gt=0,
        description="Real-time mode: while a broker group has no master, a task sends what "
        "the other groups can store and holds the messages for that group in memory, up to "
        "this many bytes of bodies; past it the task waits for the group (docs/engine.md).",
    )
    trigger_interval_ms: int = Field(default=500, gt=0)
    max_records_per_batch: int = Field(default=100_000, gt=0)
    tick_ms: int = Field(
        default=1000, gt=0, description="Idle tick of stateful stages (fires idle windows)."
    )
    snapshot_every: int = Field(default=100, gt=0, description="Commits between snapshots.")
    pre_combine: bool = Field(
        default=True, description="Pre-aggregate decomposable aggregates before the shuffle."
    )
    query_per_stage: bool = Field(
        default=False,
        description="Give each stage its own Spark query. Default: one query runs every "
        "stage, so a micro-batch's fixed cost is paid once; with a query per stage, a slow "
        "stateful stage does not hold back the batches of the stages before it.",
    )
    worker_preconnect: bool = Field(
        default=True,
        description="Start Spark's Python workers with stream-assets-worker-python (installed "
        "beside the venv's python), which connects back to Spark before its imports: a worker "
        "that imports slowly on a busy machine no longer misses Spark's fixed 10 s. False, or "
        "no launcher beside the interpreter: the interpreter itself.",
    )
    broker_outage_s: float | None = Field(
        default=None,
        ge=0,
        description="Unset (the default): a running instance waits as long as a broker outage "
        "lasts, saying in its log and heartbeat which broker group it waits for and since when. "
        "A number: its query fails after that many seconds of outage instead (0: at once), "
        "and Dagster's supervisor starts the instance again.",
    )
    broker_backoff_max_s: float = Field(
        default=5.0,
        gt=0,
        description="Longest pause between two retries while a broker is unreachable (the "
        "pauses grow from 0.5 s): how soon after a broker is back the instance notices.",
    )
    metrics_port: int = Field(
        default=9450,
        ge=0,
        le=65535,
        description="Base port of the instances' Prometheus endpoints: instance i of a topology "
        "serves http://<host>:<base + i>/metrics. 0 turns them off. A port already taken does "
        "not stop the instance: it runs without the endpoint and logs which port and what to set.",
    )
    metrics_ports: dict[str, Annotated[int, Field(ge=0, le=65535)]] = Field(
        default_factory=dict,
        description="Base port per topology (job id), as JSON, over metrics_port: "
        '{"wordcount": 9500, "clicks": 9600}. Topologies whose instances share a host need '
        "ranges of their own; 0 turns one topology's endpoints off.",
    )
    metrics_host: str = Field(
        default="0.0.0.0",
        description="Address the Prometheus endpoints listen on (every interface by default, so "
        "a Prometheus on another host can scrape them; 127.0.0.1 keeps them local).",
    )

    def resolved_state_dir(self) -> Path:
        """The state root, defaulting under the project-local dir."""
        return self.state_dir or local_dir() / "state"


class SupervisorSettings(BaseSettings):
    """How the supervisor sensor judges, relaunches and reports instance runs.

    Env prefix ``STREAM_ASSETS_`` (``STREAM_ASSETS_HEARTBEAT_TIMEOUT_S``, ...);
    the sensor interval keeps its name ``STREAM_ASSETS_SUPERVISOR_INTERVAL_S``.
    Read at every sensor tick, except ``interval_s``, which Dagster takes when
    it loads the code location. ``alert_hooks`` is a comma-separated list of
    ``module:function`` callables, each called with a
    :class:`~stream_assets.control.alerts.Alert`.

    Example::

        >>> s = SupervisorSettings(backoff_base_s=10, alert_hooks="my.alerts:page, my.alerts:log")
        >>> s.heartbeat_timeout_s, s.alert_hooks
        (30.0, ('my.alerts:page', 'my.alerts:log'))
    """

    model_config = SettingsConfigDict(
        env_prefix="STREAM_ASSETS_", extra="ignore", populate_by_name=True
    )

    heartbeat_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A run whose last heartbeat is older is hung (process alive: terminated) "
        "or dead (process gone, or on another host). Runs beat from a thread of their own, "
        "so only a process that cannot run at all (frozen, wedged) falls silent.",
    )
    stall_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="A run whose loop has not gone round for longer is hung: one step of it "
        "(a query start, finishing the batch in flight at a release, warming stores up) may "
        "take this long on a busy machine, and a run reporting such a step within it is "
        "never terminated. Batches do not count: the loop does not wait for them.",
    )
    startup_grace_s: float = Field(
        default=180.0,
        gt=0,
        description="Only for runs whose process the supervisor cannot see (another host, or "
        "no pid known): how long they may take to send their first heartbeat. A run whose "
        "process is alive on this host is never declared dead while it starts.",
    )
    interval_s: int = Field(
        default=15,
        ge=1,
        validation_alias=AliasChoices("interval_s", "STREAM_ASSETS_SUPERVISOR_INTERVAL_S"),
        description="Seconds between supervisor ticks (env STREAM_ASSETS_SUPERVISOR_INTERVAL_S); "
        "also the alert sensor's interval.",
    )
    terminate_grace_s: float = Field(
        default=5.0,
        ge=0,
        description="After SIGTERM to a hung run's process, how long before SIGKILL.",
    )
    backoff_base_s: float = Field(
        default=15.0,
        ge=0,
        description="Wait before relaunching an instance after its second consecutive crash; "
        "doubled for every further crash.",
    )
    backoff_max_s: float = Field(
        default=600.0, ge=0, description="Longest wait between relaunches of a crashing instance."
    )
    crash_window_s: float = Field(
        default=600.0,
        gt=0,
        description="Crashes (failed runs) older than this are forgotten by the backoff and "
        "the alerts' crash count.",
    )
    alert_hooks: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="'module:function' callables (comma-separated) called with every Alert "
        "(an instance run failed; a crash loop engaged the backoff).",
    )

    @field_validator("alert_hooks", mode="before")
    @classmethod
    def _split_hooks(cls, value: object) -> object:
        if isinstance(value, str):
            value = tuple(part.strip() for part in value.split(",") if part.strip())
        if isinstance(value, (tuple, list)):
            for hook in value:
                module, sep, function = str(hook).partition(":")
                if not sep or not module or not function:
                    raise ValueError(
                        f"alert hook {hook!r} must be 'module:function' (an importable module "
                        "and a callable in it); separate several with ','"
                    )
        return value


class MetricsSettings(BaseSettings):
    """How metrics are sampled and summed (env prefix ``STREAM_ASSETS_METRICS_``).

    Example::

        >>> MetricsSettings(rate_window_s=60).rate_window_s
        60.0
    """

    model_config = SettingsConfigDict(env_prefix="STREAM_ASSETS_METRICS_", extra="ignore")

    interval_s: int = Field(
        default=10, ge=1, description="Seconds between two ticks of the metrics sensor."
    )
    rate_window_s: float = Field(
        default=30.0,
        gt=0,
        description="A rate spans at least this much wall time between two counter samples.",
    )
    stale_s: float = Field(
        default=60.0,
        gt=0,
        description="An instance observation older than this is left out of the totals.",
    )


class CheckBounds(BaseModel):
    """A topology's own bounds; a field left None takes the global setting."""

    max_lag: int | None = Field(default=None, ge=0)
    fresh_within_s: float | None = Field(default=None, gt=0)


class CheckSettings(BaseSettings):
    """Bounds and cadence of the topology checks (env prefix ``STREAM_ASSETS_CHECK_``).

    Example::

        >>> s = CheckSettings(max_lag=5000, overrides={"clicks": {"fresh_within_s": 7200}})
        >>> s.bounds("clicks"), s.bounds("wordcount")
        ((5000, 7200.0), (5000, 900.0))
    """

    model_config = SettingsConfigDict(env_prefix="STREAM_ASSETS_CHECK_", extra="ignore")

    max_lag: int = Field(
        default=10_000,
        ge=0,
        description="Most uncommitted messages a source topic may hold for a topology's group.",
    )
    fresh_within_s: float = Field(
        default=900.0,
        gt=0,
        description="A sink is stale when it got nothing for this long while input waited as long.",
    )
    interval_s: int = Field(
        default=60, ge=1, description="Seconds between two evaluations by the checks sensor."
    )
    dead_letter_hold_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="The dead-letter check fails (as a warning) until the newest dead letter "
        "is this old: long enough that whoever looks the next day still sees it.",
    )
    overrides: dict[str, CheckBounds] = Field(
        default_factory=dict,
        description="Per topology (job id), as JSON: "
        '{"wordcount": {"max_lag": 500, "fresh_within_s": 3600}}.',
    )

    def bounds(self, job_id: str) -> tuple[int, float]:
        """``(max_lag, fresh_within_s)`` of ``job_id``."""
        own = self.overrides.get(job_id, CheckBounds())
        return (
            self.max_lag if own.max_lag is None else own.max_lag,
            self.fresh_within_s if own.fresh_within_s is None else own.fresh_within_s,
        )


#: A value of an extra RocketMQ config key (booleans are written true/false).
ConfValue = str | int | float | bool


class ClusterSettings(BaseSettings):
    """The local Apache RocketMQ *cluster* (env prefix ``STREAM_ASSETS_CLUSTER_``).

    One name server and two broker groups of cluster ``DefaultCluster``:
    ``broker-a`` (a master and a slave) and ``broker-b`` (a master). Every
    broker also listens on its port - 2 (VIP channel) and its port + 1 (HA).
    The default ports clash with neither the dev broker (9876/10911) nor the
    integration-test broker (19876/20911).

    Example::

        >>> s = ClusterSettings(namesrv_port=29877, broker_conf={"slaveReadEnable": True})
        >>> s.namesrv_addr, s.broker_a_slave_port
        ('127.0.0.1:29877', 31911)
    """

    model_config = SettingsConfigDict(env_prefix="STREAM_ASSETS_CLUSTER_", extra="ignore")

    version: str = Field(default="5.3.3", description="Apache RocketMQ version (Maven Central).")
    host: str = Field(default="127.0.0.1", description="Address every JVM binds to and announces.")
    namesrv_port: int = Field(default=29876, gt=0, lt=65536)
    broker_a_master_port: int = Field(default=30911, gt=2, lt=65535)
    broker_a_slave_port: int = Field(default=31911, gt=2, lt=65535)
    broker_b_master_port: int = Field(default=28911, gt=2, lt=65535)
    controller: bool = Field(
        default=False,
        description="Run the broker groups under a controller embedded in the name server "
        "(RocketMQ 5 controller mode): when a group's master is lost, the controller promotes "
        "its in-sync slave, which serves the group's queues, writes included, within seconds. "
        "Off: plain master/slave, a slave serves reads only while its master is down.",
    )
    controller_port: int = Field(
        default=29878,
        gt=0,
        lt=65536,
        description="Where the controller listens (its DLedger peer address; brokers' "
        "controllerAddr).",
    )
    auto_create_topics: bool = Field(
        default=False,
        description="Broker autoCreateTopicEnable; off so a misspelt topic is an error.",
    )
    namesrv_heap: str = Field(default="256m")
    broker_heap: str = Field(default="512m", description="Heap of each broker JVM.")
    commitlog_file_size: int = Field(
        default=128 * 1024 * 1024, description="mappedFileSizeCommitLog (smaller than 1 GiB)."
    )
    max_message_size: int = Field(default=DEFAULT_MAX_MESSAGE_SIZE, gt=0)
    start_timeout_s: float = Field(
        default=180.0, gt=0, description="Bound on starting the nodes until they are registered."
    )
    home: Path | None = Field(
        default=None,
        description="One directory per node (conf, pid, logs, store) under it "
        "(default .local/rocketmq-cluster).",
    )
    namesrv_conf: dict[str, ConfValue] = Field(
        default_factory=dict,
        description="More name server config keys (JSON object in the env); they win.",
    )
    broker_conf: dict[str, ConfValue] = Field(
        default_factory=dict,
        description="More config keys for every broker (JSON object in the env); they win over "
        "the defaults.",
    )
    node_conf: dict[str, dict[str, ConfValue]] = Field(
        default_factory=dict,
        description="More config keys per broker node, by node name ('broker-a-master', "
        "'broker-a-slave', 'broker-b-master'); they win over broker_conf.",
    )

    def resolved_home(self) -> Path:
        """The cluster home, defaulting under the project-local dir."""
        return self.home or local_dir() / "rocketmq-cluster"

    @property
    def namesrv_addr(self) -> str:
        """The address clients use to reach the cluster's name server."""
        return f"{self.host}:{self.namesrv_port}"


class DeploySettings(BaseSettings):
    """The production-shaped deployment on one machine (env prefix ``STREAM_ASSETS_DEPLOY_``).

    Every component on ports of its own, clear of the dev broker, the local cluster and
    the test fixtures, so it can run beside them, and below Linux's ephemeral range
    (32768+), where any outgoing connection may hold a port; each host's directory under
    ``home``.
    Secrets are not settings here: they are generated once into ``<home>/secrets.env``.

    Example::

        >>> s = DeploySettings(webserver_port=3400)
        >>> s.namesrv_addr, s.spark_master_url, s.webserver_url
        ('127.0.0.1:23876', 'spark://127.0.0.1:27077', 'http://127.0.0.1:3400')
    """

    model_config = SettingsConfigDict(env_prefix="STREAM_ASSETS_DEPLOY_", extra="ignore")

    home: Path | None = Field(
        default=None, description="Every host's directory under it (default .local/prod-like)."
    )
    host: str = Field(default="127.0.0.1", description="Address every service binds to.")
    postgres_port: int = Field(default=25432, gt=0, lt=65536)
    namesrv_port: int = Field(default=23876, gt=0, lt=65536)
    broker_a_master_port: int = Field(default=24911, gt=2, lt=65535)
    broker_a_slave_port: int = Field(default=25911, gt=2, lt=65535)
    broker_b_master_port: int = Field(default=26911, gt=2, lt=65535)
    controller: bool = Field(
        default=False,
        description="The broker groups under a controller embedded in the name server "
        "(RocketMQ 5 controller mode): a lost master's in-sync slave is promoted within "
        "seconds, as production RocketMQ 5 clusters run (ClusterSettings.controller). Off by "
        "default here: every write then waits for the slave's copy, which on one loaded "
        "machine made the deployment's scale 1.3-2x slower (docs/deployment.md).",
    )
    controller_port: int = Field(default=23878, gt=0, lt=65536)
    spark_master_port: int = Field(default=27077, gt=0, lt=65536)
    spark_ui_port: int = Field(default=28080, gt=0, lt=65536)
    spark_workers: int = Field(default=2, gt=0)
    spark_worker_cores: int = Field(
        default=2, gt=0, description="Cores per worker: one per instance it should host."
    )
    spark_worker_memory: str = Field(default="2g")
    instance_cores: int = Field(
        default=1,
        gt=0,
        description="Executors (of one core) per instance (spark.cores.max): the master "
        "spreads instances over the workers, so queues moving between instances move "
        "between machines.",
    )
    webserver_port: int = Field(default=3300, gt=0, lt=65536)
    code_server_port: int = Field(
        default=4266,
        gt=0,
        lt=65536,
        description="The code location's gRPC server (dagster code-server), which the "
        "webserver and the daemon share.",
    )
    metrics_port: int = Field(
        default=9550, ge=0, lt=65536, description="Instance i serves Prometheus on this + i."
    )
    topology: str = Field(default="wordcount", description="The topology deployed.")
    instances: int = Field(default=2, ge=0, description="Instances it is scaled to.")
    source_queues: int = Field(default=8, gt=0, description="Queues of its source topic.")
    feed_lines_per_s: float = Field(
        default=200.0, ge=0, description="Live input into the source topic; 0: none."
    )
    app_user: str = Field(
        default="stream-assets-app", description="The RocketMQ (non-admin) user topologies run as."
    )
    admin_user: str = Field(default="rocketmq-admin", description="The RocketMQ super user.")
    feeder_user: str = Field(
        default="stream-assets-feeder",
        description="The RocketMQ user the live input signs as (publish to the sources only).",
    )

    def resolved_home(self) -> Path:
        """The deployment home, defaulting under the project-local dir."""
        return (self.home or local_dir() / "prod-like").resolve()

    @property
    def namesrv_addr(self) -> str:
        return f"{self.host}:{self.namesrv_port}"

    @property
    def spark_master_url(self) -> str:
        return f"spark://{self.host}:{self.spark_master_port}"

    @property
    def webserver_url(self) -> str:
        return f"http://{self.host}:{self.webserver_port}"
