"""The production-shaped deployment, every component on this machine as on a host of its own.

``stream-assets deploy up`` (``bash infra/dev.sh prod-like``) brings up, each with
its own directory under ``home`` (``.local/prod-like``), its own ports and logs:

- **postgres**: PostgreSQL, Dagster's run, event-log and schedule storage;
- **rocketmq**: a RocketMQ cluster of two broker groups (broker-a master + slave,
  broker-b master) with ACL 2.0 on: a super user for provisioning, and the
  non-admin user topologies run as, with exactly the grants they need;
- **spark**: a standalone master and two workers, each with a disk of its own;
- **dagster**: the webserver and the daemon as separate services on Postgres;

then deploys the topology (WordCount by default) through the scale job, launched
over the webserver's GraphQL API as a user would from the UI, and starts a feeder
of live input. ``down`` stops the topology (its instances commit and end), then
every service; state, offsets and runs stay for the next ``up``. Secrets are
generated at the first ``up`` into ``home/secrets.env`` (mode 600) and travel
only in the environment of the processes that need them (docs/deployment.md).

Example::

    >>> deployment = ProdLike(DeploySettings())  # doctest: +SKIP
    >>> timings = deployment.up()  # doctest: +SKIP
    >>> deployment.scale(1)  # doctest: +SKIP
    >>> deployment.down()  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dagster as dg
from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError
from pydantic import SecretStr

from stream_assets.broker.cluster import LocalCluster
from stream_assets.broker.jvm import Progress, print_progress, tail
from stream_assets.control.registry import registration
from stream_assets.deploy.daemons import Daemon, DeployError, wait_for
from stream_assets.deploy.dagster_host import DagsterHost
from stream_assets.deploy.env_files import DEPLOY_DIR, host_env, load_secrets
from stream_assets.deploy.postgres import PostgresHost
from stream_assets.deploy.spark_standalone import SparkStandalone, java_home
from stream_assets.jobs.lifecycle import PrintLog, start, stop
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq import acl
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.settings import (
    ClusterSettings,
    ConfValue,
    DeploySettings,
    EngineSettings,
    RocketMQSettings,
)

#: The user brokers of one master/slave group sign their own calls with.
INNER_USER = "rocketmq-inner"
_FINISHED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


class ProdLike:
    """The deployment described by ``settings`` (see the module doc)."""

    def __init__(
        self,
        settings: DeploySettings | None = None,
        progress: Progress = print_progress,
        dagster_env: Mapping[str, str] | None = None,
    ):
        """``dagster_env`` adds to the Dagster host's environment (engine or supervisor
        settings: a test's faster supervisor ticks)."""
        s = self.settings = settings or DeploySettings()
        self.progress = progress
        self.home = s.resolved_home()
        self.secrets = load_secrets(self.home / "secrets.env")
        self.postgres = PostgresHost(self.home / "postgres", s.postgres_port, s.host)
        acl_conf: dict[str, ConfValue] = dict(
            acl.broker_conf(
                s.admin_user,
                self.secrets["ROCKETMQ_ADMIN_PASSWORD"],
                (INNER_USER, self.secrets["ROCKETMQ_INNER_SECRET"]),
            )
        )
        self.rocketmq = LocalCluster(
            ClusterSettings(
                host=s.host,
                namesrv_port=s.namesrv_port,
                broker_a_master_port=s.broker_a_master_port,
                broker_a_slave_port=s.broker_a_slave_port,
                broker_b_master_port=s.broker_b_master_port,
                controller=s.controller,
                controller_port=s.controller_port,
                home=self.home / "rocketmq",
                broker_conf=acl_conf,
            ),
            progress,
            client=self.admin_settings(),
        )
        self.spark = SparkStandalone(
            self.home / "spark",
            s.spark_master_port,
            s.spark_ui_port,
            workers=s.spark_workers,
            worker_cores=s.spark_worker_cores,
            worker_memory=s.spark_worker_memory,
            host=s.host,
        )
        self.dagster = DagsterHost(
            self.home / "dagster",
            s.webserver_port,
            {**self.dagster_env(), **(dagster_env or {})},
            s.host,
            s.code_server_port,
        )
        self.feeder = Daemon(
            "feeder",
            [
                sys.executable,
                "-m",
                "stream_assets.deploy.feeder",
                self.topology().source_topic,
                "--lines-per-s",
                str(s.feed_lines_per_s),
            ],
            self.home / "feeder",
        )

    # -- what each host is given ------------------------------------------------------

    def topology(self) -> Topology:
        """The deployed topology (a registered one: an example, or STREAM_ASSETS_TOPOLOGIES)."""
        return registration(self.settings.topology).topology()

    def admin_settings(self) -> RocketMQSettings:
        """Client settings signing as the RocketMQ super user (provisioning only)."""
        return RocketMQSettings(
            namesrv_addr=self.settings.namesrv_addr,
            access_key=SecretStr(self.settings.admin_user),
            secret_key=self.secrets["ROCKETMQ_ADMIN_PASSWORD"],
        )

    def app_settings(self) -> RocketMQSettings:
        """Client settings of the user topologies run as."""
        return RocketMQSettings(
            namesrv_addr=self.settings.namesrv_addr,
            access_key=SecretStr(self.settings.app_user),
            secret_key=self.secrets["STREAM_ASSETS_ROCKETMQ_SECRET_KEY"],
        )

    def dagster_env(self) -> dict[str, str]:
        """The Dagster host's environment: ``infra/deploy/env/dagster.env`` and its secrets."""
        s = self.settings
        values = {
            "POSTGRES_HOST": s.host,
            "POSTGRES_PORT": str(s.postgres_port),
            "NAMESRV_ADDR": s.namesrv_addr,
            "APP_USER": s.app_user,
            "SPARK_MASTER": s.spark_master_url,
            "SPARK_DRIVER_CONF": json.dumps(self.spark.driver_conf(s.instance_cores)),
            "METRICS_PORT": str(s.metrics_port),
        }
        env = host_env(DEPLOY_DIR / "env" / "dagster.env", values)
        for name in ("DAGSTER_PG_PASSWORD", "STREAM_ASSETS_ROCKETMQ_SECRET_KEY"):
            env[name] = self.secrets[name].get_secret_value()
        # Instance runs start Spark drivers: their executors must run this interpreter.
        env.update(
            PYSPARK_PYTHON=sys.executable,
            PYSPARK_DRIVER_PYTHON=sys.executable,
            JAVA_HOME=java_home(),
        )
        return env

    # -- up, down, status ---------------------------------------------------------------

    def _step(self, timings: dict[str, float], name: str, began: float) -> None:
        timings[name] = round(time.monotonic() - began, 1)
        self.progress(f"[prod-like] {name}: up after {timings[name]} s")

    def up(self, deploy: bool = True) -> dict[str, float]:
        """Start every host not running yet, deploy the topology, start the feeder.

        Idempotent. Returns seconds since the start at which each host was up.
        """
        began = time.monotonic()
        timings: dict[str, float] = {}
        self.postgres.start()
        self.postgres.ensure_database("dagster", "dagster", self.secrets["DAGSTER_PG_PASSWORD"])
        self._step(timings, "postgres", began)
        # The brokers take the longest to come up (masters, then the slave): Spark and
        # Dagster start meanwhile, as separate hosts would.
        with ThreadPoolExecutor(1) as pool:
            brokers = pool.submit(self._rocketmq_up, timings, began)
            self.spark.start()
            self.dagster.start()
            self.spark.wait_ready()
            self._step(timings, "spark", began)
            self.dagster.wait_ready()
            self._step(timings, "dagster", began)
            brokers.result()
        if deploy:
            self.scale(self.settings.instances)
            self._step(timings, f"{self.settings.topology} x{self.settings.instances}", began)
            if self.settings.feed_lines_per_s > 0:
                self.start_feeder()
        self.progress(self.status())
        return timings

    def _rocketmq_up(self, timings: dict[str, float], began: float) -> None:
        self.rocketmq.start()
        self._provision_rocketmq()
        self._step(timings, "rocketmq", began)

    def _feeder_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR": self.settings.namesrv_addr,
            "STREAM_ASSETS_ROCKETMQ_ACCESS_KEY": self.settings.feeder_user,
            "STREAM_ASSETS_ROCKETMQ_SECRET_KEY": self.secrets[
                "FEEDER_SECRET_KEY"
            ].get_secret_value(),
        }

    def _provision_rocketmq(self) -> None:
        """The app user (topology grants) and the feeder user (publish to the sources) on
        every broker node, and the source topics."""
        topology = self.topology()
        s = self.settings
        users = {
            # The code location signs as the app user too: its checks read the sink.
            s.app_user: (
                self.secrets["STREAM_ASSETS_ROCKETMQ_SECRET_KEY"],
                [*acl.topology_grants(topology), *acl.checks_grants(topology)],
            ),
            s.feeder_user: (
                self.secrets["FEEDER_SECRET_KEY"],
                [acl.Grant(f"Topic:{t}", ("Pub",)) for t in topology.source_topics],
            ),
        }
        with RocketMQAdmin(self.admin_settings()) as admin:
            for user, (secret, grants) in users.items():
                acl.create_user(admin, user, secret, exist_ok=True)
                acl.grant(admin, user, grants)
            for topic in topology.source_topics:
                admin.create_topic(topic, s.source_queues, spread=True)

    def run_job(self, job: str, run_config: Mapping[str, Any], timeout_s: float = 900.0) -> str:
        """Launch ``job`` through the webserver's GraphQL API, as the UI does; wait for it.

        Returns the run id; raises with the run's failure if it did not succeed.
        """
        client = DagsterGraphQLClient(self.settings.host, port_number=self.settings.webserver_port)
        status: list[dg.DagsterRunStatus] = []
        try:
            run_id = client.submit_job_execution(job, run_config=dict(run_config))

            def finished() -> bool:
                status[:] = [client.get_run_status(run_id)]
                return status[0] in _FINISHED

            wait_for(finished, timeout_s, f"run {run_id} of {job}", self.dagster.daemon, poll_s=1.0)
        except DagsterGraphQLClientError as exc:
            raise DeployError(
                f"the Dagster webserver at {self.dagster.url} refused {job}: {exc}"
            ) from exc
        if status[0] != dg.DagsterRunStatus.SUCCESS:
            raise DeployError(f"{job} run {run_id} ended {status[0].value}: {self._why(run_id)}")
        return run_id

    def _why(self, run_id: str) -> str:
        """The run's step failures (what the op raised), else where to look."""
        with self.dagster.instance() as instance:
            errors = [
                e.dagster_event.step_failure_data.error.message.strip()
                for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
                if e.dagster_event is not None
                and e.dagster_event.step_failure_data is not None
                and e.dagster_event.step_failure_data.error is not None
            ]
        return "\n".join(errors) or f"see the run in {self.dagster.url}/runs/{run_id}"

    def scale(self, instances: int) -> str:
        """Scale the topology to ``instances`` (the scale job); the run id."""
        config = {"topology": self.settings.topology, "target_instances": instances}
        self.progress(f"[prod-like] scaling {self.settings.topology} to {instances} instance(s)")
        return self.run_job("scale_job", {"ops": {"scale": {"config": config}}})

    def stop_topology(self, through_dagster: bool = True) -> str:
        """Stop the topology (its instances commit and end; offsets and state are kept).

        Through the webserver (the stop job; returns its run id), or, when Dagster
        itself is what is slow, straight through its storage (returns "").
        """
        if not through_dagster:
            with self.dagster.instance() as instance:
                stop(instance, self.settings.topology, 300.0, False, PrintLog(self.progress))
            return ""
        config = {"topology": self.settings.topology}
        return self.run_job("stop_topology_job", {"ops": {"stop_topology": {"config": config}}})

    def start_topology(self, through_dagster: bool = True) -> str:
        """Start it again with the instance count it had (as :meth:`stop_topology`)."""
        if not through_dagster:
            with self.dagster.environment():
                engine = EngineSettings()  # the instances' own (dagster.env)
            with self.dagster.instance() as instance:
                name, log = self.settings.topology, PrintLog(self.progress)
                start(instance, name, 0, self.admin_settings(), engine, 0.0, log)
            return ""
        config = {"topology": self.settings.topology}
        return self.run_job("start_topology_job", {"ops": {"start_topology": {"config": config}}})

    def start_feeder(self) -> int:
        """Start the feeder (unless it runs); its pid. ``feeder.stop()`` stops it."""
        return self.feeder.start(self._feeder_env())

    def down(self) -> None:
        """Stop the feeder, the topology (its instances commit), then every host."""
        self.feeder.stop()
        if self.dagster.webserver.pid() is not None and self.dagster.daemon.pid() is not None:
            try:
                self.stop_topology()
            except DeployError as exc:
                self.progress(f"[prod-like] stopping the topology failed, stopping anyway: {exc}")
        self.dagster.stop()
        self.spark.stop()
        self.rocketmq.stop()
        self.postgres.stop()
        self.progress("[prod-like] down")

    def status(self) -> str:
        """One line per host, and where to look."""
        s = self.settings
        spark_alive = self.spark.alive_workers() if self.spark.master.pid() else 0
        lines = [
            f"postgres   {'running' if self.postgres.running() else 'stopped'}"
            f"  {s.host}:{s.postgres_port} (db dagster)",
            f"rocketmq   {self.rocketmq.status().describe()}",
            f"spark      master {'running' if self.spark.master.pid() else 'stopped'}"
            f" {s.spark_master_url}, {spark_alive}/{s.spark_workers} workers alive;"
            f" UI {self.spark.master_ui}",
            f"dagster    webserver {_state(self.dagster.webserver)} {self.dagster.url},"
            f" daemon {_state(self.dagster.daemon)},"
            f" code server {_state(self.dagster.code_server)} :{s.code_server_port}",
            f"feeder     {_state(self.feeder)} -> {self.topology().source_topic}"
            f" ({s.feed_lines_per_s:g} lines/s)",
            f"metrics    http://{s.host}:{s.metrics_port}/metrics (instance 0; instance i: +i)",
            f"home       {self.home} (logs beside each pid file; secrets in secrets.env)",
        ]
        return "\n".join(lines)


def _state(daemon: Daemon) -> str:
    """``running (pid 4242)``, or ``stopped`` with the last lines of its log when it ran."""
    pid = daemon.pid()
    if pid:
        return f"running (pid {pid})"
    if not daemon.log_file.exists():
        return "stopped"
    last = tail(daemon.log_file, 3).replace("\n", "\n             | ")
    return f"stopped; last lines of {daemon.log_file}:\n             | {last}\n            "
