"""Per-instance numbers, their rates, and the topology totals the Dagster UI plots.

Why the numbers travel this way: a topology runs as several instances, each
knowing only the queues it owns. When every instance observed the *sink* asset
with its own numbers under the same metadata keys, the UI drew one series that
jumped between instances (the zig-zag), and an idle instance's zero landed in
the middle of a busy one's rate. So every series has exactly one writer:

- **each instance run** (``jobs/instance_job.py``, ``_observe``) observes only
  its **topology** asset: ``instance`` and ``generation`` (as text: labels,
  not numbers to plot), and its own numbers under keys named for it,
  ``instance_<i>.lag``, ``instance_<i>.records_per_s``, ... (:func:`instance_metadata`);
- **the metrics sensor** (``jobs/metrics.py``) sums the latest observation of
  every live instance run (:func:`aggregate`) and records the topology asset's
  own numbers (:func:`topology_metadata`) as its *materialization*, and
  observes every sink topic (:func:`sink_metadata`) and every source topic
  (:func:`source_metadata`) with topology totals.

What a user reads first on the topology asset (:data:`HEADLINE`): total lag,
input and output rates, dead letters, running and desired instances. The UI
shows an event's metadata in insertion order, and the asset page's Metadata
table shows the latest materialization before any observation, so the
headline always leads that table however often the instances observe; the
Plots tab sorts its charts by key, so the headline keys start with their rank
(``1_lag``, ``2_records_per_s``, ...) and sort before the topology's other
totals (``all.<name>``) and the per-instance detail (``instance_<i>.<name>``).
Identifiers (instance index, generation, phase) are text: never plotted.

Rates come from cumulative counters and the wall time between two samples at
least ``rate_window_s`` apart (:class:`RateMeter`), never from "what finished
in the last interval", which reads 0 whenever no batch happened to end in it.

Example::

    >>> meter = RateMeter(window_s=30)
    >>> for t, total in [(0, 0), (10, 400), (20, 400), (30, 900), (40, 1200)]:
    ...     meter.add(t, total)
    >>> meter.rate()                      # 1200 - 400 records over 40 - 10 s
    Rate(per_s=26.666666666666668, over_s=30.0)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from stream_assets.plan.topology import Topology

#: Metadata key of an instance's index on its own observations (text).
INSTANCE_KEY = "instance"
#: Metadata key of an allocation generation (text: an identifier, not a number to plot).
GENERATION_KEY = "generation"
#: The run that wrote an instance's observation: it is runless, so that a run's
#: log is not an observation every 10 s (the Plots tab is where they are read).
RUN_KEY = "run"

#: The topology asset's headline, in reading order: total lag (uncommitted messages of
#: every stage input), input and output records/s, dead letters (since the running
#: instances started), instances running and desired. The rank in front makes the UI's
#: key-sorted plots list them first, in this order.
LAG_KEY = "1_lag"
RECORDS_PER_S_KEY = "2_records_per_s"
RECORDS_OUT_PER_S_KEY = "3_records_out_per_s"
DEAD_LETTERS_KEY = "4_dead_letters"
RUNNING_KEY = "5_running_instances"
DESIRED_KEY = "6_desired_instances"
HEADLINE = (
    LAG_KEY,
    RECORDS_PER_S_KEY,
    RECORDS_OUT_PER_S_KEY,
    DEAD_LETTERS_KEY,
    RUNNING_KEY,
    DESIRED_KEY,
)
#: Prefix of the topology's other totals: sorts after the headline and before the
#: per-instance detail (``instance_<i>.``).
TOTALS_PREFIX = "all."


# -- rates ---------------------------------------------------------------------


@dataclass(frozen=True)
class Rate:
    """A per-second rate and the wall time it was measured over."""

    per_s: float
    over_s: float


class RateMeter:
    """The per-second rate of a cumulative counter over at least ``window_s`` of wall time.

    Feed it ``(time, total)`` samples; the rate is the counter's increase from
    the newest sample at least ``window_s`` older than the latest one to the
    latest, divided by the elapsed time between those two samples. Counters
    move only when a batch ends, so a window spanning several batch ends gets
    their average instead of reading 0 whenever no batch ended in the last
    interval. Until the samples span ``window_s`` there is no rate (None, not
    0): a shorter span right after a start would again depend on whether a
    batch happened to end in it. A counter that goes down was restarted: the
    history starts again there.

    Example::

        >>> meter = RateMeter(window_s=30)
        >>> meter.add(100.0, 50); meter.add(110.0, 550)
        >>> meter.rate() is None               # 10 s of history: no rate yet, not 0
        True
        >>> meter.add(120.0, 550); meter.add(130.0, 1550)  # no batch ended in 110..120
        >>> meter.rate()
        Rate(per_s=50.0, over_s=30.0)
        >>> meter.add(145.0, 2300)             # uneven interval: from 110, the newest >= 30 s old
        >>> meter.rate()
        Rate(per_s=50.0, over_s=35.0)
    """

    def __init__(self, window_s: float = 30.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: list[tuple[float, float]] = []

    def add(self, ts: float, total: float) -> None:
        """Record that the counter stood at ``total`` at time ``ts`` (seconds)."""
        ts, total = float(ts), float(total)
        if self._samples and (total < self._samples[-1][1] or ts < self._samples[-1][0]):
            self._samples.clear()
        self._samples.append((ts, total))
        # Keep the newest sample that is already window_s old (the reference) and
        # everything after it: the history never grows beyond one window.
        cutoff = ts - self.window_s
        ref = self._reference_index(cutoff)
        del self._samples[:ref]

    def _reference_index(self, cutoff: float) -> int:
        ref = 0
        for i, (t, _) in enumerate(self._samples):
            if t <= cutoff:
                ref = i
            else:
                break
        return ref

    def rate(self) -> Rate | None:
        """The rate over the current window, or None while the samples span less."""
        if len(self._samples) < 2:
            return None
        t1, c1 = self._samples[-1]
        t0, c0 = self._samples[self._reference_index(t1 - self.window_s)]
        if t1 - t0 < self.window_s:
            return None
        return Rate((c1 - c0) / (t1 - t0), t1 - t0)


class RateMeters:
    """One :class:`RateMeter` per named counter, sampled together.

    Example::

        >>> meters = RateMeters(window_s=30)
        >>> meters.add(0.0, {"in": 0, "out": 0})
        {'in': None, 'out': None}
        >>> meters.add(30.0, {"in": 900, "out": 90})
        {'in': Rate(per_s=30.0, over_s=30.0), 'out': Rate(per_s=3.0, over_s=30.0)}
    """

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._meters: dict[str, RateMeter] = {}

    def add(self, ts: float, totals: Mapping[str, float]) -> dict[str, Rate | None]:
        """Sample every counter in ``totals`` at ``ts``; return each one's rate now."""
        out: dict[str, Rate | None] = {}
        for name, total in totals.items():
            meter = self._meters.setdefault(name, RateMeter(self.window_s))
            meter.add(ts, total)
            out[name] = meter.rate()
        return out


