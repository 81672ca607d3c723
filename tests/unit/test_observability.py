"""Metrics and checks without a broker: rates, per-instance observations, totals, checks.

The user's report behind this: with two instances the sink asset's plots
zig-zagged (each instance wrote its own numbers under the same keys) and
``records_per_s`` read 0 half the time (a rate over an interval in which no
batch happened to end).
"""

import dataclasses
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg
import pytest
from dagster._core.events import DagsterEventType

from stream_assets.control.alerts import Alert
from stream_assets.control.allocation import allocate
from stream_assets.control.desired_state import (
    DesiredState,
    DesiredStateStore,
    heartbeat_key,
    record_heartbeat,
)
from stream_assets.control.lineage import lineage_asset_specs, topic_asset_key, topology_asset_key
from stream_assets.control.metrics import (
    HEADLINE,
    RUN_KEY,
    InstanceNumbers,
    InstanceReport,
    Rate,
    RateMeter,
    aggregate,
    instance_metadata,
    instance_numbers,
    parse_instance_metadata,
)
from stream_assets.control.registry import (
    GENERATION_TAG,
    INSTANCE_INDEX_TAG,
    TOPOLOGY_TAG,
    TopologyRegistration,
)
from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import wordcount
from stream_assets.jobs.checks import (
    CRASHES,
    DEAD_LETTERS,
    FRESH,
    LAG,
    check_name,
    crash_check_key,
    crash_outcome,
    evaluate_topology,
    freshness_outcome,
    previous_evaluation,
    raise_dead_letter_alerts,
    topology_checks,
)
from stream_assets.jobs.instance_job import INSTANCE_JOB, InstanceConfig, _observe, instance_job
from stream_assets.jobs.metrics import build_metrics_sensor
from stream_assets.plan.topology import Topology
from stream_assets.resources import RocketMQResource
from stream_assets.runtime.spark.instance import StageMetrics
from stream_assets.serde import text_deserializer
from stream_assets.settings import CheckSettings
from tests.unit._alert_sensor import alert_sensor_tick

# -- rates -----------------------------------------------------------------------------


def test_rate_is_taken_over_at_least_the_window_of_cumulative_samples() -> None:
    meter = RateMeter(window_s=30)
    # One batch of 1000 records ends every 15 s; samples every 10 s. A rate over
    # each 10 s interval alone would read 0 one interval in three.
    batch_ends = {0: 0, 15: 1000, 30: 2000, 45: 3000, 60: 4000, 75: 5000, 90: 6000}
    rates = []
    for t in range(0, 100, 10):
        total = max(v for end, v in batch_ends.items() if end <= t)
        meter.add(float(t), total)
        rates.append(meter.rate())
    # Less than 30 s of history: unknown, not 0 (no batch ended in 0..10).
    assert rates[:3] == [None, None, None]
    known = [r for r in rates if r is not None]
    assert len(known) == 7
    for rate in known:  # every rate spans 30-40 s and is near 66.7/s
        assert 30.0 <= rate.over_s < 40.0
        assert 50.0 <= rate.per_s <= 80.0, rate


def test_rate_uses_the_elapsed_time_between_the_two_samples() -> None:
    meter = RateMeter(window_s=30)
    meter.add(100.0, 0)
    meter.add(112.5, 250)  # an uneven interval
    meter.add(131.0, 250)
    assert meter.rate() == Rate(per_s=250 / 31.0, over_s=31.0)
    meter.add(145.0, 1000)  # the reference is 112.5: the newest sample >= 30 s old
    assert meter.rate() == Rate(per_s=750 / 32.5, over_s=32.5)


def test_a_counter_that_goes_down_restarts_the_history() -> None:
    meter = RateMeter(window_s=30)
    meter.add(0.0, 5000)
    meter.add(10.0, 6000)
    meter.add(20.0, 100)  # a new process: counters from 0
    assert meter.rate() is None
    meter.add(50.0, 1600)
    assert meter.rate() == Rate(per_s=50.0, over_s=30.0)


