"""The Dagster surface built from the registry: topic lineage, schedules, resources."""

import json
from pathlib import Path

import dagster as dg
import pytest

from stream_assets.control.lineage import (
    SHARED_GROUP,
    lineage_asset_specs,
    topic_asset_key,
    topology_asset_key,
    topology_asset_specs,
)
from stream_assets.control.registry import (
    REGISTRY,
    TARGET_INSTANCES_TAG,
    TOPOLOGY_TAG,
    ScaleSchedule,
    TopologyRegistration,
)
from stream_assets.examples import windowed_sum, wordcount
from stream_assets.jobs.schedules import all_scale_schedules, scale_run_config, scale_schedules
from stream_assets.resources import RocksDBStateStoreResource, SparkResource
from stream_assets.state.store import QueueStateStore


# A stand-in for the real scale job: same job name, op name and op config.
class ScaleConfig(dg.Config):
    topology: str
    target_instances: int


@dg.op(name="scale")
def scale_op(config: ScaleConfig) -> None:
    del config


@dg.job(name="scale_job")
def scale_job() -> None:
    scale_op()


def parents(defs: dg.Definitions, key: dg.AssetKey) -> set[dg.AssetKey]:
    return set(defs.resolve_asset_graph().get(key).parent_keys)


T = topic_asset_key
J = topology_asset_key


def test_wordcount_and_windowed_sum_lineage() -> None:
    defs = dg.Definitions(assets=lineage_asset_specs([wordcount.build(), windowed_sum.build()]))
    dg.Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()

    expected_edges = {
        # child: parents
        J("wordcount"): {T("sourceTopic")},
        T("wordcount__shuffle__aggregate"): {J("wordcount")},
        T("wordcount__state__aggregate"): {J("wordcount")},
        T("wordcount-out"): {J("wordcount")},
        T("wordcount__dead-letters"): {J("wordcount")},
        T("sourceTopic"): set(),
        J("windowed-sum"): {T("events")},
        T("windowed-sum__shuffle__aggregate"): {J("windowed-sum")},
        T("windowed-sum__state__aggregate"): {J("windowed-sum")},
        T("windowed-sum-out"): {J("windowed-sum")},
        T("windowed-sum-late"): {J("windowed-sum")},
        T("windowed-sum__dead-letters"): {J("windowed-sum")},
        T("events"): set(),
    }
    assert set(graph.get_all_asset_keys()) == set(expected_edges)
    for child, want in expected_edges.items():
        assert parents(defs, child) == want, child
    # source -> topology -> sink is a path in the graph the UI draws.
    assert T("sourceTopic") in graph.get_ancestor_asset_keys(T("wordcount-out"))
    assert graph.get(T("windowed-sum-out")).group_name == "windowed_sum"
    assert graph.get(T("windowed-sum-out")).kinds == {"rocketmq"}


def test_keys_are_sanitized_and_real_names_kept() -> None:
    specs = {s.key: s for s in topology_asset_specs(windowed_sum.build())}
    assert len(specs) == 7  # 6 topics + the topology, no duplicates
    out = specs[dg.AssetKey(["topics", "windowed_sum_out"])]
    assert out.metadata["topic"] == "windowed-sum-out"
    assert out.metadata["roles"] == "sink"
    for key in specs:
        assert all(part.replace("_", "").isalnum() for part in key.path), key
    # String-form keys (as an op might log them) parse back to the same key.
    assert dg.AssetKey.from_user_string(out.key.to_user_string()) == out.key
    assert dg.AssetMaterialization(asset_key=out.key.to_user_string()).asset_key == out.key


def test_shared_and_chained_topics_become_one_asset() -> None:
    first = wordcount.build()
    same_source = wordcount.build(job_id="wordcount2", sink="wordcount2-out")
    # A topology reading the first one's sink: lineage continues through the topic.
    chained = windowed_sum.build(job_id="rollup", source="wordcount-out", sink="rollup-out")
    specs = lineage_asset_specs([first, same_source, chained])
    keys = [s.key for s in specs]
    assert len(keys) == len(set(keys)), "no duplicate keys"
    defs = dg.Definitions(assets=specs)
    dg.Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    assert parents(defs, J("wordcount")) == {T("sourceTopic")}
    assert parents(defs, J("wordcount2")) == {T("sourceTopic")}
    assert parents(defs, J("rollup")) == {T("wordcount-out")}
    assert parents(defs, T("wordcount-out")) == {J("wordcount")}
    assert J("wordcount") in graph.get_ancestor_asset_keys(T("rollup-out"))
    by_key = {s.key: s for s in specs}
    assert by_key[T("sourceTopic")].group_name == SHARED_GROUP
    assert by_key[T("wordcount-out")].metadata["roles"] == "source, sink"
    assert by_key[T("wordcount-out")].metadata["topologies"] == "rollup, wordcount"


