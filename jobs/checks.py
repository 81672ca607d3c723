"""Asset checks of every registered topology: crashes, lag, dead letters, output freshness.

Per topology (``<job>`` is its job id as an asset-key component):

- ``<job>__no_recent_crashes`` on the **topology** asset: no instance run of the
  topology failed within the supervisor's crash window
  (``STREAM_ASSETS_CRASH_WINDOW_S``, 10 min) (ERROR). This is how a crash alert
  shows in the UI: the alert sensor (jobs/alerts.py) reports it failed the
  moment a run fails, with the alert's line as its description; the
  evaluations below keep it failed through the window and pass it afterwards.
- ``<job>__lag_within_bound`` on each **source** topic: the topology's consumer
  group has at most ``max_lag`` messages of the topic not yet committed (ERROR).
- ``<job>__no_recent_dead_letters`` on its **dead-letter** topic (WARN: the
  stream moved on; each dead letter names its operator and reason): fails
  while the newest dead letter is younger than :data:`DEAD_LETTER_HOLD_S`
  (24 h), so a dead letter keeps the check yellow for a day, however often
  it is evaluated, instead of until the next evaluation. Each evaluation says
  how many are new since the previous one (its metadata keeps the end offsets
  it saw, and the newest dead letter's time); new ones raise one
  ``dead_letters`` :class:`~stream_assets.control.alerts.Alert` to the
  ``STREAM_ASSETS_ALERT_HOOKS`` per batch, from the evaluation that first
  counts them. The first evaluation ever only records the offsets (no alert
  for dead letters older than the checks).
- ``<job>__output_fresh`` on each **sink** topic: the sink got a message within
  ``fresh_within_s``, or no input has been waiting that long (ERROR). "Input
  waiting" is the oldest uncommitted message of any stage input (sources and
  shuffles) of the topology's group, by broker store time: an idle topology is
  not stale, and one that sits on input for longer than the bound is, even
  when its lag is small. A windowed topology whose windows are longer than the
  bound needs a larger ``fresh_within_s``.

Everything but the crash check is read from the broker
(:class:`RocketMQProbe`), none of it from the instances, so the checks hold
while no instance runs; the crash check reads the runs in the Dagster instance.

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
    >>> for spec in check_specs(wordcount.build(), CheckSettings()):
    ...     print(spec.asset_key.to_user_string(), spec.name)
    topologies/wordcount wordcount__no_recent_crashes
    topics/sourceTopic wordcount__lag_within_bound
    topics/wordcount__dead_letters wordcount__no_recent_dead_letters
    topics/wordcount_out wordcount__output_fresh
"""

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Protocol, Self

import dagster as dg

from stream_assets.control.alerts import Alert, notify
from stream_assets.control.desired_state import DesiredStateStore
from stream_assets.control.lineage import key_component, topic_asset_key, topology_asset_key
from stream_assets.control.registry import REGISTRY, TOPOLOGY_TAG, TopologyRegistration
from stream_assets.jobs.instance_job import INSTANCE_JOB
from stream_assets.jobs.supervisor import failure_message, run_index
from stream_assets.plan.topology import Topology
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.rocketmq.acl import CHECKS_GROUP
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.rocketmq.layout import current_layout
from stream_assets.rocketmq.provision import plan_topology_upgrade
from stream_assets.rocketmq.reader import PullStatus, QueueReader
from stream_assets.settings import CheckSettings, SupervisorSettings

CRASHES = "no_recent_crashes"
LAG = "lag_within_bound"
DEAD_LETTERS = "no_recent_dead_letters"
FRESH = "output_fresh"

#: Metadata key under which a dead-letter check keeps the end offsets it saw.
DEAD_LETTER_ENDS = "dead_letter_end_offsets"
#: Metadata key under which it keeps the newest dead letter's time (a timestamp).
NEWEST_DEAD_LETTER = "newest_dead_letter_at"
#: The dead-letter check fails while the newest dead letter is younger than this (the
#: default of ``STREAM_ASSETS_CHECK_DEAD_LETTER_HOLD_S``): long enough that whoever
#: looks the next day still sees it, short enough to clear by itself (dead letters
#: cannot be deleted from a topic; retention takes days).
DEAD_LETTER_HOLD_S = CheckSettings.model_fields["dead_letter_hold_s"].default