def test_idle_instance_rate_falls_to_zero_only_when_nothing_moved_for_the_window() -> None:
    meter = RateMeter(window_s=30)
    for t, total in [(0, 0), (10, 3000), (20, 3000), (30, 3000)]:
        meter.add(float(t), total)
    assert meter.rate() == Rate(per_s=100.0, over_s=30.0)
    meter.add(40.0, 3000)  # nothing since 10: the window 10..40 really is idle
    assert meter.rate() == Rate(per_s=0.0, over_s=30.0)


# -- one instance's numbers --------------------------------------------------------------


def _two_sources() -> Topology:
    b = StreamBuilder("two-src")
    left = b.source("left", text_deserializer)
    right = b.source("right", text_deserializer)
    left.union(right).key_by(lambda w: w).count().to_rstream().sink("two-src-out")
    return b.build()


def test_instance_numbers_count_every_source_stage_and_sum_outputs_over_stages() -> None:
    topology = _two_sources()
    sources = [s for s in topology.stages if s.source is not None]
    assert len(sources) == 2
    totals: dict[int, dict[str, float]] = {s.index: {} for s in topology.stages}
    totals[sources[0].index] = {"records_in": 30.0, "dead_letters": 1.0, "outputs": 2.0}
    totals[sources[1].index] = {"records_in": 12.0}
    last = topology.stages[-1].index
    totals[last] = {"records_in": 40.0, "outputs": 9.0, "late": 3.0, "dead_letters": 2.0}
    lag = {"left": {0: 4}, "right": {0: 1, 1: 1}, topology.shuffle_topics[0]: {0: 7}}
    n = instance_numbers(topology, totals, (10, 2048), lag)
    assert n.records_in == 42  # both sources, not the shuffle stage's input
    assert n.records_in_by_source == {"left": 30, "right": 12}
    assert (n.records_out, n.dead_letters, n.late) == (11, 3, 3)
    assert (n.lag, n.source_lag) == (13, 6)
    assert (n.state_keys, n.state_bytes) == (10, 2048)


def test_instance_metadata_round_trips_and_names_its_keys_by_instance() -> None:
    numbers = InstanceNumbers(
        records_in=500,
        records_out=20,
        lag=3,
        source_lag=2,
        state_bytes=99,
        lag_per_queue={"src": {1: 2}, "shuf": {3: 1}},
        records_in_by_source={"src": 500},
    )
    rates = {
        "records_in": Rate(16.666, 30.0),
        "records_out": Rate(0.5, 30.0),
        "records_in:src": Rate(16.666, 30.0),
    }
    md = instance_metadata(3, 9, numbers, rates)
    # Identifiers are text: the UI plots every int or float entry.
    assert md["instance"] == dg.MetadataValue.text("3")
    assert md["generation"] == dg.MetadataValue.text("9")
    numeric = {k for k, v in md.items() if isinstance(v, int | float)}
    # Every plotted number is this instance's own series.
    assert numeric == {k for k in md if k.startswith("instance_3.")} - {
        "instance_3.lag_per_queue",
        "instance_3.source_records_per_s",
    }
    assert md["instance_3.records_per_s"] == 16.67
    assert md["instance_3.rate_window_s"] == 30.0
    report = parse_instance_metadata(md, run_id="r", ts=1.0)
    assert report is not None
    assert (report.index, report.generation, report.run_id) == (3, 9, "r")
    assert report.numbers.lag_per_queue == {"src": {1: 2}, "shuf": {3: 1}}
    assert (report.records_per_s, report.records_out_per_s) == (16.67, 0.5)
    assert report.source_records_per_s == {"src": 16.67}


def test_aggregate_sums_instances_and_treats_an_unknown_rate_as_unknown() -> None:
    def report(index: int, rate: float | None, **numbers: Any) -> InstanceReport:
        return InstanceReport(index, 2, InstanceNumbers(**numbers), records_per_s=rate)

    totals = aggregate(
        [
            report(0, 120.0, records_in=1000, lag=5, state_bytes=10, lag_per_queue={"s": {0: 5}}),
            report(1, 80.0, records_in=700, lag=1, state_bytes=30, lag_per_queue={"s": {1: 1}}),
            report(2, None, records_in=3, lag=0, state_bytes=0, lag_per_queue={"s": {2: 0}}),
        ]
    )
    assert totals.instances == 3
    assert totals.records_per_s == 200.0
    assert (totals.numbers.records_in, totals.numbers.lag, totals.numbers.state_bytes) == (
        1703,
        6,
        40,
    )
    assert totals.numbers.lag_per_queue == {"s": {0: 5, 1: 1, 2: 0}}
    assert aggregate([report(0, None)]).records_per_s is None


