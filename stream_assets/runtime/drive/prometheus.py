"""Prometheus metrics of one instance, served over HTTP in Prometheus' text format.

Every :class:`~stream_assets.runtime.spark.instance.Instance` owns a
:class:`PrometheusExporter` and serves it at ``http://<host>:<port>/metrics``
(:func:`endpoint_port`: the topology's base port plus the instance index, so a
static scrape config can list every instance). The exporter is fed where the
instance already sums what its tasks report for the Dagster observations
(``Instance._record``, from the same stats rows), where it polls its lag
(``Instance.lag_by_queue``) and where it restarts a stage query; both views
therefore count the same batches. Dagster gets per-instance totals; Prometheus
gets the detail per stage and queue, as counters Prometheus takes rates of.

Each exporter has a registry of its own, never the process-wide default one:
several instances in one process (tests, the CLI, benchmarks) then neither
clash over metric names nor serve each other's numbers.

Labels: ``topology`` (job id), ``instance`` (index), ``generation`` (the
allocation generation the numbers were counted in), and where they apply
``stage``, ``input`` (``source`` or ``shuffle``: what the stage reads),
``topic`` (the stage's input topic) and ``queue`` (its queue index).
A counter's series belongs to one generation: after a rebalance the new
generation's series start at 0 and the old ones stay, unchanging, until the
process ends; ``sum without (generation)`` adds them up. Gauges (lag, state)
cover only the queues the current generation owns.

Example::

    >>> from stream_assets.examples import wordcount
    >>> export = PrometheusExporter(wordcount.build(), index=1, generation=3)
    >>> export.record_batch(0, [{"queue_id": 2, "records_in": 40}], seconds=0.3)
    >>> labels = {"topology": "wordcount", "instance": "1", "generation": "3", "stage": "0",
    ...           "input": "source", "topic": "sourceTopic", "queue": "2"}
    >>> export.registry.get_sample_value("stream_assets_records_in_total", labels)
    40.0
"""

from __future__ import annotations

import bisect
import math
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from stream_assets.plan.topology import Topology
from stream_assets.settings import EngineSettings

#: Labels of every series.
INSTANCE_LABELS = ("topology", "instance", "generation")
#: Labels of a stage's series (batch durations, query restarts).
STAGE_LABELS = (*INSTANCE_LABELS, "stage")
#: Labels of a queue's series (counters from the tasks, lag, state).
QUEUE_LABELS = (*STAGE_LABELS, "input", "topic", "queue")


@dataclass(frozen=True)
class CounterSpec:
    """A per-queue counter: the task stat it sums (a ``TaskStats`` field), its name and help."""

    stat: str
    name: str
    help: str


#: The per-queue counters, each the sum of one ``TaskStats`` field over the queue's batches.
#: Names without ``_total``: the exposition adds it.
COUNTERS: tuple[CounterSpec, ...] = (
    CounterSpec(
        "records_in",
        "stream_assets_records_in",
        "Records read from the queue (a pre-combined shuffle entry counts the records it "
        "stands for).",
    ),
    CounterSpec(
        "batched_in",
        "stream_assets_records_batched",
        "Of the records read, those counted a whole batch at a time (batch operators).",
    ),
    CounterSpec(
        "outputs", "stream_assets_records_out", "Records written to sinks or printed by the stage."
    ),
    CounterSpec(
        "dead_letters", "stream_assets_dead_letters", "Records sent to the dead-letter topic."
    ),
    CounterSpec(
        "late",
        "stream_assets_late_records",
        "Records for a window that had already closed (not counted in it).",
    ),
    CounterSpec(
        "restores",
        "stream_assets_state_restores",
        "Batches that found the local store behind the state topic and restored it in full.",
    ),
    CounterSpec(
        "catch_ups",
        "stream_assets_state_catch_ups",
        "Batches that brought the local store up to date with the deltas written since it.",
    ),
    CounterSpec(
        "restore_s",
        "stream_assets_state_restore_seconds",
        "Seconds spent restoring or catching up local stores.",
    ),
)

#: Upper bounds of the batch-duration histogram: a micro-batch takes from tens of
#: milliseconds (an idle tick) to minutes (a restore, a backlog under load).
BATCH_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

#: What to set when an endpoint cannot start: every bind and port error names it.
SETTINGS_HINT = (
    "instance i of a topology serves on its base port + i: give the topology a range of its "
    "own with STREAM_ASSETS_ENGINE_METRICS_PORTS='{\"<job id>\": <base port>}', move every "
    "topology's with STREAM_ASSETS_ENGINE_METRICS_PORT=<base port>, or turn the endpoints off "
    "with STREAM_ASSETS_ENGINE_METRICS_PORT=0"
)


class MetricsEndpointError(RuntimeError):
    """An instance's metrics endpoint cannot start; the message says which port and what to set."""


