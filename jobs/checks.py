"""Asset checks of every registered topology: lag, dead letters, output freshness.

Per topology (``<job>`` is its job id as an asset-key component):

- ``<job>__lag_within_bound`` on each **source** topic: the topology's consumer
  group has at most ``max_lag`` messages of the topic not yet committed (ERROR).
- ``<job>__no_new_dead_letters`` on its **dead-letter** topic: no message was
  added to ``<job>__dead-letters`` since the previous evaluation of this check
  (WARN: the stream moved on; each one names its operator and reason). The end
  offsets seen are kept in the evaluation's metadata, which is what the next
  evaluation compares with; the first evaluation only records them.
- ``<job>__output_fresh`` on each **sink** topic: the sink got a message within
  ``fresh_within_s``, or no input has been waiting that long (ERROR). "Input
  waiting" is the oldest uncommitted message of any stage input (sources and
  shuffles) of the topology's group, by broker store time: an idle topology is
  not stale, and one that sits on input for longer than the bound is, even
  when its lag is small. A windowed topology whose windows are longer than the
  bound needs a larger ``fresh_within_s``.

Everything is read from the broker (:class:`RocketMQProbe`), none of it from
the instances, so the checks hold while no instance runs.

Bounds come from :class:`CheckSettings` (``STREAM_ASSETS_CHECK_*``), with
per-topology overrides as JSON in ``STREAM_ASSETS_CHECK_OVERRIDES``.

How they run: each topology's checks are one ``@multi_asset_check``
(:func:`topology_checks`), so they appear on their assets in the UI and can be
executed there or as ``topology_checks_job``. Periodically,
``topology_checks_sensor`` (every ``STREAM_ASSETS_CHECK_INTERVAL_S``) evaluates
the same checks of every *deployed* topology (a desired state with at least
one instance) in the daemon and reports the results as check evaluations: no
run, no process started per evaluation. Both paths share :func:`evaluate_topology`.

Example::

    >>> from stream_assets.examples import wordcount
    >>> for spec in check_specs(wordcount.build()):
    ...     print(spec.asset_key.to_user_string(), spec.name)
    topics/sourceTopic wordcount__lag_within_bound
    topics/wordcount__dead_letters wordcount__no_new_dead_letters
    topics/wordcount_out wordcount__output_fresh
"""

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, Self

import dagster as dg

from resources.rocketmq import RocketMQResource
from stream_assets.control.desired_state import DesiredStateStore
from stream_assets.control.lineage import key_component, topic_asset_key
from stream_assets.control.registry import REGISTRY, TopologyRegistration
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.rocketmq.layout import current_layout
from stream_assets.rocketmq.reader import PullStatus, QueueReader
from stream_assets.settings import CheckSettings

LAG = "lag_within_bound"
DEAD_LETTERS = "no_new_dead_letters"
FRESH = "output_fresh"

#: Metadata key under which a dead-letter check keeps the end offsets it saw.
DEAD_LETTER_ENDS = "dead_letter_end_offsets"


def check_name(job_id: str, kind: str) -> str:
    """The name of ``job_id``'s check ``kind`` (unique on a topic several topologies share).

    Example::

        >>> check_name("windowed-sum", LAG)
        'windowed_sum__lag_within_bound'
    """
    return f"{key_component(job_id)}__{kind}"


def check_specs(topology: Topology) -> list[dg.AssetCheckSpec]:
    """The check specs of one topology, on its source, dead-letter and sink topics."""
    job = topology.job_id
    specs = [
        dg.AssetCheckSpec(
            check_name(job, LAG),
            asset=topic_asset_key(topic),
            description=f"`{job}` has not fallen behind on `{topic}`: its uncommitted messages "
            "stay within the bound (STREAM_ASSETS_CHECK_MAX_LAG).",
        )
        for topic in topology.source_topics
    ]
    specs.append(
        dg.AssetCheckSpec(
            check_name(job, DEAD_LETTERS),
            asset=topic_asset_key(topology.dead_letter_topic),
            description=f"No record of `{job}` became a dead letter since the previous check.",
        )
    )
    specs.extend(
        dg.AssetCheckSpec(
            check_name(job, FRESH),
            asset=topic_asset_key(topic),
            description=f"`{job}` wrote `{topic}` recently, or has had no input waiting for "
            "longer than the bound (STREAM_ASSETS_CHECK_FRESH_WITHIN_S).",
        )
        for topic in topology.sink_topics
    )
    return specs


# -- what the checks read ------------------------------------------------------------