# -- the instance job's observation -------------------------------------------------------


class _FakeInstance:
    """What ``_observe`` reads of an Instance."""

    def __init__(self, topology: Topology, generation: int) -> None:
        self.topology = topology
        self.generation = generation
        self.metrics = {s.index: StageMetrics() for s in topology.stages}

    def state_size(self) -> tuple[int, int]:
        return 4, 4096


def test_observe_writes_the_topology_asset_only_with_the_instance_and_its_rate() -> None:
    topology = wordcount.build()
    fake = _FakeInstance(topology, generation=5)
    config = InstanceConfig(topology="wordcount", generation=4, instance_index=1)
    lag = {"sourceTopic": {0: 2}, topology.shuffle_topics[0]: {1: 3}}

    # The rate's interval lies between the two samples' brackets, however slow the
    # machine: at least from the end of the first call to the start of the second.
    clock: list[float] = []

    @dg.op
    def observe_twice(context: dg.OpExecutionContext) -> None:
        clock.append(time.monotonic())
        _observe(context, config, fake, lag, 0.1)  # type: ignore[arg-type]
        clock.append(time.monotonic())
        fake.metrics[0].totals["records_in"] += 400
        fake.metrics[1].totals["outputs"] += 40
        time.sleep(0.2)  # past the 0.1 s rate window: not a synchronisation
        clock.append(time.monotonic())
        _observe(context, config, fake, lag, 0.1)  # type: ignore[arg-type]
        clock.append(time.monotonic())

    @dg.job
    def observe_job() -> None:
        observe_twice()

    instance = dg.DagsterInstance.ephemeral()
    result = observe_job.execute_in_process(instance=instance)
    assert result.success
    records = instance.fetch_observations(topology_asset_key("wordcount"), limit=10).records
    first, second = [r.asset_observation.metadata for r in reversed(records)]  # type: ignore[union-attr]
    assert first["instance"].value == "1" and first["generation"].value == "5"
    # Runless, naming the run: the run's own log carries no observation every 10 s.
    assert first["run"].value == second["run"].value == result.run_id
    in_log = instance.all_logs(result.run_id, of_type=DagsterEventType.ASSET_OBSERVATION)
    assert not in_log
    assert "instance_1.records_per_s" not in first  # no rate from one sample: not 0
    rate = second["instance_1.records_per_s"].value
    assert isinstance(rate, float)
    first_start, first_end, second_start, second_end = clock
    assert 400 / (second_end - first_start) <= rate <= 400 / (second_start - first_end), rate
    assert second["instance_1.records_in"].value == 400
    assert second["instance_1.lag"].value == 5 and second["instance_1.source_lag"].value == 2
    assert second["instance_1.state_bytes"].value == 4096
    for sink in topology.sink_topics:
        assert not instance.fetch_observations(topic_asset_key(sink), limit=1).records


# -- the metrics sensor --------------------------------------------------------------------


def _live_run(
    instance: dg.DagsterInstance,
    job_id: str,
    index: int,
    generation: int,
    status: dg.DagsterRunStatus = dg.DagsterRunStatus.STARTED,
    pid: int | None = None,
    beating: bool = True,
) -> str:
    """An instance run; a STARTED one heartbeats (``beating``) as process ``pid`` (this one
    by default)."""
    run_id = uuid.uuid4().hex
    instance.add_run(
        dg.DagsterRun(
            job_name=INSTANCE_JOB,
            run_id=run_id,
            status=status,
            tags={
                TOPOLOGY_TAG: job_id,
                GENERATION_TAG: str(generation),
                INSTANCE_INDEX_TAG: str(index),
            },
        )
    )
    if status == dg.DagsterRunStatus.STARTED and beating:
        beat = record_heartbeat(instance, job_id, generation, index, run_id)
        if pid is not None:
            instance.daemon_cursor_storage.set_cursor_values(
                {heartbeat_key(run_id): dataclasses.replace(beat, pid=pid).to_json()}
            )
    return run_id


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _observe_as(
    instance: dg.DagsterInstance, run_id: str, key: dg.AssetKey, metadata: Mapping[str, Any]
) -> None:
    """Store an observation as an instance run's op does: runless, naming its run."""
    labelled = {**metadata, RUN_KEY: dg.MetadataValue.text(run_id)}
    instance.report_runless_asset_event(dg.AssetObservation(asset_key=key, metadata=labelled))