def endpoint_port(engine: EngineSettings, job_id: str, index: int) -> int | None:
    """The port instance ``index`` of ``job_id`` serves its metrics on; None when turned off.

    The topology's base port (``metrics_ports[job_id]``, else ``metrics_port``)
    plus the index; a base of 0 turns the endpoints off.

    Example::

        >>> engine = EngineSettings(metrics_port=9450, metrics_ports={"clicks": 9500})
        >>> endpoint_port(engine, "wordcount", 2), endpoint_port(engine, "clicks", 2)
        (9452, 9502)
        >>> endpoint_port(EngineSettings(metrics_port=0), "wordcount", 2) is None
        True
    """
    base = engine.metrics_ports.get(job_id, engine.metrics_port)
    if base == 0:
        return None
    port = base + index
    if port > 65535:
        raise MetricsEndpointError(
            f"no Prometheus endpoint for {job_id} instance {index}: base port {base} + "
            f"{index} = {port} is past 65535; {SETTINGS_HINT}"
        )
    return port


@dataclass
class _Histogram:
    """Counts per bucket (not cumulative), their sum and how many observations."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BATCH_SECONDS_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le = "less or equal").
        self.counts[bisect.bisect_left(BATCH_SECONDS_BUCKETS, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*BATCH_SECONDS_BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if math.isinf(bound) else repr(bound), running))
        return out


@dataclass(frozen=True)
class _Snapshot:
    """What one scrape reads, copied under the exporter's lock."""

    counters: dict[tuple[int, int, int], dict[str, float]]
    batches: dict[tuple[int, int], tuple[list[tuple[str, float]], float]]
    restarts: dict[tuple[int, int], int]
    state: dict[tuple[int, int], tuple[int, int]]
    lag: dict[str, dict[int, int]]
    lag_at: float | None
    generation: int


def _url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::"):
        # Bound to every interface: the machine's name is what another host reaches it by.
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