# -- one instance's numbers -----------------------------------------------------


@dataclass(frozen=True)
class InstanceNumbers:
    """What one instance reports: cumulative counters since it started, lag and state now.

    ``lag`` counts uncommitted messages of every stage input it owns (sources
    and shuffles), ``source_lag`` only those of source topics.
    """

    records_in: int = 0
    records_out: int = 0
    dead_letters: int = 0
    late: int = 0
    lag: int = 0
    source_lag: int = 0
    state_keys: int = 0
    state_bytes: int = 0
    lag_per_queue: dict[str, dict[int, int]] = field(default_factory=dict)
    records_in_by_source: dict[str, int] = field(default_factory=dict)

    def counters(self) -> dict[str, float]:
        """The cumulative counters a rate is taken of (``records_in:<source>`` per source)."""
        out: dict[str, float] = {"records_in": self.records_in, "records_out": self.records_out}
        out.update({f"records_in:{t}": n for t, n in self.records_in_by_source.items()})
        return out


def instance_numbers(
    topology: Topology,
    stage_totals: Mapping[int, Mapping[str, float]],
    state: tuple[int, int],
    lag_by_queue: Mapping[str, Mapping[int, int]],
) -> InstanceNumbers:
    """An instance's numbers from its stages' running totals, state size and lag.

    ``stage_totals`` is ``{stage index: StageMetrics.totals}``. Input records
    are those read by the source stages (each source topic has its own);
    outputs, dead letters and late records are summed over every stage.

    Example::

        >>> from stream_assets.examples import wordcount
        >>> n = instance_numbers(
        ...     wordcount.build(),
        ...     {0: {"records_in": 100.0, "dead_letters": 1.0}, 1: {"outputs": 40.0}},
        ...     (12, 3400),
        ...     {"sourceTopic": {0: 5, 1: 0}, "wordcount__shuffle__aggregate": {0: 2}},
        ... )
        >>> n.records_in, n.records_out, n.dead_letters, n.lag, n.source_lag, n.state_keys
        (100, 40, 1, 7, 5, 12)
    """
    sources = set(topology.source_topics)
    by_source: dict[str, int] = {}
    for stage in topology.stages:
        if stage.source is not None:
            got = int(stage_totals.get(stage.index, {}).get("records_in", 0))
            by_source[stage.input_topic] = by_source.get(stage.input_topic, 0) + got

    def total(name: str) -> int:
        return int(sum(t.get(name, 0) for t in stage_totals.values()))

    lag = {t: {int(q): int(v) for q, v in qs.items()} for t, qs in lag_by_queue.items()}
    return InstanceNumbers(
        records_in=sum(by_source.values()),
        records_out=total("outputs"),
        dead_letters=total("dead_letters"),
        late=total("late"),
        lag=sum(sum(qs.values()) for qs in lag.values()),
        source_lag=sum(sum(qs.values()) for t, qs in lag.items() if t in sources),
        state_keys=state[0],
        state_bytes=state[1],
        lag_per_queue=lag,
        records_in_by_source=by_source,
    )