def _events_by_key(result: dg.SensorResult) -> dict[str, dict[str, Any]]:
    """Each event's metadata values by asset; the topology's own numbers are its
    materialization, the topics' numbers observations."""
    out: dict[str, dict[str, Any]] = {}
    for event in result.asset_events:
        key = event.asset_key.to_user_string()
        kind = dg.AssetMaterialization if key.startswith("topologies/") else dg.AssetObservation
        assert isinstance(event, kind), (key, event)
        out[key] = {k: v.value for k, v in event.metadata.items()}
    return out


def test_metrics_sensor_observes_topology_sink_and_source_with_totals() -> None:
    instance = dg.DagsterInstance.ephemeral()
    reg = TopologyRegistration("wordcount", wordcount.build)
    topology = reg.topology()
    allocation = allocate({"sourceTopic": [0, 1, 2, 3]}, 2, generation=7)
    DesiredStateStore(instance).set("wordcount", DesiredState(2, allocation))
    runs = [_live_run(instance, "wordcount", i, 7) for i in range(2)]
    gone = _live_run(instance, "wordcount", 0, 6)
    # Unfinished but not serving, so not running: starting, started without a heartbeat yet,
    # and a run Dagster still calls STARTED whose process was killed.
    _live_run(instance, "wordcount", 2, 7, status=dg.DagsterRunStatus.STARTING)
    _live_run(instance, "wordcount", 3, 7, beating=False)
    _live_run(instance, "wordcount", 4, 7, pid=_dead_pid())
    key = topology_asset_key("wordcount")
    per_instance = [
        InstanceNumbers(
            records_in=900, records_out=90, lag=4, state_bytes=100,
            lag_per_queue={"sourceTopic": {0: 3, 1: 1}}, records_in_by_source={"sourceTopic": 900},
        ),
        InstanceNumbers(
            records_in=100, records_out=10, lag=2, state_bytes=50,
            lag_per_queue={"sourceTopic": {2: 2, 3: 0}}, records_in_by_source={"sourceTopic": 100},
        ),
    ]  # fmt: skip
    rates = [30.0, 10.0]
    for i, (run_id, numbers, rate) in enumerate(zip(runs, per_instance, rates, strict=True)):
        # An older report of the same run, then its latest: only the latest counts.
        _observe_as(instance, run_id, key, instance_metadata(i, 7, numbers, {}))
        r = Rate(rate, 30.0)
        metadata = instance_metadata(
            i, 7, numbers, {"records_in": r, "records_out": r, "records_in:sourceTopic": r}
        )
        _observe_as(instance, run_id, key, metadata)
    # A finished run's last report must not be summed with its replacement's.
    _observe_as(instance, gone, key, instance_metadata(0, 6, per_instance[0], {}))
    instance.report_run_canceled(instance.get_run_by_id(gone))  # type: ignore[arg-type]

    sensor = build_metrics_sensor({"wordcount": reg})
    result = sensor(dg.build_sensor_context(instance=instance))
    assert isinstance(result, dg.SensorResult)
    seen = _events_by_key(result)
    assert set(seen) == {
        "topologies/wordcount",
        "topics/wordcount_out",
        "topics/sourceTopic",
    }
    top = seen["topologies/wordcount"]
    assert list(top)[:6] == list(HEADLINE)  # the headline first, in reading order
    assert (top["1_lag"], top["2_records_per_s"], top["3_records_out_per_s"]) == (6, 40.0, 40.0)
    assert (top["5_running_instances"], top["6_desired_instances"]) == (2, 2)
    assert (top["generation"], top["all.reporting_instances"]) == ("7", 2)
    assert (top["all.records_in"], top["all.state_bytes"]) == (1000, 150)
    assert "instance" not in top  # the topology's own series carry no instance label
    sink = seen["topics/wordcount_out"]
    assert (sink["records_per_s"], sink["records_out"], sink["lag"]) == (40.0, 100, 6)
    source = seen["topics/sourceTopic"]
    assert (source["lag"], source["records_per_s"]) == (6, 40.0)
    assert topology.sink_topics == ("wordcount-out",)

    # Nothing new: the next tick observes nothing (no repeated points).
    again = sensor(dg.build_sensor_context(instance=instance, cursor=result.cursor))
    assert isinstance(again, dg.SensorResult) and not again.asset_events
    # A scale changes the desired state: the topology asset shows it at once.
    DesiredStateStore(instance).set("wordcount", DesiredState(3, allocation))
    third = sensor(dg.build_sensor_context(instance=instance, cursor=again.cursor))
    assert isinstance(third, dg.SensorResult)
    assert _events_by_key(third)["topologies/wordcount"]["6_desired_instances"] == 3
    assert set(_events_by_key(third)) == {"topologies/wordcount"}