class BrokerView(Protocol):
    """What the checks read from the broker (a fake in unit tests)."""

    def topic_exists(self, topic: str) -> bool:
        """Whether ``topic`` exists."""

    def lag(self, group: str, topic: str) -> dict[int, int]:
        """Per queue, messages ``group`` has not committed yet."""

    def end_offsets(self, topic: str) -> dict[int, int]:
        """Per queue, its max offset (message count so far); ``{}`` for a missing topic."""

    def latest_store_ms(self, topic: str) -> int | None:
        """Store time of the newest message of ``topic``; None if it holds none."""

    def oldest_waiting_ms(self, group: str, topics: Sequence[str]) -> int | None:
        """Store time of the oldest message of ``topics`` that ``group`` has not committed."""


class RocketMQProbe:
    """:class:`BrokerView` of a real broker: offsets, consumer offsets, one-message pulls.

    Example::

        >>> with RocketMQProbe(RocketMQAdmin(settings)) as probe:  # doctest: +SKIP
        ...     probe.lag("wordcount", "sourceTopic")
        {0: 0, 1: 12}
    """

    def __init__(self, admin: RocketMQAdmin) -> None:
        self.admin = admin
        self.reader = QueueReader(admin, "stream-assets-checks", max_batch=16)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the reader's connections (not the admin: the caller's)."""
        self.reader.close()

    def topic_exists(self, topic: str) -> bool:
        return self.admin.topic_exists(topic)

    def _positions(self, group: str, topic: str) -> list[tuple[MessageQueue, int, int]]:
        """(queue, first uncommitted offset, max offset) of every queue of ``topic``."""
        queues = current_layout(self.admin, topic).queues
        committed = self.admin.group_offsets(group, topic, queues)
        ranges = self.admin.topic_offsets(topic, queues)
        out = []
        for q in queues:
            floor = committed[q]
            # Never committed: the group would start at the first stored message.
            floor = ranges[q].min_offset if floor is None else max(floor, ranges[q].min_offset)
            out.append((q, floor, ranges[q].max_offset))
        return out

    def lag(self, group: str, topic: str) -> dict[int, int]:
        """Per queue index (the topic's layout: ids repeat across broker groups)."""
        return {
            i: max(0, end - floor)
            for i, (_, floor, end) in enumerate(self._positions(group, topic))
        }

    def end_offsets(self, topic: str) -> dict[int, int]:
        if not self.admin.topic_exists(topic):
            return {}
        layout = current_layout(self.admin, topic)
        offsets = self.admin.topic_offsets(topic, layout.queues)
        return {layout.index(q): o.max_offset for q, o in offsets.items()}

    def _store_ms(self, queue: MessageQueue, offset: int) -> int | None:
        batch = self.reader.pull(queue, offset, 1)
        if batch.status is not PullStatus.FOUND or not batch.records:
            return None
        return batch.records[0].store_timestamp

    def latest_store_ms(self, topic: str) -> int | None:
        if not self.admin.topic_exists(topic):
            return None
        times = [
            self._store_ms(q, o.max_offset - 1)
            for q, o in self.admin.topic_offsets(topic).items()
            if o.max_offset > o.min_offset
        ]
        known = [t for t in times if t is not None]
        return max(known) if known else None

    def oldest_waiting_ms(self, group: str, topics: Sequence[str]) -> int | None:
        times = []
        for topic in topics:
            if not self.admin.topic_exists(topic):
                continue
            for q, floor, end in self._positions(group, topic):
                if floor < end:
                    times.append(self._store_ms(q, floor))
        known = [t for t in times if t is not None]
        return min(known) if known else None


# -- evaluation ----------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One check's result, before it becomes a Dagster result or evaluation."""

    asset_key: dg.AssetKey
    check_name: str
    passed: bool
    description: str
    severity: dg.AssetCheckSeverity = dg.AssetCheckSeverity.ERROR
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> dg.AssetCheckKey:
        """The check's key."""
        return dg.AssetCheckKey(self.asset_key, self.check_name)

    def result(self) -> dg.AssetCheckResult:
        """As the result of an executed check (a run)."""
        return dg.AssetCheckResult(**self._fields())

    def evaluation(self) -> dg.AssetCheckEvaluation:
        """As a reported evaluation (the sensor, without a run)."""
        return dg.AssetCheckEvaluation(**self._fields())

    def _fields(self) -> dict[str, Any]:
        # The same outcome, as a run's result or as a runless evaluation.
        return {
            "asset_key": self.asset_key,
            "check_name": self.check_name,
            "passed": self.passed,
            "severity": self.severity,
            "description": self.description,
            "metadata": self.metadata,
        }


def _queues_json(values: Mapping[int, int]) -> dg.MetadataValue:
    return dg.MetadataValue.json({str(q): v for q, v in sorted(values.items())})


def lag_outcome(job_id: str, topic: str, lag: Mapping[int, int] | None, max_lag: int) -> Outcome:
    """The lag check of ``job_id`` on source ``topic`` (``lag`` None: the topic is missing).

    Example::

        >>> o = lag_outcome("wc", "in", {0: 700, 1: 400}, max_lag=1000)
        >>> o.passed, o.description
        (False, 'lag 1100 > bound 1000 (wc on in)')
        >>> lag_outcome("wc", "in", {0: 3}, max_lag=1000).passed
        True
    """
    key, name = topic_asset_key(topic), check_name(job_id, LAG)
    if lag is None:
        return Outcome(key, name, False, f"source topic {topic!r} does not exist")
    total = sum(lag.values())
    passed = total <= max_lag
    return Outcome(
        key,
        name,
        passed,
        f"lag {total} {'<=' if passed else '>'} bound {max_lag} ({job_id} on {topic})",
        metadata={"lag": total, "max_lag": max_lag, "lag_per_queue": _queues_json(lag)},
    )


def dead_letter_outcome(
    job_id: str, topic: str, ends: Mapping[int, int], previous: Mapping[int, int] | None
) -> Outcome:
    """The dead-letter check: messages added to ``topic`` since ``previous`` end offsets.

    ``previous`` None (never evaluated) records a baseline and passes. A queue
    whose end went down (the topic was recreated) counts from 0. A queue not
    reported now (the topic unknown for a moment: a restarting broker's name
    server forgets its routes) keeps its previous end, so it is not counted
    again once it is back.

    Example::

        >>> dead_letter_outcome("wc", "wc__dead-letters", {0: 3, 1: 1}, {0: 3, 1: 0}).description
        '1 new dead letter(s) since the previous check (4 in all)'
        >>> dead_letter_outcome("wc", "wc__dead-letters", {0: 3}, {0: 3}).passed
        True
        >>> dead_letter_outcome("wc", "wc__dead-letters", {0: 3}, None).description
        'baseline: 3 dead letter(s) so far; new ones fail the next evaluation'
        >>> dead_letter_outcome("wc", "wc__dead-letters", {}, {0: 3}).metadata["dead_letters"]
        3
    """
    key, name = topic_asset_key(topic), check_name(job_id, DEAD_LETTERS)
    seen = {**(previous or {}), **ends}
    total = sum(seen.values())
    metadata: dict[str, Any] = {"dead_letters": total, DEAD_LETTER_ENDS: _queues_json(seen)}
    if previous is None:
        return Outcome(
            key,
            name,
            True,
            f"baseline: {total} dead letter(s) so far; new ones fail the next evaluation",
            dg.AssetCheckSeverity.WARN,
            {**metadata, "new_dead_letters": 0},
        )
    new = 0
    for q, end in ends.items():
        before = previous.get(q, 0)
        new += end if end < before else end - before
    return Outcome(
        key,
        name,
        new == 0,
        f"{new} new dead letter(s) since the previous check ({total} in all)",
        dg.AssetCheckSeverity.WARN,
        {**metadata, "new_dead_letters": new},
    )


def freshness_outcome(
    job_id: str,
    sink: str,
    sink_latest_ms: int | None,
    oldest_waiting_ms: int | None,
    now_ms: int,
    fresh_within_s: float,
) -> Outcome:
    """The freshness check of ``sink``: written within the bound, or no input waiting that long.

    Example::

        >>> now = 1_000_000_000
        >>> freshness_outcome("wc", "out", now - 60_000, None, now, 300).description
        'last output 60 s ago (bound 300 s)'
        >>> freshness_outcome("wc", "out", now - 3_600_000, None, now, 300).description
        'last output 3600 s ago, but no input is waiting: idle, not stale'
        >>> o = freshness_outcome("wc", "out", now - 3_600_000, now - 400_000, now, 300)
        >>> o.passed, o.description
        (False, 'no output for 3600 s while input has waited 400 s (bound 300 s)')
    """
    key, name = topic_asset_key(sink), check_name(job_id, FRESH)
    bound = f"bound {fresh_within_s:g} s"
    age = None if sink_latest_ms is None else max(0.0, (now_ms - sink_latest_ms) / 1000)
    waited = None if oldest_waiting_ms is None else max(0.0, (now_ms - oldest_waiting_ms) / 1000)
    metadata: dict[str, Any] = {"fresh_within_s": fresh_within_s}
    if age is not None and sink_latest_ms is not None:
        metadata["output_age_s"] = round(age, 1)
        metadata["last_output_at"] = dg.MetadataValue.timestamp(sink_latest_ms / 1000)
    if waited is not None:
        metadata["input_waiting_s"] = round(waited, 1)
    last = "no output yet" if age is None else f"last output {age:.0f} s ago"
    if age is not None and age <= fresh_within_s:
        return Outcome(key, name, True, f"{last} ({bound})", metadata=metadata)
    if waited is None:
        return Outcome(
            key, name, True, f"{last}, but no input is waiting: idle, not stale", metadata=metadata
        )
    if waited <= fresh_within_s:
        description = f"{last}; input waiting for {waited:.0f} s ({bound})"
        return Outcome(key, name, True, description, metadata=metadata)
    silent = "no output yet" if age is None else f"no output for {age:.0f} s"
    description = f"{silent} while input has waited {waited:.0f} s ({bound})"
    return Outcome(key, name, False, description, metadata=metadata)


#: Reads the metadata of a check's latest completed evaluation (None: never evaluated).
PreviousLookup = Callable[[dg.AssetCheckKey], Mapping[str, Any] | None]


def previous_evaluation(instance: dg.DagsterInstance) -> PreviousLookup:
    """A :data:`PreviousLookup` over ``instance``: from runs and sensor reports alike.

    Example::

        >>> inst = dg.DagsterInstance.ephemeral()
        >>> key = dg.AssetCheckKey(dg.AssetKey(["topics", "t"]), "c")
        >>> previous_evaluation(inst)(key) is None
        True
        >>> inst.report_runless_asset_event(dg.AssetCheckEvaluation(
        ...     asset_key=key.asset_key, check_name="c", passed=True, metadata={"n": 4}))
        >>> previous_evaluation(inst)(key)["n"].value
        4
    """

    def lookup(key: dg.AssetCheckKey) -> Mapping[str, Any] | None:
        summary = instance.event_log_storage.get_asset_check_summary_records([key]).get(key)
        record = None if summary is None else summary.last_completed_check_execution_record
        event = None if record is None else record.event
        evaluation = None if event is None else event.asset_check_evaluation
        return None if evaluation is None else evaluation.metadata

    return lookup


def _previous_ends(metadata: Mapping[str, Any] | None) -> dict[int, int] | None:
    raw = None if metadata is None else metadata.get(DEAD_LETTER_ENDS)
    if raw is None:
        return None
    data = getattr(raw, "value", raw)
    if isinstance(data, str):
        data = json.loads(data)
    return {int(q): int(v) for q, v in dict(data).items()}


def evaluate_topology(
    topology: Topology,
    broker: BrokerView,
    previous: PreviousLookup,
    settings: CheckSettings,
    now_ms: int | None = None,
) -> list[Outcome]:
    """Every check of ``topology``, evaluated against ``broker``.

    Example (with a fake broker)::

        >>> class Quiet:
        ...     def topic_exists(self, topic): return True
        ...     def lag(self, group, topic): return {0: 5}
        ...     def end_offsets(self, topic): return {}
        ...     def latest_store_ms(self, topic): return None
        ...     def oldest_waiting_ms(self, group, topics): return None
        >>> from stream_assets.examples import wordcount
        >>> out = evaluate_topology(wordcount.build(), Quiet(), lambda key: None, CheckSettings())
        >>> [(o.check_name, o.passed) for o in out]  # doctest: +NORMALIZE_WHITESPACE
        [('wordcount__lag_within_bound', True), ('wordcount__no_new_dead_letters', True),
         ('wordcount__output_fresh', True)]
    """
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    job = topology.job_id
    max_lag, fresh_within_s = settings.bounds(job)
    outcomes = []
    for topic in topology.source_topics:
        lag = broker.lag(job, topic) if broker.topic_exists(topic) else None
        outcomes.append(lag_outcome(job, topic, lag, max_lag))
    dead = topology.dead_letter_topic
    key = dg.AssetCheckKey(topic_asset_key(dead), check_name(job, DEAD_LETTERS))
    outcomes.append(
        dead_letter_outcome(job, dead, broker.end_offsets(dead), _previous_ends(previous(key)))
    )
    inputs = [stage.input_topic for stage in topology.stages]
    waiting = broker.oldest_waiting_ms(job, inputs) if topology.sink_topics else None
    for sink in topology.sink_topics:
        outcomes.append(
            freshness_outcome(
                job, sink, broker.latest_store_ms(sink), waiting, now_ms, fresh_within_s
            )
        )
    return outcomes


# -- Dagster definitions ---------------------------------------------------------------


def topology_checks(
    topology: Topology, settings: CheckSettings | None = None
) -> dg.AssetChecksDefinition:
    """One topology's checks as a multi-asset check (executable from the UI and in a job).

    Example::

        >>> from stream_assets.examples import wordcount
        >>> checks = topology_checks(wordcount.build())
        >>> sorted(k.name for k in checks.check_keys)
        ['wordcount__lag_within_bound', 'wordcount__no_new_dead_letters', 'wordcount__output_fresh']
    """

    @dg.multi_asset_check(
        name=f"checks_{key_component(topology.job_id)}",
        specs=check_specs(topology),
        can_subset=True,
        description=f"Lag, dead letters and output freshness of topology `{topology.job_id}`.",
    )
    def run_checks(
        context: dg.AssetCheckExecutionContext, rocketmq: RocketMQResource
    ) -> Iterator[dg.AssetCheckResult]:
        selected = context.selected_asset_check_keys
        with rocketmq.admin() as admin, RocketMQProbe(admin) as probe:
            outcomes = evaluate_topology(
                topology, probe, previous_evaluation(context.instance), settings or CheckSettings()
            )
        for outcome in outcomes:
            if outcome.key in selected:
                yield outcome.result()

    return run_checks


def all_topology_checks(
    registrations: Mapping[str, TopologyRegistration], settings: CheckSettings | None = None
) -> list[dg.AssetChecksDefinition]:
    """:func:`topology_checks` of every registration."""
    return [topology_checks(reg.topology(), settings) for _, reg in sorted(registrations.items())]


def deployed(instance: dg.DagsterInstance, names: Sequence[str]) -> list[str]:
    """The topologies among ``names`` with a desired state of at least one instance.

    Never-deployed and stopped topologies are not checked periodically: their
    input is not meant to be consumed.
    """
    states = DesiredStateStore(instance).get_many(names)
    return sorted(n for n, s in states.items() if s.target_instances > 0)


def build_checks_sensor(
    registrations: Mapping[str, TopologyRegistration],
    settings: CheckSettings | None = None,
    name: str = "topology_checks_sensor",
) -> dg.SensorDefinition:
    """The sensor that evaluates the checks of every deployed topology, without runs.

    ``registrations`` is read at every tick. One topology's broker failure is
    logged and skips only its checks this tick.

    Example::

        >>> build_checks_sensor(REGISTRY).name
        'topology_checks_sensor'
    """
    interval = (settings or CheckSettings()).interval_s

    @dg.sensor(
        name=name,
        minimum_interval_seconds=interval,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Evaluates every deployed topology's checks (lag, dead letters, output "
        "freshness) and reports the results on their assets.",
    )
    def checks_sensor(
        context: dg.SensorEvaluationContext, rocketmq: RocketMQResource
    ) -> dg.SensorResult:
        current = settings or CheckSettings()
        names = deployed(context.instance, list(registrations))
        events: list[dg.AssetCheckEvaluation] = []
        previous = previous_evaluation(context.instance)
        if names:
            with rocketmq.admin() as admin, RocketMQProbe(admin) as probe:
                for job_id in names:
                    try:
                        outcomes = evaluate_topology(
                            registrations[job_id].topology(), probe, previous, current
                        )
                    except (RocketMQError, OSError) as exc:
                        context.log.warning(f"{job_id}: checks not evaluated this tick: {exc}")
                        continue
                    events.extend(o.evaluation() for o in outcomes)
        return dg.SensorResult(
            asset_events=events,
            skip_reason=None if events else "no deployed topology to check",
        )

    return checks_sensor


#: The code location's checks: every registered topology's, and the job and sensor
#: that evaluate them.
TOPOLOGY_CHECKS = all_topology_checks(REGISTRY)
topology_checks_job = dg.define_asset_job(
    "topology_checks_job",
    selection=dg.AssetSelection.checks(*TOPOLOGY_CHECKS),
    description="Evaluates the topology checks now (the sensor does it periodically).",
)
topology_checks_sensor = build_checks_sensor(REGISTRY)
