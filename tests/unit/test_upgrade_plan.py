"""Stable operator names and the upgrade plan (stream_assets/plan/names.py, plan/upgrade.py):
what a changed topology's start keeps, starts empty or refuses, with no broker.

The broker is stood for by the set of topics that exist; the previous version's
record is what planning the previous topology recorded, as a start records it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples.activity_sessions import ActivitySessions
from stream_assets.plan.topology import Topology
from stream_assets.plan.upgrade import (
    TopologyRecord,
    UpgradePlan,
    UpgradeRefusedError,
    plan_upgrade,
)
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.windows import Time, TumblingWindow


def _wordcount(
    job: str = "wc",
    *,
    before_key: Callable[[Any], Any] | None = None,
    second_sink: bool = False,
    agg: str = "count",
    name: str | None = None,
) -> Topology:
    """WordCount, optionally with a filter and a map before key_by and a second sink."""
    b = StreamBuilder(job)
    words = b.source("lines", text_deserializer).flat_map(str.split)
    if before_key is not None:
        words = words.filter(lambda w: bool(w)).map(before_key)
    grouped = words.key_by(lambda w: w)
    counted = grouped.count(name=name) if agg == "count" else grouped.sum(len, name=name)
    out = counted.to_rstream()
    out.sink("counts")
    if second_sink:
        out.map(lambda r: r["key"]).sink("words-seen")
    return b.build()


def _recorded(topology: Topology, exists: set[str] | None = None) -> TopologyRecord:
    """The record a start of ``topology`` writes (a job's first start, or a positional one)."""
    plan = plan_upgrade(topology, None, (exists or set()).__contains__)
    plan.refuse_if_needed()
    return plan.record


def _topics(topology: Topology) -> list[tuple[str, str | None]]:
    return [(s.input_topic, s.state_topic) for s in topology.stages if s.head is not None]


def test_names_survive_stateless_edits_sinks_and_other_branches() -> None:
    v1 = _wordcount()
    v2 = _wordcount(before_key=str.lower, second_sink=True)
    assert _topics(v1) == _topics(v2) == [("wc__shuffle__aggregate", "wc__state__aggregate")]
    sinks = [x.op_id for x in v2.nodes if x.op_id.startswith("sink")]
    assert sinks == ["sink_counts", "sink_words-seen"]
    # key_by(name=) names the aggregate after it; an aggregate's own name wins.
    b = StreamBuilder("named")
    words = b.source("lines", text_deserializer)
    words.key_by(len, name="by-length").count().to_rstream().sink("a")
    words.key_by(len, name="ignored").count(name="counts").to_rstream().sink("b")
    words.key_by(len).count().to_rstream().sink("c")
    assert [s.head.op_id for s in b.build().stages if s.head] == [
        "by-length",
        "counts",
        "aggregate",
    ]


def test_a_name_used_twice_or_unusable_is_refused_at_build() -> None:
    b = StreamBuilder("twice")
    words = b.source("lines", text_deserializer)
    words.key_by(len).count(name="n").to_rstream().sink("a")
    words.key_by(len).count(name="n").to_rstream().sink("b")
    with pytest.raises(ValueError, match=r"\['n'\] given twice"):
        b.build()
    with pytest.raises(ValueError, match="1-32 letters"):
        words.key_by(len, name="no spaces")


def test_an_upgrade_with_stateless_changes_carries_the_state_over() -> None:
    v1 = _wordcount()
    plan = plan_upgrade(
        _wordcount(before_key=str.lower, second_sink=True), _recorded(v1), lambda _: True
    )
    plan.refuse_if_needed()
    assert plan.carried == ("aggregate",) and not plan.new and not plan.removed
    assert _topics(plan.topology) == _topics(v1)
    assert "state carried over for aggregate" in plan.describe()


def test_an_incompatible_change_is_refused_naming_the_operator_until_its_state_is_dropped() -> None:
    v1 = _wordcount(name="counts")
    record = _recorded(v1)
    plan = plan_upgrade(_wordcount(agg="sum", name="counts"), record, lambda _: True)
    with pytest.raises(UpgradeRefusedError) as refused:
        plan.refuse_if_needed()
    message = str(refused.value)
    assert "'counts'" in message and "Count" in message and "Sum" in message
    assert "--drop-state counts" in message
    dropped = plan_upgrade(
        _wordcount(agg="sum", name="counts"), record, lambda _: True, accepted=["counts"]
    )
    dropped.refuse_if_needed()
    assert dropped.dropped == ("counts",) and dropped.carried == ()
    assert dropped.record.operator("counts").format["accumulators"] == [["sum", "Sum"]]  # type: ignore[union-attr]


def test_a_renamed_operator_is_refused_until_named_as_before_or_let_go() -> None:
    record = _recorded(_wordcount(name="counts"))
    renamed = _wordcount(name="tally")
    with pytest.raises(UpgradeRefusedError, match=r"'tally' is new and aggregate operator"):
        plan_upgrade(renamed, record, lambda _: True).refuse_if_needed()
    let_go = plan_upgrade(renamed, record, lambda _: True, accepted=["counts"])
    let_go.refuse_if_needed()
    assert let_go.new == ("tally",) and let_go.removed == ("counts",)
    retired = let_go.record.operator("counts")
    assert retired is not None and retired.retired
    # Coming back later, its topics hold the state of back then: refused again.
    back = plan_upgrade(_wordcount(name="counts"), let_go.record, lambda _: True)
    with pytest.raises(UpgradeRefusedError, match="removed by an earlier version"):
        back.refuse_if_needed()


def test_a_job_of_the_previous_release_keeps_its_positional_topics_and_message_keys() -> None:
    v1 = _wordcount()
    positional = {"wc__state__aggregate-3", "wc__shuffle__key_by-2"}
    plan = plan_upgrade(v1, None, positional.__contains__)
    plan.refuse_if_needed()
    assert _topics(plan.topology) == [("wc__shuffle__key_by-2", "wc__state__aggregate-3")]
    assert [x.op_id for x in plan.topology.nodes][-2:] == ["aggregate-3", "sink-4"]
    # Recorded: the next version, with a filter and a map added, still finds them.
    v2 = _wordcount(before_key=str.lower, second_sink=True)
    again = plan_upgrade(v2, plan.record, lambda _: True)
    again.refuse_if_needed()
    assert _topics(again.topology) == _topics(plan.topology)
    sinks = [x.op_id for x in again.topology.nodes if x.op_id.startswith("sink")]
    assert sinks == ["sink-4", "sink_words-seen"]


def test_state_of_the_previous_release_that_no_operator_claims_is_refused() -> None:
    """Changed while the engine was upgraded: the positional ids moved, so the old state
    topic would be left behind silently; refused, naming it, unless let go."""
    changed = _wordcount(before_key=str.lower)
    exists = {"wc__state__aggregate-3"}
    plan = plan_upgrade(changed, None, exists.__contains__, job_state_topics=exists)
    with pytest.raises(UpgradeRefusedError, match="wc__state__aggregate-3 of an earlier"):
        plan.refuse_if_needed()
    let_go = plan_upgrade(
        changed, None, exists.__contains__, accepted=["aggregate-3"], job_state_topics=exists
    )
    let_go.refuse_if_needed()
    assert _topics(let_go.topology) == [("wc__shuffle__aggregate", "wc__state__aggregate")]


def test_format_changes_of_windows_joins_and_processors_are_seen() -> None:
    def windowed(seconds: int) -> Topology:
        b = StreamBuilder("w")
        (
            b.source("in", json_deserializer)
            .key_by("k")
            .window(TumblingWindow.of(Time.seconds(seconds)))
            .count()
            .to_rstream()
            .sink("o")
        )
        return b.build()

    def processor(gap: int) -> Topology:
        b = StreamBuilder("p")
        b.source("in", json_deserializer).key_by("k").process(ActivitySessions(gap)).sink("o")
        return b.build()

    with pytest.raises(UpgradeRefusedError, match="window"):
        plan_upgrade(windowed(20), _recorded(windowed(10)), lambda _: True).refuse_if_needed()
    # A processor's configuration is its own business: the same class carries over.
    same: UpgradePlan = plan_upgrade(processor(9), _recorded(processor(5)), lambda _: True)
    assert same.carried == ("process",) and not same.problems


def test_the_record_is_versioned_and_a_foreign_one_says_what_to_do() -> None:
    record = _recorded(_wordcount())
    assert TopologyRecord.decode("wc", record.encode()) == record
    with pytest.raises(ValueError, match=r"version 99, this release reads 1.*newer release"):
        TopologyRecord.decode("wc", record.encode().replace('"version":1', '"version":99'))