def _overview_metadata(instance: dg.DagsterInstance, key: dg.AssetKey) -> list[str]:
    """The keys of the asset page's Metadata table, in order, as Dagster's UI picks them:
    the latest materialization's, else the latest observation's (AssetNodeOverview.tsx:
    ``event={materialization || observation}``), in insertion order."""
    materialized = instance.fetch_materializations(key, limit=1).records
    if materialized:
        return list(materialized[0].asset_materialization.metadata)  # type: ignore[union-attr]
    observed = instance.fetch_observations(key, limit=1).records
    return list(observed[0].asset_observation.metadata) if observed else []  # type: ignore[union-attr]


def _plot_titles(instance: dg.DagsterInstance, key: dg.AssetKey) -> list[str]:
    """The asset's Plots tab titles, in order, as Dagster's UI makes them: one per int or
    float entry of its recent materializations and observations, sorted by key
    (AssetMaterializationGraphs.tsx: ``Object.keys(...).sort()``)."""
    events = [
        *(r.asset_materialization for r in instance.fetch_materializations(key, limit=100).records),
        *(r.asset_observation for r in instance.fetch_observations(key, limit=100).records),
    ]
    labels = {
        label
        for event in events
        if event is not None
        for label, value in event.metadata.items()
        if isinstance(value, dg.IntMetadataValue | dg.FloatMetadataValue)
    }
    return sorted(labels)


def test_the_topology_asset_shows_its_headline_first() -> None:
    instance = dg.DagsterInstance.ephemeral()
    reg = TopologyRegistration("wordcount", wordcount.build)
    DesiredStateStore(instance).set(
        "wordcount", DesiredState(3, allocate({"sourceTopic": [0, 1, 2, 3]}, 3, generation=4))
    )
    key = topology_asset_key("wordcount")
    rate = Rate(12.5, 30.0)
    runs = [_live_run(instance, "wordcount", i, 4) for i in range(2)]

    def observe_instances() -> None:
        for i, run_id in enumerate(runs):
            numbers = InstanceNumbers(records_in=100, lag=3 + i, dead_letters=i)
            rates = {"records_in": rate, "records_out": rate}
            _observe_as(instance, run_id, key, instance_metadata(i, 4, numbers, rates))

    observe_instances()
    result = build_metrics_sensor({"wordcount": reg})(dg.build_sensor_context(instance=instance))
    assert isinstance(result, dg.SensorResult)
    for event in result.asset_events:  # as the daemon stores a sensor's events
        instance.report_runless_asset_event(event)
    # The instances report again after the sensor: still the topology's numbers lead.
    observe_instances()

    table = _overview_metadata(instance, key)
    assert table[:6] == list(HEADLINE), table
    assert table[6:9] == ["phase", "paused", "generation"]
    totals = instance.fetch_materializations(key, limit=1).records[0].asset_materialization
    assert totals is not None
    values = {k: v.value for k, v in totals.metadata.items()}
    assert [values[k] for k in HEADLINE] == [7, 25.0, 25.0, 1, 2, 3]

    plots = _plot_titles(instance, key)
    assert plots[:6] == list(HEADLINE), plots
    # The topology's other totals next, then each instance's detail.
    rest = plots[6:]
    assert rest == sorted(rest, key=lambda k: not k.startswith("all."))
    assert {k.split(".")[0] for k in rest} == {"all", "instance_0", "instance_1"}
    # Identifiers are labels, never plotted.
    assert not {"instance", "generation", "phase"} & set(plots)