def check_name(job_id: str, kind: str) -> str:
    """The name of ``job_id``'s check ``kind`` (unique on a topic several topologies share).

    Example::

        >>> check_name("windowed-sum", LAG)
        'windowed_sum__lag_within_bound'
    """
    return f"{key_component(job_id)}__{kind}"


def crash_check_key(job_id: str) -> dg.AssetCheckKey:
    """The key of ``job_id``'s crash check, on its topology asset.

    Example::

        >>> crash_check_key("windowed-sum").to_user_string()
        'topologies/windowed_sum:windowed_sum__no_recent_crashes'
    """
    return dg.AssetCheckKey(topology_asset_key(job_id), check_name(job_id, CRASHES))


def check_specs(topology: Topology, settings: CheckSettings) -> list[dg.AssetCheckSpec]:
    """The check specs of one topology, on itself and its source, dead-letter and sink topics
    (``settings`` name the dead-letter hold in a description)."""
    job = topology.job_id
    hold = _span(settings.dead_letter_hold_s)
    specs = [
        dg.AssetCheckSpec(
            check_name(job, CRASHES),
            asset=topology_asset_key(job),
            description=f"No instance run of `{job}` failed within the crash window "
            "(STREAM_ASSETS_CRASH_WINDOW_S): each crash alert fails it.",
        )
    ]
    specs.extend(
        dg.AssetCheckSpec(
            check_name(job, LAG),
            asset=topic_asset_key(topic),
            description=f"`{job}` has not fallen behind on `{topic}`: its uncommitted messages "
            "stay within the bound (STREAM_ASSETS_CHECK_MAX_LAG).",
        )
        for topic in topology.source_topics
    )
    specs.append(
        dg.AssetCheckSpec(
            check_name(job, DEAD_LETTERS),
            asset=topic_asset_key(topology.dead_letter_topic),
            description=f"No record of `{job}` became a dead letter within {hold} (fails, as a "
            "warning, until the newest is that old); new ones also raise an alert.",
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
        self.reader = QueueReader(admin, CHECKS_GROUP, max_batch=16)

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


def _span(seconds: float) -> str:
    """A duration for people: ``45 s``, ``12 min``, ``3 h``, ``2 d``."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def new_dead_letters(ends: Mapping[int, int], previous: Mapping[int, int] | None) -> int:
    """Messages added to a dead-letter topic since ``previous`` end offsets (0 if None).

    A queue whose end went down (the topic was recreated) counts from 0.

    Example::

        >>> new_dead_letters({0: 3, 1: 1}, {0: 3, 1: 0}), new_dead_letters({0: 3}, None)
        (1, 0)
    """
    if previous is None:
        return 0
    new = 0
    for q, end in ends.items():
        before = previous.get(q, 0)
        new += end if end < before else end - before
    return new


def dead_letter_outcome(
    job_id: str,
    topic: str,
    ends: Mapping[int, int],
    previous: Mapping[int, int] | None,
    newest_ms: int | None,
    now_ms: int,
    hold_s: float = DEAD_LETTER_HOLD_S,
) -> Outcome:
    """The dead-letter check: fails (WARN) while the newest dead letter is younger than ``hold_s``.

    ``ends`` are the topic's end offsets now, ``previous`` those the previous
    evaluation saw (None: never evaluated, so nothing counts as new), and
    ``newest_ms`` the newest dead letter's time (None: unknown or none). A
    queue not reported now (the topic unknown for a moment: a restarting
    broker's name server forgets its routes) keeps its previous end, so it is
    not counted again once it is back.

    Example::

        >>> now = 1_000_000_000_000
        >>> o = dead_letter_outcome("wc", "wc__dead-letters", {0: 3, 1: 1}, {0: 3, 1: 0},
        ...                         now - 5_000, now)
        >>> o.passed, o.severity.value
        (False, 'WARN')
        >>> o.description
        '1 new dead letter(s) since the previous check; 4 in all, the newest 5 s ago'
        >>> dead_letter_outcome("wc", "wc__dead-letters", {0: 4}, {0: 4}, now - 7_200_000,
        ...                     now).description  # nothing new: still failing, for 24 h
        'no new dead letter since the previous check; 4 in all, the newest 2 h ago'
        >>> o = dead_letter_outcome("wc", "wc__dead-letters", {0: 4}, {0: 4}, now - 90_000_000, now)
        >>> o.passed, o.description
        (True, 'no dead letter within 24 h (4 in all, the newest 25 h ago)')
        >>> dead_letter_outcome("wc", "wc__dead-letters", {}, {0: 3}, None, now).metadata[
        ...     "dead_letters"]
        3
    """
    key, name = topic_asset_key(topic), check_name(job_id, DEAD_LETTERS)
    seen = {**(previous or {}), **ends}
    total = sum(seen.values())
    new = new_dead_letters(ends, previous)
    metadata: dict[str, Any] = {
        "new_dead_letters": new,
        "dead_letters": total,
        "hold_s": hold_s,
        DEAD_LETTER_ENDS: _queues_json(seen),
    }
    if total == 0:
        return Outcome(key, name, True, "no dead letters", dg.AssetCheckSeverity.WARN, metadata)
    if newest_ms is None:
        # Dead letters whose time nobody knows (the broker could not say before the first
        # evaluation that saw them): older than the checks, so no reason to fail.
        description = f"{total} dead letter(s) in all, none known to be recent"
        return Outcome(key, name, True, description, dg.AssetCheckSeverity.WARN, metadata)
    age_s = max(0.0, (now_ms - newest_ms) / 1000)
    metadata[NEWEST_DEAD_LETTER] = dg.MetadataValue.timestamp(newest_ms / 1000)
    about = f"{total} in all, the newest {_span(age_s)} ago"
    if age_s > hold_s:
        description = f"no dead letter within {_span(hold_s)} ({about})"
        return Outcome(key, name, True, description, dg.AssetCheckSeverity.WARN, metadata)
    news = f"{new} new dead letter(s)" if new else "no new dead letter"
    description = f"{news} since the previous check; {about}"
    return Outcome(key, name, False, description, dg.AssetCheckSeverity.WARN, metadata)


def dead_letter_alert(job_id: str, topic: str, outcome: Outcome) -> Alert | None:
    """The alert for the dead letters ``outcome`` counted as new, or None if there are none.

    Example::

        >>> now = 1_000_000_000_000
        >>> o = dead_letter_outcome("wc", "wc__dead-letters", {0: 5}, {0: 3}, now, now)
        >>> alert = dead_letter_alert("wc", "wc__dead-letters", o)
        >>> alert.kind, alert.dead_letters, alert.describe().split(":")[:2]
        ('dead_letters', 2, ['wc', ' 2 new dead letter(s) in wc__dead-letters (5 in all)'])
    """
    new = int(_plain(outcome.metadata.get("new_dead_letters", 0)))
    if new <= 0:
        return None
    total = int(_plain(outcome.metadata.get("dead_letters", new)))
    return Alert(
        topology=job_id,
        instance=None,
        run_id="",
        message=f"{new} new dead letter(s) in {topic} ({total} in all): records an operator "
        "could not process; each names its operator and the reason",
        crashes=0,
        kind="dead_letters",
        dead_letters=new,
    )


def raise_dead_letter_alerts(
    topology: Topology,
    outcomes: Sequence[Outcome],
    hooks: Sequence[str],
    log: Callable[[str], None],
) -> list[Alert]:
    """Log and send to ``hooks`` (``SupervisorSettings.alert_hooks``) the dead-letter alert
    among ``outcomes``, if they counted new dead letters; return the alerts raised.

    Called by whichever evaluation (sensor tick or checks run) first counts a batch: the
    next one compares with the offsets this one recorded, so a batch alerts once.

    Example::

        >>> hooks = ("my.alerts:page",)
        >>> raise_dead_letter_alerts(topology, outcomes, hooks, print)  # doctest: +SKIP
    """
    key = dg.AssetCheckKey(
        topic_asset_key(topology.dead_letter_topic), check_name(topology.job_id, DEAD_LETTERS)
    )
    raised = []
    for outcome in outcomes:
        alert = (
            dead_letter_alert(topology.job_id, topology.dead_letter_topic, outcome)
            if outcome.key == key
            else None
        )
        if alert is not None:
            log(alert.describe())
            notify(alert, hooks, log)
            raised.append(alert)
    return raised


# -- crashes ---------------------------------------------------------------------------


def failed_runs(
    instance: dg.DagsterInstance, job_id: str, since: float
) -> list[tuple[float, dg.DagsterRun]]:
    """The instance runs of ``job_id`` that failed at or after ``since``, newest first.

    Example::

        >>> failed_runs(dg.DagsterInstance.ephemeral(), "wc", 0.0)
        []
    """
    records = instance.get_run_records(
        filters=dg.RunsFilter(
            job_name=INSTANCE_JOB,
            tags={TOPOLOGY_TAG: job_id},
            statuses=[dg.DagsterRunStatus.FAILURE],
            updated_after=datetime.fromtimestamp(max(since, 0.0), UTC),
        ),
        limit=200,
    )
    ended = [(float(r.end_time or r.update_timestamp.timestamp()), r.dagster_run) for r in records]
    return sorted((e for e in ended if e[0] >= since), key=lambda e: e[0], reverse=True)


def crash_alert_outcome(alert: Alert, window_s: float) -> Outcome:
    """The failed crash check that shows ``alert`` (a crash or crash loop) in the UI.

    Example::

        >>> o = crash_alert_outcome(Alert("wc", 1, "3f2a", "boom", 2), window_s=600)
        >>> o.passed, o.severity.value, o.metadata["instance"].value
        (False, 'ERROR', '1')
        >>> o.description
        'instance 1 of wc failed (run 3f2a): boom (2 failed run(s) within 10 min)'
    """
    key = crash_check_key(alert.topology)
    return Outcome(
        key.asset_key,
        key.name,
        False,
        f"{alert.describe()} ({alert.crashes} failed run(s) within {_span(window_s)})",
        dg.AssetCheckSeverity.ERROR,
        {
            # Text: identifiers and messages label the alert, none is a number to plot.
            "alert": dg.MetadataValue.text(alert.kind),
            "instance": dg.MetadataValue.text(str(alert.instance)),
            "run_id": dg.MetadataValue.text(alert.run_id),
            "failure": dg.MetadataValue.text(alert.message),
            "crashes_in_window": alert.crashes,
            "retry_in_s": round(alert.retry_in_s, 1),
        },
    )


def crash_outcome(
    instance: dg.DagsterInstance, job_id: str, now: float, window_s: float
) -> Outcome:
    """The crash check of ``job_id``: fails while a run of it failed within ``window_s``.

    Example::

        >>> inst = dg.DagsterInstance.ephemeral()
        >>> crash_outcome(inst, "wc", time.time(), 600).description
        'no instance run failed within 10 min'
    """
    failed = failed_runs(instance, job_id, now - window_s)
    if not failed:
        key = crash_check_key(job_id)
        description = f"no instance run failed within {_span(window_s)}"
        metadata = {"crashes_in_window": 0}
        return Outcome(key.asset_key, key.name, True, description, metadata=metadata)
    _, run = failed[0]
    latest = Alert(
        job_id, run_index(run), run.run_id, failure_message(instance, run.run_id), len(failed)
    )
    return crash_alert_outcome(latest, window_s)


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


def _plain(raw: Any) -> Any:
    """The plain value of a stored metadata entry (``MetadataValue``) or of a raw one."""
    return getattr(raw, "value", raw)


def _previous_newest_ms(metadata: Mapping[str, Any] | None) -> int | None:
    raw = None if metadata is None else metadata.get(NEWEST_DEAD_LETTER)
    return None if raw is None else int(float(_plain(raw)) * 1000)


def _previous_ends(metadata: Mapping[str, Any] | None) -> dict[int, int] | None:
    raw = None if metadata is None else metadata.get(DEAD_LETTER_ENDS)
    if raw is None:
        return None
    data = _plain(raw)
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
        [('wordcount__lag_within_bound', True), ('wordcount__no_recent_dead_letters', True),
         ('wordcount__output_fresh', True)]
    """
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    job = topology.job_id
    max_lag, fresh_within_s = settings.bounds(job)
    outcomes = []
    for topic in topology.source_topics:
        lag = broker.lag(job, topic) if broker.topic_exists(topic) else None
        outcomes.append(lag_outcome(job, topic, lag, max_lag))
    outcomes.append(_dead_letters(topology, broker, previous, settings, now_ms))
    inputs = [stage.input_topic for stage in topology.stages]
    waiting = broker.oldest_waiting_ms(job, inputs) if topology.sink_topics else None
    for sink in topology.sink_topics:
        outcomes.append(
            freshness_outcome(
                job, sink, broker.latest_store_ms(sink), waiting, now_ms, fresh_within_s
            )
        )
    return outcomes


def _dead_letters(
    topology: Topology,
    broker: BrokerView,
    previous: PreviousLookup,
    settings: CheckSettings,
    now_ms: int,
) -> Outcome:
    job, dead = topology.job_id, topology.dead_letter_topic
    before = previous(dg.AssetCheckKey(topic_asset_key(dead), check_name(job, DEAD_LETTERS)))
    ends, previous_ends = broker.end_offsets(dead), _previous_ends(before)
    new = new_dead_letters(ends, previous_ends)
    # The newest dead letter's store time; while the broker cannot say (restarting), the
    # one remembered, or now for dead letters just counted: never younger than it was.
    stored = broker.latest_store_ms(dead) if sum(ends.values()) else None
    if stored is None and new:
        stored = now_ms
    known = [t for t in (stored, _previous_newest_ms(before)) if t is not None]
    newest = max(known) if known else None
    return dead_letter_outcome(
        job, dead, ends, previous_ends, newest, now_ms, hold_s=settings.dead_letter_hold_s
    )


# -- Dagster definitions ---------------------------------------------------------------


def topology_checks(
    topology: Topology, settings: CheckSettings | None = None
) -> dg.AssetChecksDefinition:
    """One topology's checks as a multi-asset check (executable from the UI and in a job).

    Example::

        >>> from stream_assets.examples import wordcount
        >>> checks = topology_checks(wordcount.build())
        >>> sorted(k.name for k in checks.check_keys)  # doctest: +NORMALIZE_WHITESPACE
        ['wordcount__lag_within_bound', 'wordcount__no_recent_crashes',
         'wordcount__no_recent_dead_letters', 'wordcount__output_fresh']
    """
    current = settings or CheckSettings()
    crashes = crash_check_key(topology.job_id)

    @dg.multi_asset_check(
        name=f"checks_{key_component(topology.job_id)}",
        specs=check_specs(topology, current),
        can_subset=True,
        description=f"Crashes, lag, dead letters and output freshness of topology "
        f"`{topology.job_id}`.",
    )
    def run_checks(
        context: dg.AssetCheckExecutionContext, rocketmq: RocketMQResource
    ) -> Iterator[dg.AssetCheckResult]:
        selected = context.selected_asset_check_keys
        supervisor = SupervisorSettings()
        outcomes: list[Outcome] = []
        if crashes in selected:
            window_s = supervisor.crash_window_s
            outcomes.append(crash_outcome(context.instance, topology.job_id, time.time(), window_s))
        if selected - {crashes}:  # the crash check alone needs no broker
            with rocketmq.admin() as admin, RocketMQProbe(admin) as probe:
                found = evaluate_topology(
                    topology, probe, previous_evaluation(context.instance), current
                )
            outcomes.extend(o for o in found if o.key in selected)
            # Only an evaluation that is recorded may alert: the next one counts from it.
            raise_dead_letter_alerts(
                topology, outcomes, supervisor.alert_hooks, context.log.warning
            )
        for outcome in outcomes:
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
        description="Evaluates every deployed topology's checks (crashes, lag, dead letters, "
        "output freshness), reports the results on their assets, and alerts on new dead letters.",
    )
    def checks_sensor(
        context: dg.SensorEvaluationContext, rocketmq: RocketMQResource
    ) -> dg.SensorResult:
        current = settings or CheckSettings()
        names = deployed(context.instance, list(registrations))
        supervisor = SupervisorSettings()
        now, window_s = time.time(), supervisor.crash_window_s
        # The crash checks first: they read runs, not the broker, and hold when it is down.
        events = [crash_outcome(context.instance, n, now, window_s).evaluation() for n in names]
        previous = previous_evaluation(context.instance)
        if names:
            with rocketmq.admin() as admin, RocketMQProbe(admin) as probe:
                for job_id in names:
                    try:
                        built = registrations[job_id].topology()
                        # Every tick: the topics the job runs under, no refusal to judge.
                        view = plan_topology_upgrade(admin, built, find_unclaimed=False)
                        topology = view.topology
                        outcomes = evaluate_topology(topology, probe, previous, current)
                    except (RocketMQError, OSError) as exc:
                        context.log.warning(f"{job_id}: checks not evaluated this tick: {exc}")
                        continue
                    raise_dead_letter_alerts(
                        topology, outcomes, supervisor.alert_hooks, context.log.warning
                    )
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