def instance_key(index: int, name: str) -> str:
    """The metadata key of instance ``index``'s number ``name``.

    Example::

        >>> instance_key(1, "records_per_s")
        'instance_1.records_per_s'
    """
    return f"instance_{index}.{name}"


def _rounded(rate: Rate | None) -> float | None:
    return None if rate is None else round(rate.per_s, 2)


def instance_metadata(
    index: int,
    generation: int,
    numbers: InstanceNumbers,
    rates: Mapping[str, Rate | None],
) -> dict[str, Any]:
    """Metadata of one instance's observation of its topology asset.

    ``rates`` is what :meth:`RateMeters.add` returned for
    :meth:`InstanceNumbers.counters`. A rate not known yet (less than one
    window since the instance started) is left out rather than written as 0.

    Example::

        >>> md = instance_metadata(1, 4, InstanceNumbers(records_in=900, lag=3),
        ...                        {"records_in": Rate(30.0, 30.0), "records_out": None})
        >>> md["instance"].value, md["generation"].value, md["instance_1.records_per_s"]
        ('1', '4', 30.0)
        >>> list(md)[:4]
        ['instance', 'generation', 'instance_1.lag', 'instance_1.records_per_s']
        >>> "instance_1.records_out_per_s" in md
        False
    """

    def key(name: str) -> str:
        return instance_key(index, name)

    rate_in, rate_out = rates.get("records_in"), rates.get("records_out")
    md: dict[str, Any] = {
        # Text: index and generation label the observation; as numbers the UI would plot them.
        INSTANCE_KEY: dg.MetadataValue.text(str(index)),
        GENERATION_KEY: dg.MetadataValue.text(str(generation)),
        # The instance's share of the headline first, in the headline's order.
        key("lag"): numbers.lag,
    }
    if rate_in is not None:
        md[key("records_per_s")] = _rounded(rate_in)
    if rate_out is not None:
        md[key("records_out_per_s")] = _rounded(rate_out)
    md.update(
        {
            key("dead_letters"): numbers.dead_letters,
            key("source_lag"): numbers.source_lag,
            key("late"): numbers.late,
            key("records_in"): numbers.records_in,
            key("records_out"): numbers.records_out,
            key("state_keys"): numbers.state_keys,
            key("state_bytes"): numbers.state_bytes,
            key("lag_per_queue"): dg.MetadataValue.json(
                {t: {str(q): v for q, v in qs.items()} for t, qs in numbers.lag_per_queue.items()}
            ),
        }
    )
    if rate_in is not None:
        md[key("rate_window_s")] = round(rate_in.over_s, 1)
    by_source = {
        t: _rounded(rates.get(f"records_in:{t}"))
        for t in numbers.records_in_by_source
        if rates.get(f"records_in:{t}") is not None
    }
    if by_source:
        md[key("source_records_per_s")] = dg.MetadataValue.json(by_source)
    return md