# -- alerts ----------------------------------------------------------------------------------


#: Alerts the hooks received (STREAM_ASSETS_ALERT_HOOKS=tests.unit.test_observability:record).
ALERTS: list[Alert] = []
#: That setting's hooks, as the checks' callers pass them on.
HOOKS = ("tests.unit.test_observability:record",)


def record(alert: Alert) -> None:
    """An alert hook for these tests."""
    ALERTS.append(alert)


def _failed_instance_run(instance: dg.DagsterInstance, index: int, reason: str) -> dg.DagsterRun:
    run = instance.create_run_for_job(
        instance_job,
        tags={TOPOLOGY_TAG: "wordcount", INSTANCE_INDEX_TAG: str(index), GENERATION_TAG: "1"},
        run_config={"ops": {"run_instance": {"config": {"topology": "wordcount"}}}},
    )
    instance.report_run_failed(run, reason)
    failed = instance.get_run_by_id(run.run_id)
    assert failed is not None
    return failed


def _latest_evaluation(
    instance: dg.DagsterInstance, key: dg.AssetCheckKey
) -> dg.AssetCheckEvaluation:
    summary = instance.event_log_storage.get_asset_check_summary_records([key])[key]
    record = summary.last_check_execution_record
    assert record is not None and record.event is not None
    evaluation = record.event.asset_check_evaluation
    assert evaluation is not None
    return evaluation


def test_a_crash_alert_is_a_failed_check_on_the_topology_until_the_window_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAM_ASSETS_ALERT_HOOKS", "tests.unit.test_observability:record")
    monkeypatch.setenv("STREAM_ASSETS_CRASH_WINDOW_S", "600")
    ALERTS.clear()
    instance = dg.DagsterInstance.ephemeral()
    key = crash_check_key("wordcount")
    assert key.name == check_name("wordcount", CRASHES)
    run = _failed_instance_run(instance, 1, "the broker refused the connection")

    alert_sensor_tick(instance, run)
    (alert,) = ALERTS  # the hooks got it
    assert (alert.kind, alert.instance, alert.run_id) == ("crash", 1, run.run_id)
    evaluation = _latest_evaluation(instance, key)
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert evaluation.description is not None
    assert evaluation.description.startswith(alert.describe())
    assert evaluation.metadata["instance"] == dg.MetadataValue.text("1")  # a label
    # Not one more observation among the metrics: the topology asset got none.
    assert not instance.fetch_observations(topology_asset_key("wordcount"), limit=5).records

    # The checks keep it failed through the crash window, then pass it.
    now = time.time()
    within = crash_outcome(instance, "wordcount", now + 60, 600)
    assert not within.passed and run.run_id in within.description
    assert crash_outcome(instance, "wordcount", now + 601, 600).passed

    # Executed from the UI (a run, the crash check alone): the same verdict, and no
    # broker needed (the resource points nowhere).
    topology = wordcount.build()
    defs = dg.Definitions(
        assets=lineage_asset_specs([topology]),
        asset_checks=[topology_checks(topology)],
        jobs=[dg.define_asset_job("crash_check", selection=dg.AssetSelection.checks(key))],
        resources={"rocketmq": RocketMQResource(namesrv_addr="127.0.0.1:1")},
    )
    result = defs.resolve_job_def("crash_check").execute_in_process(instance=instance)
    assert result.success
    (evaluated,) = result.get_asset_check_evaluations()
    assert (evaluated.check_name, evaluated.passed) == (key.name, False)
    assert len(ALERTS) == 1  # evaluating the check alerts nobody again