def test_colliding_names_are_an_error_not_a_merge() -> None:
    a = wordcount.build(sink="out-x")
    b = wordcount.build(job_id="wc2", sink="out_x")
    with pytest.raises(ValueError, match="both map to asset key 'topics/out_x'"):
        lineage_asset_specs([a, b])
    with pytest.raises(ValueError, match="listed twice"):
        lineage_asset_specs([a, a])


def test_registry_definitions_load() -> None:
    """The code location workspace.yaml loads: assets, jobs, sensor, schedules, resources."""
    from stream_assets.definitions import defs

    dg.Definitions.validate_loadable(defs)
    assert {"wordcount", "windowed-sum"} <= set(REGISTRY)
    specs = defs.resolve_all_asset_specs()
    assert len(specs) == len({s.key for s in specs})
    repo = defs.get_repository_def()
    assert {
        "instance_job",
        "scale_job",
        "roundtrip_job",
        "stop_topology_job",
        "start_topology_job",
    } <= {j.name for j in repo.get_all_jobs()}
    assert {"supervisor_sensor", "instance_failure_alerts"} <= {s.name for s in repo.sensor_defs}
    assert {s.name for s in repo.schedule_defs} == {
        "scale_wordcount_to_2_at_0800",
        "scale_wordcount_to_1_at_2000",
    }
    # Lineage through the real definitions: source -> topology -> shuffle/state/sink.
    graph = defs.resolve_asset_graph()
    wc = dg.AssetKey(["topologies", "wordcount"])
    assert graph.get(wc).parent_keys == {dg.AssetKey(["topics", "sourceTopic"])}
    assert dg.AssetKey(["topics", "wordcount_out"]) in graph.get(wc).child_keys


def test_registration_checks_its_topology() -> None:
    reg = TopologyRegistration("other-name", wordcount.build)
    with pytest.raises(ValueError, match="must be equal"):
        reg.topology()
    with pytest.raises(ValueError, match="cron"):
        ScaleSchedule("every morning", 2)
    with pytest.raises(ValueError, match=">= 1"):
        ScaleSchedule("0 8 * * *", 0)
    with pytest.raises(ValueError, match="not valid"):
        TopologyRegistration("bad name", wordcount.build)


# -- schedules -----------------------------------------------------------------


def test_scale_schedule_requests_the_scale_run() -> None:
    reg = TopologyRegistration(
        "windowed-sum",
        windowed_sum.build,
        schedules=(
            ScaleSchedule("0 8 * * 1-5", 4),
            ScaleSchedule("30 19 * * *", 1, "Asia/Shanghai"),
        ),
    )
    schedules = scale_schedules(reg, scale_job)
    assert [s.name for s in schedules] == [
        "scale_windowed_sum_to_4_at_0800",
        "scale_windowed_sum_to_1_at_1930",
    ]
    assert schedules[1].cron_schedule == "30 19 * * *"
    assert schedules[1].execution_timezone == "Asia/Shanghai"
    with dg.instance_for_test() as instance:
        for schedule, target in zip(schedules, (4, 1), strict=True):
            data = schedule.evaluate_tick(dg.build_schedule_context(instance=instance))
            assert data.run_requests is not None and len(data.run_requests) == 1
            request = data.run_requests[0]
            assert request.run_config == {
                "ops": {
                    "scale": {"config": {"topology": "windowed-sum", "target_instances": target}}
                }
            }
            assert request.tags[TOPOLOGY_TAG] == "windowed-sum"
            assert request.tags[TARGET_INSTANCES_TAG] == str(target)
            # The config is what the scale job's op accepts.
            assert dg.validate_run_config(scale_job, request.run_config)
        result = scale_job.execute_in_process(
            run_config=scale_run_config("windowed-sum", 4), instance=instance
        )
        assert result.success