@dataclass(frozen=True)
class InstanceReport:
    """One instance's latest observation, read back from its metadata."""

    index: int
    generation: int
    numbers: InstanceNumbers
    records_per_s: float | None = None
    records_out_per_s: float | None = None
    source_records_per_s: dict[str, float] = field(default_factory=dict)
    run_id: str = ""
    ts: float = 0.0


def _value(raw: Any) -> Any:
    """The plain value of a stored metadata entry (``MetadataValue``) or of a raw one."""
    return getattr(raw, "value", raw)


def parse_instance_metadata(
    metadata: Mapping[str, Any], run_id: str = "", ts: float = 0.0
) -> InstanceReport | None:
    """The :class:`InstanceReport` in an instance's observation, or None for any other one.

    Example::

        >>> md = instance_metadata(2, 7, InstanceNumbers(records_in=5, lag=1),
        ...                        {"records_in": Rate(0.5, 30.0)})
        >>> r = parse_instance_metadata(md)
        >>> r.index, r.generation, r.numbers.records_in, r.numbers.lag, r.records_per_s
        (2, 7, 5, 1, 0.5)
        >>> parse_instance_metadata({"lag": 3}) is None
        True
    """
    if INSTANCE_KEY not in metadata:
        return None
    try:
        index = int(_value(metadata[INSTANCE_KEY]))
    except (TypeError, ValueError):
        return None

    def get(name: str, default: Any = None) -> Any:
        raw = metadata.get(instance_key(index, name))
        return default if raw is None else _value(raw)

    lag_raw = get("lag_per_queue", {}) or {}
    numbers = InstanceNumbers(
        records_in=int(get("records_in", 0)),
        records_out=int(get("records_out", 0)),
        dead_letters=int(get("dead_letters", 0)),
        late=int(get("late", 0)),
        lag=int(get("lag", 0)),
        source_lag=int(get("source_lag", 0)),
        state_keys=int(get("state_keys", 0)),
        state_bytes=int(get("state_bytes", 0)),
        lag_per_queue={t: {int(q): int(v) for q, v in qs.items()} for t, qs in lag_raw.items()},
    )
    rate_in, rate_out = get("records_per_s"), get("records_out_per_s")
    return InstanceReport(
        index=index,
        generation=int(_value(metadata.get(GENERATION_KEY, -1))),
        numbers=numbers,
        records_per_s=None if rate_in is None else float(rate_in),
        records_out_per_s=None if rate_out is None else float(rate_out),
        source_records_per_s={
            str(t): float(v) for t, v in (get("source_records_per_s", {}) or {}).items()
        },
        run_id=run_id,
        ts=ts,
    )


# -- topology totals ----------------------------------------------------------------


@dataclass(frozen=True)
class TopologyTotals:
    """The sum of the reporting instances' numbers.

    Counters (``records_in``, ...) are since each running instance started, so
    they drop when one restarts; rates, lag and state size are the ones to
    watch. A rate is None when no instance knows its own yet; an instance that
    does not know its rate yet (its first window) counts as unknown, not 0.
    """

    instances: int
    numbers: InstanceNumbers
    records_per_s: float | None
    records_out_per_s: float | None
    source_records_per_s: dict[str, float]
    generations: tuple[int, ...]


def _sum_known(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known), 2) if known else None