def test_metrics_sensor_prefixes_keys_on_a_topic_two_topologies_share() -> None:
    instance = dg.DagsterInstance.ephemeral()
    regs = {
        "wordcount": TopologyRegistration("wordcount", wordcount.build),
        "wc2": TopologyRegistration("wc2", lambda: wordcount.build(job_id="wc2", sink="wc2-out")),
    }
    DesiredStateStore(instance).set("wc2", DesiredState(1, allocate({"sourceTopic": [0]}, 1)))
    run_id = _live_run(instance, "wc2", 0, 1)
    numbers = InstanceNumbers(lag=3, lag_per_queue={"sourceTopic": {0: 3}})
    _observe_as(instance, run_id, topology_asset_key("wc2"), instance_metadata(0, 1, numbers, {}))
    result = build_metrics_sensor(regs)(dg.build_sensor_context(instance=instance))
    assert isinstance(result, dg.SensorResult)
    seen = _events_by_key(result)
    assert seen["topics/sourceTopic"] == {
        "wc2.lag": 3,
        "wc2.lag_per_queue": {"sourceTopic": {"0": 3}},
        "topology": "wc2",
    }
    assert seen["topics/wc2_out"]["lag"] == 3  # its own sink: plain keys


# -- checks --------------------------------------------------------------------------------


class _FakeBroker:
    """A broker as the checks see it; the test moves its numbers."""

    def __init__(self) -> None:
        self.topics: set[str] = {"sourceTopic"}
        self.lags: dict[str, dict[int, int]] = {"sourceTopic": {0: 0, 1: 0}}
        self.ends: dict[str, dict[int, int]] = {}
        self.latest: dict[str, int] = {}
        self.waiting: int | None = None

    def topic_exists(self, topic: str) -> bool:
        return topic in self.topics

    def lag(self, group: str, topic: str) -> dict[int, int]:
        assert group == "wordcount"  # the topology's consumer group
        return self.lags[topic]

    def end_offsets(self, topic: str) -> dict[int, int]:
        return self.ends.get(topic, {})

    def latest_store_ms(self, topic: str) -> int | None:
        return self.latest.get(topic)

    def oldest_waiting_ms(self, group: str, topics: Sequence[str]) -> int | None:
        return self.waiting


def _report(instance: dg.DagsterInstance, outcomes: Sequence[Any]) -> dict[str, bool]:
    for outcome in outcomes:
        instance.report_runless_asset_event(outcome.evaluation())
    return {o.check_name.split("__", 1)[1]: o.passed for o in outcomes}


def test_checks_lag_dead_letters_and_freshness_over_successive_evaluations() -> None:
    ALERTS.clear()
    instance = dg.DagsterInstance.ephemeral()
    topology = wordcount.build()
    broker = _FakeBroker()
    settings = CheckSettings(max_lag=100, fresh_within_s=300)
    previous = previous_evaluation(instance)
    now = 1_800_000_000_000
    dead = topology.dead_letter_topic
    logged: list[str] = []

    def evaluate() -> dict[str, bool]:
        """One evaluation as the checks sensor makes it: alert, then record the results."""
        outcomes = evaluate_topology(topology, broker, previous, settings, now)
        raise_dead_letter_alerts(topology, outcomes, HOOKS, logged.append)
        return _report(instance, outcomes)

    # First evaluation: nothing waiting, no dead-letter topic yet (baseline).
    assert evaluate() == {LAG: True, DEAD_LETTERS: True, FRESH: True}
    broker.lags["sourceTopic"] = {0: 80, 1: 21}
    broker.waiting = now - 10_000
    assert evaluate() == {LAG: False, DEAD_LETTERS: True, FRESH: True}
    assert not ALERTS
    # Drained, one poison record became a dead letter, the sink was written.
    broker.lags["sourceTopic"] = {0: 0, 1: 0}
    broker.ends[dead] = {0: 1}
    broker.latest[dead] = now - 2_000
    broker.latest["wordcount-out"] = now - 5_000
    broker.waiting = None
    assert evaluate() == {LAG: True, DEAD_LETTERS: False, FRESH: True}
    (alert,) = ALERTS  # the hooks hear of the batch once
    assert (alert.kind, alert.topology, alert.instance, alert.dead_letters) == (
        "dead_letters",
        "wordcount",
        None,
        1,
    )
    assert logged == [alert.describe()]
    # Nothing new since: the check stays failed (a warning), and no second alert.
    now += 60_000
    assert evaluate() == {LAG: True, DEAD_LETTERS: False, FRESH: True}
    key = dg.AssetCheckKey(topic_asset_key(dead), check_name("wordcount", DEAD_LETTERS))
    latest = previous(key)
    assert latest is not None and latest["new_dead_letters"].value == 0
    assert len(ALERTS) == 1
    # A restarting broker: the topics are unknown for a moment. The dead letter
    # seen before is neither counted again once they are back nor forgotten.
    broker.topics.clear()
    saved, broker.ends = broker.ends, {}
    assert evaluate() == {LAG: False, DEAD_LETTERS: False, FRESH: True}
    broker.topics.add("sourceTopic")
    broker.ends = saved
    assert evaluate() == {LAG: True, DEAD_LETTERS: False, FRESH: True}
    assert len(ALERTS) == 1
    # Input sits unconsumed for longer than the bound while the sink is silent.
    now += 3_600_000
    broker.waiting = now - 301_000
    assert evaluate() == {LAG: True, DEAD_LETTERS: False, FRESH: False}
    # A day after the newest dead letter the check passes by itself; a new one fails it
    # again and alerts again.
    now += 24 * 3_600_000
    broker.waiting = None
    assert evaluate() == {LAG: True, DEAD_LETTERS: True, FRESH: True}
    broker.ends[dead] = {0: 3}
    broker.latest[dead] = now - 1_000
    assert evaluate() == {LAG: True, DEAD_LETTERS: False, FRESH: True}
    assert [a.dead_letters for a in ALERTS] == [1, 2]


