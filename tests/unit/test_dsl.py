"""Malformed topologies fail at build time, naming the operator at fault (no broker)."""

from __future__ import annotations

import pytest

from stream_assets.dsl.builder import StreamBuilder
from stream_assets.serde import json_deserializer, text_deserializer


def _words() -> object:
    return StreamBuilder("job").source("lines", text_deserializer).flat_map(str.split)


@pytest.mark.parametrize("aggregate", ["count", "sum", "min", "max", "avg", "aggregate"])
def test_aggregate_without_key_names_the_aggregate(aggregate: str) -> None:
    stream = StreamBuilder("job").source("events", json_deserializer)
    with pytest.raises(TypeError, match=rf"^{aggregate}: an aggregate needs a key"):
        getattr(stream, aggregate)("value")


def test_sink_to_an_empty_topic_name_names_the_sink() -> None:
    stream = _words().key_by(str).count().to_rstream()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"^sink topic '' is not valid"):
        stream.sink("")


def test_sink_to_an_invalid_topic_name_names_the_sink() -> None:
    stream = _words().key_by(str).count().to_rstream()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"^sink topic 'no spaces' is not valid"):
        stream.sink("no spaces")


@pytest.mark.parametrize("operator", ["map", "flat_map", "filter", "foreach"])
def test_non_callable_function_names_the_operator(operator: str) -> None:
    stream = StreamBuilder("job").source("events", json_deserializer)
    with pytest.raises(TypeError, match=rf"^{operator}: expected a callable, got int 42"):
        getattr(stream, operator)(42)


def test_key_by_without_aggregate_is_refused() -> None:
    builder = StreamBuilder("job")
    builder.source("lines", text_deserializer).flat_map(str.split).key_by(str)
    with pytest.raises(ValueError, match=r"^job: a key_by\(\.\.\.\) is not followed by an agg"):
        builder.build()


def test_a_second_key_by_after_an_aggregate_cuts_a_third_stage() -> None:
    builder = StreamBuilder("job")
    (
        builder.source("lines", text_deserializer)
        .flat_map(str.split)
        .key_by(str)
        .count()
        .to_rstream()
        .key_by(lambda result: result["count"])
        .count()
        .to_rstream()
        .sink("out")
    )
    stages = builder.build().stages
    assert [s.upstreams for s in stages] == [(), (0,), (1,)]
    assert stages[1].output_topics == (stages[2].input_topic,)
    assert stages[2].sink_topics == ("out",)


def test_a_well_formed_topology_builds_two_stages() -> None:
    """The control: the same chain, correctly ended, compiles."""
    builder = StreamBuilder("job")
    (
        builder.source("lines", text_deserializer)
        .flat_map(str.split)
        .key_by(str)
        .count()
        .to_rstream()
        .sink("out")
    )
    topology = builder.build()
    assert [s.index for s in topology.stages] == [0, 1]
    assert topology.sink_topics == ("out",)
