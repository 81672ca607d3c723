"""State queries against a running WordCount: real broker, real Spark, real RocksDB.

One instance runs for the whole module (the shared SparkSession of
tests/integration/conftest.py). At a quiet point (``await_caught_up``: every
stage committed everything in its input) the state a query reads from the
state topic equals ``collections.Counter`` of the input, while the instance
keeps running; more input later shows up in the next answers, which proves the
queries neither stopped the instance nor read a stale copy. The command line
and the Dagster job are asked the same questions.
"""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stream_assets import cli
from stream_assets.control.registry import REGISTRY, TopologyRegistration
from stream_assets.control.state_query import query_state
from stream_assets.examples import wordcount
from stream_assets.jobs.state_query import state_query_job
from stream_assets.plan.topology import Topology
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.runtime.core.shuffle_codec import encode_key
from stream_assets.runtime.spark.instance import Instance
from stream_assets.settings import RocketMQSettings
from tests.integration._engine_util import Message, produce, unique
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

SHUFFLE_QUEUES = 4  # EngineHarness.instance's default
CATCH_UP_S = 90.0


def _lines(seed: int, count: int) -> list[str]:
    rnd = random.Random(seed)
    vocab = [f"w{i:03d}" for i in range(150)]
    return [" ".join(rnd.choices(vocab, k=6)) for _ in range(count)]


def _send(settings: RocketMQSettings, topic: str, lines: list[str], tag: str) -> None:
    messages = [
        Message("\n".join(lines[i : i + 20]).encode(), key=f"{tag}{i}")
        for i in range(0, len(lines), 20)
    ]
    produce(settings, topic, messages)


@dataclass
class Running:
    """The module's running WordCount and the reference count of everything it was sent."""

    instance: Instance
    topology: Topology
    source: str
    reference: collections.Counter[str]


@pytest.fixture(scope="module")
def running(
    engine_session: EngineHarness,
    client_settings: RocketMQSettings,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    """WordCount on 1 500 lines, caught up, registered under its job id; stopped at the end."""
    job = unique("sq_wc")
    source = f"{job}-src"
    with RocketMQAdmin(client_settings) as admin:
        admin.create_topic(source, 2)
    lines = _lines(seed=20260105, count=1_500)
    _send(client_settings, source, lines, "a")
    topology = wordcount.build(job, source, f"{job}-out")
    REGISTRY[job] = TopologyRegistration(job, lambda: topology)
    # Small batches (steps, in real-time mode) and frequent snapshots: each state
    # queue holds several commits and a snapshot, so a query rebuilds from snapshot + tail.
    inst = engine_session.instance(
        topology,
        tmp_path_factory.mktemp("sq_state") / "state",
        max_records_per_batch=15,
        step_max_records=15,
        snapshot_every=2,
    )
    engine_session.start(inst)
    try:
        inst.await_caught_up(CATCH_UP_S)
        yield Running(inst, topology, source, collections.Counter(" ".join(lines).split()))
    finally:
        engine_session.stop(inst)
        REGISTRY.pop(job, None)


def _probe_words(reference: collections.Counter[str]) -> list[str]:
    """The most and least frequent words and a few in between."""
    ranked = [w for w, _ in reference.most_common()]
    return sorted({*ranked[:3], *ranked[-3:], *ranked[len(ranked) // 2 :][:3]})


def test_query_equals_the_reference_at_a_quiet_point_without_stopping(
    running: Running, client_settings: RocketMQSettings, tmp_path: Path
) -> None:
    queues_seen, snapshots = set(), 0
    for word in _probe_words(running.reference):
        answer = query_state(
            running.topology.job_id, word, rocketmq=client_settings, scratch_dir=tmp_path
        )
        assert answer.value == {"count": running.reference[word]}, answer.describe()
        assert answer.queue_id == queue_for_key(encode_key(word), SHUFFLE_QUEUES)
        assert answer.seq > 0
        queues_seen.add(answer.queue_id)
        snapshots += answer.snapshot_offset is not None
    assert len(queues_seen) > 1  # the probes span several queues
    assert snapshots > 0  # some answers were rebuilt from a snapshot and its tail
    never = query_state(running.topology, "never-seen-word", rocketmq=client_settings)
    assert not never.found and never.value is None
    assert list(tmp_path.iterdir()) == []  # the private stores are gone

    # The instance kept running: new input is counted, and the next answers show it.
    running.instance.check_failed()
    more = [*_lines(seed=7, count=300), "never-seen-word"]
    _send(client_settings, running.source, more, "b")
    running.reference.update(" ".join(more).split())
    running.instance.await_caught_up(CATCH_UP_S)
    for word in [*_probe_words(running.reference)[:3], "never-seen-word"]:
        answer = query_state(running.topology, word, rocketmq=client_settings)
        assert answer.value == {"count": running.reference[word]}, answer.describe()


def test_cli_state_get(
    running: Running,
    client_settings: RocketMQSettings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR", client_settings.namesrv_addr)
    job = running.topology.job_id
    word = running.reference.most_common(1)[0][0]
    assert cli.main(["state", "get", job, word]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"count": running.reference[word]}
    assert f"{job}__state__" in err
    assert cli.main(["state", "get", job, "nowhere-word"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "no state for key 'nowhere-word' in queue" in err


def test_dagster_state_query_job(running: Running, client_settings: RocketMQSettings) -> None:
    word = running.reference.most_common()[-1][0]
    config = {"topology": running.topology.job_id, "key": word}
    result = state_query_job.execute_in_process(
        run_config={"ops": {"query_state": {"config": config}}},
        resources={"rocketmq": RocketMQResource(namesrv_addr=client_settings.namesrv_addr)},
    )
    answer = result.output_for_node("query_state")
    assert answer.value == {"count": running.reference[word]}
    outputs = [e for e in result.all_node_events if e.is_successful_output]
    metadata = {k: v.value for k, v in outputs[0].step_output_data.metadata.items()}
    assert metadata["value"] == {"count": running.reference[word]}
    assert metadata["found"] is True