def test_a_missing_source_topic_fails_the_lag_check() -> None:
    broker = _FakeBroker()
    broker.topics.clear()
    outcomes = evaluate_topology(wordcount.build(), broker, lambda key: None, CheckSettings())
    lag = next(o for o in outcomes if o.check_name == check_name("wordcount", LAG))
    assert not lag.passed and "does not exist" in lag.description


def test_freshness_gives_new_input_the_bound_before_failing() -> None:
    now = 2_000_000_000_000
    # Never written, input only 100 s old: not overdue yet.
    assert freshness_outcome("wc", "out", None, now - 100_000, now, 300).passed
    stale = freshness_outcome("wc", "out", None, now - 400_000, now, 300)
    assert not stale.passed and stale.description.startswith("no output yet")


def test_check_bounds_from_the_environment_with_a_per_topology_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STREAM_ASSETS_CHECK_MAX_LAG", "2500")
    monkeypatch.setenv("STREAM_ASSETS_CHECK_FRESH_WITHIN_S", "120")
    monkeypatch.setenv("STREAM_ASSETS_CHECK_OVERRIDES", '{"clicks": {"max_lag": 10}}')
    settings = CheckSettings()
    assert settings.bounds("clicks") == (10, 120.0)
    assert settings.bounds("wordcount") == (2500, 120.0)


def test_checks_are_declared_on_the_source_dead_letter_and_sink_assets() -> None:
    topologies = [wordcount.build(), wordcount.build(job_id="wc2", sink="wc2-out")]
    defs = dg.Definitions(
        assets=lineage_asset_specs(topologies),
        asset_checks=[topology_checks(t) for t in topologies],
        resources={"rocketmq": RocketMQResource()},
    )
    dg.Definitions.validate_loadable(defs)
    keys = {
        (k.asset_key.to_user_string(), k.name) for k in defs.resolve_asset_graph().asset_check_keys
    }
    assert keys == {
        ("topologies/wordcount", "wordcount__no_recent_crashes"),
        ("topologies/wc2", "wc2__no_recent_crashes"),
        ("topics/sourceTopic", "wordcount__lag_within_bound"),
        ("topics/sourceTopic", "wc2__lag_within_bound"),  # a shared source: one check each
        ("topics/wordcount__dead_letters", "wordcount__no_recent_dead_letters"),
        ("topics/wc2__dead_letters", "wc2__no_recent_dead_letters"),
        ("topics/wordcount_out", "wordcount__output_fresh"),
        ("topics/wc2_out", "wc2__output_fresh"),
    }
