"""An instance on the real broker serves its counts and lag at its Prometheus endpoint.

WordCount over a few hundred lines: the endpoint is scraped over HTTP while the
instance runs, until the source stage's records-in total equals the messages
produced so far (half of them, then all); once caught up, each queue's lag
gauge equals what the broker's own offsets say (end offset minus the group's
committed offset). Expected values come from the produced input and from the
broker, not from the exporter.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.layout import TopicLayout
from stream_assets.settings import RocketMQSettings
from tests.integration._engine_util import BackgroundProducer, Message, unique, wait_until
from tests.integration._util import free_port
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

CATCH_UP_S = 240.0
LINES = 600
SOURCE_QUEUES = 4

Series = dict[frozenset[tuple[str, str]], float]


def _scrape(url: str) -> dict[str, Series]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, Series] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name][frozenset(s.labels.items())] = s.value
    return samples


def _total(series: Series, **where: str) -> float:
    return sum(v for k, v in series.items() if all(dict(k)[n] == w for n, w in where.items()))


def test_the_endpoint_counts_every_record_and_its_lag_matches_the_broker(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    job = unique("it-prom")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, SOURCE_QUEUES)
    lines = [f"alpha beta w{i % 37} gamma" for i in range(LINES)]
    words = sum(len(line.split()) for line in lines)
    messages = [Message(line.encode(), key=f"l{i}") for i, line in enumerate(lines)]

    port = free_port()
    inst = engine.instance(
        wordcount.build(job, source, sink),
        tmp_path / "state",
        metrics_port=port,
        metrics_host="127.0.0.1",
    )
    engine.start(inst)
    url = inst.metrics_url
    assert url == f"http://127.0.0.1:{port}/metrics"

    def source_records_in() -> float:
        return _total(_scrape(url)["stream_assets_records_in_total"], input="source")

    # Input arrives while the instance runs: each of the two producers sends half of
    # its share, and the endpoint counts exactly that before the rest comes.
    half = LINES // 2
    producer = BackgroundProducer(
        client_settings, source, messages, threads=2, pause_after=half // 2
    )
    producer.start()
    wait_until(
        lambda: producer.sent == half and source_records_in() == half,
        CATCH_UP_S,
        f"the endpoint to count the first {half} source records",
    )
    producer.join()  # resumes the rest
    wait_until(
        lambda: source_records_in() == LINES,
        CATCH_UP_S,
        f"the endpoint to count all {LINES} source records",
    )
    inst.await_caught_up(CATCH_UP_S)  # polls the lag: the gauges are as of now
    samples = _scrape(url)

    records_in = samples["stream_assets_records_in_total"]
    assert _total(records_in, input="source") == LINES
    assert _total(records_in, stage="1") == words
    assert {dict(k)["queue"] for k in records_in if dict(k)["stage"] == "0"} <= {
        str(q) for q in range(SOURCE_QUEUES)
    }
    assert _total(samples["stream_assets_dead_letters_total"]) == 0
    # The same counts as the Dagster observations read.
    for i, m in inst.metrics.items():
        assert _total(records_in, stage=str(i)) == m.totals["records_in"]
        durations = samples["stream_assets_batch_duration_seconds_count"]
        assert _total(durations, stage=str(i)) == m.batches
    assert _total(samples["stream_assets_records_out_total"]) == sum(
        m.totals["outputs"] for m in inst.metrics.values()
    )

    # Lag per queue of every stage input, against the broker's own offsets.
    lag = samples["stream_assets_lag_messages"]
    for stage in inst.topology.stages:
        # The queue label is the queue's index in the topic's layout (broker, then id).
        queues = TopicLayout.of(admin.queues(stage.input_topic)).queues
        ends = admin.topic_offsets(stage.input_topic, queues)
        committed = admin.group_offsets(inst.group, stage.input_topic, queues)
        for index, queue in enumerate(queues):
            floor = committed[queue]
            broker_lag = ends[queue].max_offset - (
                ends[queue].min_offset if floor is None else floor
            )
            labels = {
                "topology": job,
                "instance": "0",
                "generation": "0",
                "stage": str(stage.index),
                "input": "source" if stage.source is not None else "shuffle",
                "topic": stage.input_topic,
                "queue": str(index),
            }
            assert lag[frozenset(labels.items())] == broker_lag == 0, labels

    engine.stop(inst)
    with pytest.raises(urllib.error.URLError):
        _scrape(url)  # stopped: the port is given back