def test_schedule_names_say_what_and_when_and_stay_unique() -> None:
    reg = TopologyRegistration(
        "wordcount",
        wordcount.build,
        schedules=(
            ScaleSchedule("0 8 * * 1-5", 2),
            ScaleSchedule("0 8 * * 0,6", 2),  # same target and time, other days
            ScaleSchedule("0 8 * * 1-5", 2, "Asia/Shanghai"),  # ... and another zone
            ScaleSchedule("0 8 * * 1-5", 2, "Asia/Shanghai"),  # a plain repeat
            ScaleSchedule("*/15 9-17 * * *", 3),
            ScaleSchedule("5 20 * * *", 1),
        ),
    )
    names = [s.name for s in scale_schedules(reg, scale_job)]
    assert names == [
        "scale_wordcount_to_2_at_0800_on_x_x_1to5_UTC",
        "scale_wordcount_to_2_at_0800_on_x_x_0and6",
        "scale_wordcount_to_2_at_0800_on_x_x_1to5_Asia_Shanghai_2",
        "scale_wordcount_to_2_at_0800_on_x_x_1to5_Asia_Shanghai_3",
        "scale_wordcount_to_3_cron_every15_9to17_x_x_x",
        "scale_wordcount_to_1_at_2005",
    ]
    other = TopologyRegistration("word-count", wordcount.build, schedules=reg.schedules[:1])
    clash = TopologyRegistration("word_count", wordcount.build, schedules=reg.schedules[:1])
    with pytest.raises(ValueError, match="'word-count' and 'word_count'"):
        all_scale_schedules([other, clash], scale_job)


# -- resources -----------------------------------------------------------------


def test_spark_resource_merges_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAM_ASSETS_ENGINE_SPARK_MASTER", "local[3]")
    monkeypatch.setenv(
        "STREAM_ASSETS_ENGINE_SPARK_CONF",
        json.dumps({"spark.driver.memory": "1g", "spark.executor.cores": "1"}),
    )
    monkeypatch.setenv("STREAM_ASSETS_ENGINE_SHUFFLE_QUEUES", "4")
    default = SparkResource().engine_settings()
    assert default.spark_master == "local[3]"
    assert default.shuffle_queues == 4
    custom = SparkResource(
        master="spark://cluster:7077", conf={"spark.driver.memory": "4g"}
    ).engine_settings(state_dir="/data/state")
    assert custom.spark_master == "spark://cluster:7077"
    assert custom.spark_conf == {"spark.driver.memory": "4g", "spark.executor.cores": "1"}
    assert custom.resolved_state_dir() == Path("/data/state")
    assert custom.shuffle_queues == 4


def test_state_store_resource_root_and_stats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAM_ASSETS_ENGINE_STATE_DIR", str(tmp_path / "env-state"))
    assert RocksDBStateStoreResource().root() == tmp_path / "env-state"
    resource = RocksDBStateStoreResource(root_dir=str(tmp_path / "state"), sync=True)
    engine = resource.with_state_dir(SparkResource().engine_settings())
    assert engine.resolved_state_dir() == tmp_path / "state"
    assert resource.queue_stats("wordcount") == []

    for queue in (0, 3):
        with resource.open_store("wordcount", "aggregate-3", queue) as store:
            meta = store.next_meta()
            store.commit({b"apple": b"1", b"pear": b"2"} if queue else {b"x": b"9"}, meta)
    held = QueueStateStore(tmp_path / "state", "wordcount", "aggregate-3", 3).open()
    try:
        stats = resource.queue_stats("wordcount")
    finally:
        held.close()
    assert [(s.operator_id, s.queue_id) for s in stats] == [("aggregate-3", 0), ("aggregate-3", 3)]
    assert (stats[0].keys, stats[0].seq) == (1, 1)
    assert (stats[1].keys, stats[1].seq) == (None, None)  # locked by a running task
    assert all(s.size_bytes > 0 for s in stats)
    assert resource.queue_stats("wordcount")[1].keys == 2


def test_resources_configure_through_dagster(tmp_path: Path) -> None:
    """Run config reaches the resources (Config classes must not use string annotations)."""
    seen: dict[str, object] = {}

    @dg.op
    def probe(spark: SparkResource, state_store: RocksDBStateStoreResource) -> None:
        engine = state_store.with_state_dir(spark.engine_settings())
        seen.update(master=engine.spark_master, conf=engine.spark_conf, root=state_store.root())

    @dg.job
    def probe_job() -> None:
        probe()

    defs = dg.Definitions(
        jobs=[probe_job],
        resources={"spark": SparkResource(), "state_store": RocksDBStateStoreResource()},
    )
    result = defs.get_job_def("probe_job").execute_in_process(
        run_config={
            "resources": {
                "spark": {"config": {"master": "local[1]", "conf": {"a.b": "c"}}},
                "state_store": {"config": {"root_dir": str(tmp_path)}},
            }
        }
    )
    assert result.success
    assert seen == {"master": "local[1]", "conf": {"a.b": "c"}, "root": tmp_path}