class PrometheusExporter(Collector):
    """One instance's Prometheus metrics, in a registry of their own, and their HTTP endpoint.

    Fed by the instance (:meth:`record_batch`, :meth:`record_lag`,
    :meth:`record_restart`, :meth:`reassigned`); :meth:`serve` starts the
    endpoint, :meth:`close` stops it. Safe to feed from Spark's batch threads
    while a scrape reads it.

    Example::

        >>> from urllib.request import urlopen
        >>> from stream_assets.examples import wordcount
        >>> export = PrometheusExporter(wordcount.build(), index=0)
        >>> export.record_lag({"sourceTopic": {0: 7}})
        >>> url = export.serve("127.0.0.1", 0)          # 0: any free port
        >>> 'queue="0"' in urlopen(url).read().decode()
        True
        >>> export.close()
    """

    def __init__(self, topology: Topology, index: int, generation: int = 0) -> None:
        self.job_id = topology.job_id
        self.index = index
        self.generation = generation
        #: Per stage: (input, topic): the labels its queues' series carry.
        self._inputs = {
            s.index: ("source" if s.source is not None else "shuffle", s.input_topic)
            for s in topology.stages
        }
        self._stage_of_topic = {s.input_topic: s.index for s in reversed(topology.stages)}
        self._lock = threading.Lock()
        #: (generation, stage, queue) -> TaskStats field -> running sum.
        self._counters: dict[tuple[int, int, int], dict[str, float]] = {}
        self._batches: dict[tuple[int, int], _Histogram] = {}
        self._restarts: dict[tuple[int, int], int] = {}
        #: (stage, queue) -> latest (keys, bytes) of its store.
        self._state: dict[tuple[int, int], tuple[int, int]] = {}
        #: topic -> queue -> messages not committed, as last polled.
        self._lag: dict[str, dict[int, int]] = {}
        self._lag_at: float | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    # -- feeding -----------------------------------------------------------

    def record_batch(self, stage: int, rows: Iterable[Mapping[str, Any]], seconds: float) -> None:
        """Add one micro-batch of ``stage``: its per-queue stats rows and its wall seconds.

        A row is what a task reports (``TaskStats`` as a dict); fields other
        than the counters' and the state size are ignored, the settings
        digest among them.
        """
        with self._lock:
            generation = self.generation
            for row in rows:
                queue = int(row.get("queue_id", 0))
                sums = self._counters.setdefault((generation, stage, queue), {})
                for spec in COUNTERS:
                    sums[spec.stat] = sums.get(spec.stat, 0.0) + float(row.get(spec.stat, 0) or 0)
                keys, size = int(row.get("state_keys", 0) or 0), int(row.get("state_bytes", 0) or 0)
                # As Instance._record: a task that touched no store reports 0, not "empty".
                if keys or size:
                    self._state[(stage, queue)] = (keys, size)
            self._batches.setdefault((generation, stage), _Histogram()).observe(seconds)

    def record_lag(self, lag: Mapping[str, Mapping[int, int]], at: float | None = None) -> None:
        """Replace the lag: messages not committed per stage input topic and queue."""
        with self._lock:
            self._lag = {t: {int(q): int(v) for q, v in qs.items()} for t, qs in lag.items()}
            self._lag_at = time.time() if at is None else at

    def record_restart(self, stage: int) -> None:
        """Count a restart of ``stage``'s query."""
        with self._lock:
            key = (self.generation, stage)
            self._restarts[key] = self._restarts.get(key, 0) + 1

    def reassigned(self, generation: int, assignment: Mapping[str, Sequence[int]] | None) -> None:
        """A rebalance in place: later numbers count in ``generation``, gauges only for the
        queues of ``assignment`` (None: every queue)."""
        with self._lock:
            self.generation = generation
            self._lag, self._lag_at = {}, None
            if assignment is not None:
                self._state = {
                    (stage, queue): v
                    for (stage, queue), v in self._state.items()
                    if queue in assignment.get(self._inputs[stage][1], ())
                }

    # -- exposition --------------------------------------------------------

    def _queue_labels(self, generation: int, stage: int, queue: int) -> list[str]:
        kind, topic = self._inputs.get(stage, ("", ""))
        return [self.job_id, str(self.index), str(generation), str(stage), kind, topic, str(queue)]

    def collect(self) -> Iterable[Metric]:
        """Every metric family, from one consistent snapshot (called by the registry)."""
        snap = self._snapshot()
        yield from self._counter_families(snap)
        yield from self._batch_families(snap)
        yield from self._lag_families(snap)
        yield from self._state_families(snap)

    def _snapshot(self) -> _Snapshot:
        with self._lock:
            return _Snapshot(
                counters={k: dict(v) for k, v in self._counters.items()},
                batches={k: (h.buckets(), h.total) for k, h in self._batches.items()},
                restarts=dict(self._restarts),
                state=dict(self._state),
                lag={t: dict(qs) for t, qs in self._lag.items()},
                lag_at=self._lag_at,
                generation=self.generation,
            )

    def _counter_families(self, snap: _Snapshot) -> Iterable[Metric]:
        for spec in COUNTERS:
            family = CounterMetricFamily(spec.name, spec.help, labels=QUEUE_LABELS)
            for (gen, stage, queue), sums in sorted(snap.counters.items()):
                family.add_metric(self._queue_labels(gen, stage, queue), sums.get(spec.stat, 0.0))
            yield family

    def _batch_families(self, snap: _Snapshot) -> Iterable[Metric]:
        instance = [self.job_id, str(self.index)]
        durations = HistogramMetricFamily(
            "stream_assets_batch_duration_seconds",
            "Wall time of a stage's micro-batch (real-time mode: of a task's step): its "
            "tasks, the offset commit, the bookkeeping.",
            labels=STAGE_LABELS,
        )
        for (gen, stage), (buckets, total) in sorted(snap.batches.items()):
            durations.add_metric([*instance, str(gen), str(stage)], buckets, total)
        yield durations
        restarted = CounterMetricFamily(
            "stream_assets_query_restarts",
            "Stage queries started again after Spark's Python worker did not start in time.",
            labels=STAGE_LABELS,
        )
        for (gen, stage), count in sorted(snap.restarts.items()):
            restarted.add_metric([*instance, str(gen), str(stage)], count)
        yield restarted

    def _lag_families(self, snap: _Snapshot) -> Iterable[Metric]:
        lag_family = GaugeMetricFamily(
            "stream_assets_lag_messages",
            "Messages of the queue not committed by the topology's group, as last polled.",
            labels=QUEUE_LABELS,
        )
        for topic, queues in sorted(snap.lag.items()):
            reader = self._stage_of_topic.get(topic)
            if reader is None:
                continue
            for queue, value in sorted(queues.items()):
                lag_family.add_metric(self._queue_labels(snap.generation, reader, queue), value)
        yield lag_family
        polled = GaugeMetricFamily(
            "stream_assets_lag_polled_timestamp_seconds",
            "When the lag was last polled (Unix time): the lag is as old as this.",
            labels=INSTANCE_LABELS,
        )
        if snap.lag_at is not None:
            polled.add_metric([self.job_id, str(self.index), str(snap.generation)], snap.lag_at)
        yield polled

    def _state_families(self, snap: _Snapshot) -> Iterable[Metric]:
        keys = GaugeMetricFamily(
            "stream_assets_state_keys",
            "Keys in the queue's state store (RocksDB's estimate), as of its latest batch.",
            labels=QUEUE_LABELS,
        )
        size = GaugeMetricFamily(
            "stream_assets_state_bytes",
            "Bytes of the queue's state store on disk, as of its latest batch.",
            labels=QUEUE_LABELS,
        )
        for (stage, queue), (n_keys, n_bytes) in sorted(snap.state.items()):
            labels = self._queue_labels(snap.generation, stage, queue)
            keys.add_metric(labels, n_keys)
            size.add_metric(labels, n_bytes)
        yield keys
        yield size

    # -- the endpoint ------------------------------------------------------

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) from a daemon thread; the URL.

        Raises :class:`MetricsEndpointError` naming the port and what to set
        when it cannot bind.
        """
        if self.url is not None:
            return self.url
        try:
            self._server, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            raise MetricsEndpointError(
                f"no Prometheus endpoint for {self.job_id} instance {self.index}: cannot listen "
                f"on {host}:{port} ({exc.strerror or exc}); {SETTINGS_HINT}"
            ) from None
        self.url = _url(host, int(self._server.server_address[1]))
        return self.url

    def close(self) -> None:
        """Stop serving (the numbers stay: a later :meth:`serve` shows them again)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        self.url = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)