def aggregate(reports: Sequence[InstanceReport]) -> TopologyTotals:
    """Topology totals of the latest report of each instance run.

    Queues are owned by one instance each, so lag per queue merges without
    overlap and every count adds up.

    Example::

        >>> a = InstanceReport(0, 3, InstanceNumbers(records_in=100, lag=4,
        ...     lag_per_queue={"src": {0: 4}}), records_per_s=10.0)
        >>> b = InstanceReport(1, 3, InstanceNumbers(records_in=50, lag=1,
        ...     lag_per_queue={"src": {1: 1}}), records_per_s=None)
        >>> t = aggregate([a, b])
        >>> t.instances, t.numbers.records_in, t.numbers.lag, t.records_per_s
        (2, 150, 5, 10.0)
        >>> t.numbers.lag_per_queue
        {'src': {0: 4, 1: 1}}
    """
    lag: dict[str, dict[int, int]] = {}
    for r in reports:
        for topic, qs in r.numbers.lag_per_queue.items():
            merged = lag.setdefault(topic, {})
            for q, v in qs.items():
                merged[q] = merged.get(q, 0) + v
    by_source: dict[str, float] = {}
    for r in reports:
        for topic, rate in r.source_records_per_s.items():
            by_source[topic] = round(by_source.get(topic, 0.0) + rate, 2)

    def total(name: str) -> int:
        return sum(int(getattr(r.numbers, name)) for r in reports)

    numbers = InstanceNumbers(
        records_in=total("records_in"),
        records_out=total("records_out"),
        dead_letters=total("dead_letters"),
        late=total("late"),
        lag=total("lag"),
        source_lag=total("source_lag"),
        state_keys=total("state_keys"),
        state_bytes=total("state_bytes"),
        lag_per_queue={t: dict(sorted(qs.items())) for t, qs in sorted(lag.items())},
    )
    return TopologyTotals(
        instances=len(reports),
        numbers=numbers,
        records_per_s=_sum_known(r.records_per_s for r in reports),
        records_out_per_s=_sum_known(r.records_out_per_s for r in reports),
        source_records_per_s=by_source,
        generations=tuple(sorted({r.generation for r in reports})),
    )


def _totals_metadata(totals: TopologyTotals) -> dict[str, Any]:
    n = totals.numbers
    md: dict[str, Any] = {
        "records_in": n.records_in,
        "records_out": n.records_out,
        "lag": n.lag,
        "source_lag": n.source_lag,
        "dead_letters": n.dead_letters,
        "late": n.late,
        "state_keys": n.state_keys,
        "state_bytes": n.state_bytes,
        "reporting_instances": totals.instances,
    }
    if totals.records_per_s is not None:
        md["records_per_s"] = totals.records_per_s
    if totals.records_out_per_s is not None:
        md["records_out_per_s"] = totals.records_out_per_s
    return md


def _lag_json(lag: Mapping[str, Mapping[int, int]]) -> dg.MetadataValue:
    return dg.MetadataValue.json({t: {str(q): v for q, v in qs.items()} for t, qs in lag.items()})


def topology_metadata(
    totals: TopologyTotals | None,
    *,
    desired_instances: int | None,
    generation: int | None,
    running_instances: int,
    phase: str = "run",
    paused: bool = False,
    instances: Sequence[InstanceReport] = (),
) -> dict[str, Any]:
    """The topology asset's own numbers: the :data:`HEADLINE` first, then its state and details.

    Order is what the asset page shows: lag, rates and dead letters (when any
    instance reports; a rate only once known), running and desired instances;
    then ``phase``, ``paused`` and ``generation`` (text); then the other totals
    under ``all.``, the lag per queue and one line per instance (JSON).

    Example::

        >>> md = topology_metadata(None, desired_instances=2, generation=5, running_instances=0)
        >>> list(md)
        ['5_running_instances', '6_desired_instances', 'phase', 'paused', 'generation']
        >>> t = aggregate([InstanceReport(0, 5, InstanceNumbers(lag=4, dead_letters=1), 9.5)])
        >>> md = topology_metadata(t, desired_instances=1, generation=5, running_instances=1)
        >>> list(md)[:4], md["generation"].value
        (['1_lag', '2_records_per_s', '4_dead_letters', '5_running_instances'], '5')
    """
    md: dict[str, Any] = {}
    if totals is not None:
        md[LAG_KEY] = totals.numbers.lag
        if totals.records_per_s is not None:
            md[RECORDS_PER_S_KEY] = totals.records_per_s
        if totals.records_out_per_s is not None:
            md[RECORDS_OUT_PER_S_KEY] = totals.records_out_per_s
        md[DEAD_LETTERS_KEY] = totals.numbers.dead_letters
    md[RUNNING_KEY] = running_instances
    md[DESIRED_KEY] = -1 if desired_instances is None else desired_instances
    md["phase"] = dg.MetadataValue.text(phase)
    md["paused"] = dg.MetadataValue.bool(paused)
    md[GENERATION_KEY] = dg.MetadataValue.text("none" if generation is None else str(generation))
    if totals is None:
        return md
    n = totals.numbers
    details = {
        "source_lag": n.source_lag,
        "late": n.late,
        "records_in": n.records_in,
        "records_out": n.records_out,
        "state_keys": n.state_keys,
        "state_bytes": n.state_bytes,
        "reporting_instances": totals.instances,
    }
    md.update({f"{TOTALS_PREFIX}{k}": v for k, v in details.items()})
    md["lag_per_queue"] = _lag_json(n.lag_per_queue)
    md["instances"] = dg.MetadataValue.json(
        {
            str(r.index): {
                "generation": r.generation,
                "run_id": r.run_id,
                "records_per_s": r.records_per_s,
                "lag": r.numbers.lag,
                "state_bytes": r.numbers.state_bytes,
            }
            for r in sorted(instances, key=lambda r: r.index)
        }
    )
    return md


def sink_metadata(job_id: str, totals: TopologyTotals) -> dict[str, Any]:
    """A sink topic's observation: the writing topology's totals (the keys instances used to write).

    Example::

        >>> t = aggregate([InstanceReport(0, 1, InstanceNumbers(records_out=7), 2.0, 0.5)])
        >>> md = sink_metadata("wordcount", t)
        >>> md["records_out"], md["records_per_s"], md["records_out_per_s"], md["topology"].value
        (7, 2.0, 0.5, 'wordcount')
    """
    md = _totals_metadata(totals)
    md["lag_per_queue"] = _lag_json(totals.numbers.lag_per_queue)
    md["topology"] = dg.MetadataValue.text(job_id)
    return md


def source_metadata(job_id: str, topic: str, totals: TopologyTotals) -> dict[str, Any]:
    """A source topic's observation by one reading topology: its lag and input rate there.

    Example::

        >>> r = InstanceReport(0, 1, InstanceNumbers(lag_per_queue={"in": {0: 3, 1: 2}}),
        ...                    source_records_per_s={"in": 12.5})
        >>> md = source_metadata("wc", "in", aggregate([r]))
        >>> md["lag"], md["records_per_s"]
        (5, 12.5)
    """
    lag = totals.numbers.lag_per_queue.get(topic, {})
    md: dict[str, Any] = {
        "lag": sum(lag.values()),
        "lag_per_queue": _lag_json({topic: lag}),
        "topology": dg.MetadataValue.text(job_id),
    }
    rate = totals.source_records_per_s.get(topic)
    if rate is not None:
        md["records_per_s"] = rate
    return md


def scoped(metadata: Mapping[str, Any], job_id: str) -> dict[str, Any]:
    """``metadata`` with numeric keys prefixed ``<job_id>.``: for a topic several topologies
    share, so each topology's numbers stay their own series.

    Example::

        >>> scoped({"lag": 3, "topology": "x"}, "wc")
        {'wc.lag': 3, 'topology': 'x'}
    """
    return {k if k == "topology" else f"{job_id}.{k}": v for k, v in metadata.items()}


def metadata_json(value: Any) -> str:
    """Stable JSON of a plain metadata value (for cursors and comparisons)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
