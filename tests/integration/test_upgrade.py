"""Upgrading a topology on the real broker and Spark: state carried over, or refused and
then dropped on purpose, and a job of the previous release's naming kept
(docs/operating.md, "Upgrading a topology").

References come from the input alone (``collections.Counter``, plain-Python window
joins); the sink is read as docs/guarantees.md tells a consumer to (the highest
version of each result key).
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

import pytest

from stream_assets.control.upgrade import apply_upgrade
from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples.wordcount import split_words
from stream_assets.plan.names import positional_ids
from stream_assets.plan.topology import Topology
from stream_assets.plan.upgrade import TOPOLOGY_NAMESPACE, UpgradeRefusedError
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.settings import RocketMQSettings
from stream_assets.windows import Time, TumblingWindow
from tests.consumer_rule import version_of
from tests.integration._engine_util import (
    BackgroundProducer,
    Message,
    current_results,
    final_counts,
    latest_by_message_key,
    produce,
    read_topic,
    state_writers,
    unique,
)
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

CATCH_UP_S = 240.0


def _wordcount(job: str, source: str, sink: str, *, v2: bool = False) -> Topology:
    """WordCount; v2 adds a filter and a map before key_by and a second sink after the count
    (neither changes a count: words are non-empty and lower-case already)."""
    b = StreamBuilder(job)
    words = b.source(source, text_deserializer).flat_map(split_words)
    if v2:
        words = words.filter(bool).map(str.lower)
    counts = words.key_by(str).count().to_rstream()
    counts.sink(sink)
    if v2:
        counts.sink(f"{sink}-2")
    return b.build()


def _lines(seed: int, count: int) -> list[str]:
    rnd = random.Random(seed)
    vocab = [f"w{i:03d}" for i in range(120)]
    return [" ".join(rnd.choices(vocab, k=6)) for _ in range(count)]


def _messages(lines: list[str], prefix: str) -> list[Message]:
    return [Message(line.encode(), key=f"{prefix}{i}") for i, line in enumerate(lines)]


def _newest_versions(records: list[Any]) -> dict[str, int]:
    """Per result key (``job/op/<key>``), the highest version its messages carry."""
    out: dict[str, int] = {}
    for record in records:
        result_key, version = version_of(record.keys[-1])
        out[result_key] = max(out.get(result_key, 0), version)
    return out


def _versions_never_go_back(records: list[Any]) -> None:
    """Per result key, in the order its sink queue holds them, versions only grow."""
    seen: dict[str, int] = {}
    for record in records:
        result_key, version = version_of(record.keys[-1])
        assert version >= seen.get(result_key, 0), (result_key, version, seen[result_key])
        seen[result_key] = version


def _job_topics(admin: RocketMQAdmin, job: str) -> set[str]:
    return {t for t in admin.topic_names() if t.startswith(f"{job}__")}


def test_wordcount_upgraded_with_stateless_changes_keeps_counting(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
    report: Any,
) -> None:
    """v1 over pre-produced input; v1 stopped and v2 started while input keeps coming."""
    job = unique("it-upg-wc")
    source, sink = f"{job}-in", f"{job}-out"
    admin.create_topic(source, 2)
    lines = _lines(7, 1_600)
    first, rest = lines[:600], lines[600:]
    produce(client_settings, source, _messages(first, "a"))
    v1 = engine.start(engine.instance(_wordcount(job, source, sink), tmp_path / "state"))
    v1.await_caught_up(CATCH_UP_S)
    topics_v1 = _job_topics(admin, job)
    producer = BackgroundProducer(client_settings, source, _messages(rest, "b"), threads=2)
    producer.start()
    engine.stop(v1)  # input goes on arriving while no version runs
    v2 = engine.instance(_wordcount(job, source, sink, v2=True), tmp_path / "state")
    engine.start(v2)
    producer.join()
    v2.await_caught_up(CATCH_UP_S)
    engine.stop(v2)

    reference = collections.Counter(w for line in lines for w in line.split())
    records = read_topic(admin, sink)
    assert final_counts(records) == dict(reference)
    _versions_never_go_back(records)
    # The second sink has v2's updates only: the counts as they stood then.
    second = final_counts(read_topic(admin, f"{sink}-2"))
    assert second and all(second[w] == reference[w] for w in second)
    # No new shuffle or state topic: v2 kept v1's; one writer after the other per queue.
    assert _job_topics(admin, job) == topics_v1
    (state_topic,) = v2.topology.state_topics
    for queue, writers in state_writers(admin, state_topic).items():
        blocks = [w for i, w in enumerate(writers) if i == 0 or writers[i - 1] != w]
        assert len(blocks) <= 2 and len(set(blocks)) == len(blocks), (queue, blocks)
    report(
        f"WordCount v1 -> v2 (filter, map, second sink): {sum(reference.values())} words, "
        f"{len(reference)} keys exact across the upgrade; {len(second)} keys in the new sink"
    )


def _join(job: str, shown: str, clicked: str, sink: str, *, v2: bool = False) -> Topology:
    """Impressions joined with clicks of the same ad in 1 s windows; v2 filters clicks
    through a filter that keeps every one."""
    b = StreamBuilder(job)
    impressions = b.source(shown, json_deserializer).select_timestamp("t")
    clicks = b.source(clicked, json_deserializer).select_timestamp("t")
    if v2:
        clicks = clicks.filter(bool)
    (
        impressions.join(clicks)
        .where("ad")
        .equal_to("ad")
        .window(TumblingWindow.of(Time.seconds(1)))
        .apply()
        .sink(sink)
    )
    return b.build()


def _events(seed: int, count: int, base: int) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    clock, out = base, []
    for n in range(count):
        clock += rnd.randrange(40)
        out.append({"ad": f"ad{rnd.randrange(6)}", "t": clock, "id": n})
    return out


def test_a_windowed_join_upgraded_on_one_side_keeps_its_open_windows(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    job = unique("it-upg-join")
    shown, clicked, sink = f"{job}-shown", f"{job}-clicked", f"{job}-out"
    for topic in (shown, clicked):
        admin.create_topic(topic, 1)  # one queue each: every side in time order
    base = 1_700_000_000_000
    imps, clicks = _events(3, 500, base), _events(4, 500, base)
    middle = base + 5_500  # inside a window: it is open when v1 stops
    flush = {"ad": "flush", "t": base + 10**9, "id": -1}

    def send(events: list[dict[str, Any]], topic: str) -> None:
        produce(client_settings, topic, [Message(json.dumps(e).encode()) for e in events])

    send([e for e in imps if e["t"] < middle], shown)
    send([e for e in clicks if e["t"] < middle], clicked)
    v1 = engine.start(engine.instance(_join(job, shown, clicked, sink), tmp_path / "state"))
    v1.await_caught_up(CATCH_UP_S)
    engine.stop(v1)
    send([e for e in imps if e["t"] >= middle] + [flush], shown)
    send([e for e in clicks if e["t"] >= middle] + [flush], clicked)
    v2 = engine.instance(_join(job, shown, clicked, sink, v2=True), tmp_path / "state")
    engine.start(v2)
    v2.await_caught_up(CATCH_UP_S)
    engine.stop(v2)

    windows: dict[tuple[str, int], tuple[list[int], list[int]]] = collections.defaultdict(
        lambda: ([], [])
    )
    for side, events in ((0, imps), (1, clicks)):
        for e in events:
            windows[(e["ad"], e["t"] // 1_000)][side].append(e["id"])
    reference = sorted((i, c) for left, right in windows.values() for i in left for c in right)
    joined = latest_by_message_key(read_topic(admin, sink)).values()
    pairs = sorted((left["id"], right["id"]) for left, right in joined)
    assert pairs == reference
    spanning = windows[("ad0", middle // 1_000)]
    assert spanning[0] and spanning[1], "the case must have a window open across the upgrade"


def _totals(job: str, source: str, sink: str, *, summed: bool) -> Topology:
    """Per word, its count (v1) or the sum of its ``n`` (v2), under the same name."""
    b = StreamBuilder(job)
    grouped = b.source(source, json_deserializer).key_by("word")
    agg = grouped.sum("n", "total", name="totals") if summed else grouped.count(name="totals")
    agg.to_rstream().sink(sink)
    return b.build()


def test_an_incompatible_change_is_refused_then_starts_empty_once_its_state_is_dropped(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    job = unique("it-upg-drop")
    source, sink = f"{job}-in", f"{job}-out"
    admin.create_topic(source, 2)
    rnd = random.Random(11)
    before = [{"word": f"k{rnd.randrange(20)}", "n": rnd.randrange(1, 9)} for _ in range(300)]
    after = [{"word": f"k{rnd.randrange(20)}", "n": rnd.randrange(1, 9)} for _ in range(300)]

    def send(events: list[dict[str, Any]]) -> None:
        produce(client_settings, source, [Message(json.dumps(e).encode()) for e in events])

    send(before)
    v1 = engine.start(engine.instance(_totals(job, source, sink, summed=False), tmp_path / "s"))
    v1.await_caught_up(CATCH_UP_S)
    engine.stop(v1)
    v1_versions = _newest_versions(read_topic(admin, sink))
    v2_topology = _totals(job, source, sink, summed=True)
    refused = engine.instance(v2_topology, tmp_path / "s")
    with pytest.raises(UpgradeRefusedError, match=r"'totals' changed what its state holds"):
        refused.start()
    said: list[str] = []
    outcome = apply_upgrade(v2_topology, admin, drop=["totals"], say=said.append)
    assert outcome.plan.dropped == ("totals",) and outcome.emptied >= 1
    send(after)
    v2 = engine.start(engine.instance(v2_topology, tmp_path / "s"))
    v2.await_caught_up(CATCH_UP_S)
    engine.stop(v2)

    reference: collections.Counter[str] = collections.Counter()
    for e in after:
        reference[e["word"]] += e["n"]
    records = read_topic(admin, sink)
    current = current_results(records)
    assert {v["key"]: v["total"] for v in current.values() if "total" in v} == dict(reference)
    # The new aggregate's versions are above every version the old one wrote.
    newest = _newest_versions(records)
    updated = {k for k, body in current.items() if "total" in body}
    assert updated & set(v1_versions), "the case must update keys the old aggregate had"
    assert all(newest[k] > v1_versions[k] for k in updated & set(v1_versions))
    _versions_never_go_back(records)


def test_a_job_of_the_previous_release_keeps_its_topics_and_its_counts(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    """The previous release named topics and sinks by position and recorded nothing: run
    WordCount so (its positional names, then the record removed), then under this
    release's names. Nothing is lost and no topic of the new scheme appears."""
    job = unique("it-upg-old")
    source, sink = f"{job}-in", f"{job}-out"
    admin.create_topic(source, 2)
    lines = _lines(21, 900)
    built = _wordcount(job, source, sink)
    old_ids = positional_ids(built.nodes)
    previous = built.renamed(
        old_ids,
        {old_ids["aggregate"]: (f"{job}__shuffle__key_by-2", f"{job}__state__aggregate-3")},
    )
    produce(client_settings, source, _messages(lines[:400], "a"))
    v1 = engine.start(engine.instance(previous, tmp_path / "state"))
    v1.await_caught_up(CATCH_UP_S)
    engine.stop(v1)
    admin.delete_kv(TOPOLOGY_NAMESPACE, job)  # the previous release recorded nothing
    produce(client_settings, source, _messages(lines[400:], "b"))
    now = engine.start(engine.instance(built, tmp_path / "state"))
    now.await_caught_up(CATCH_UP_S)
    engine.stop(now)

    assert now.topology.state_topics == (f"{job}__state__aggregate-3",)
    records = read_topic(admin, sink)
    reference = collections.Counter(w for line in lines for w in line.split())
    assert final_counts(records) == dict(reference)
    assert all(r.keys[-1].startswith(f"{job}/sink-4/") for r in records)
    assert _job_topics(admin, job) == {
        f"{job}__shuffle__key_by-2",
        f"{job}__state__aggregate-3",
        f"{job}__dead-letters",
    }
    assert admin.get_kv(TOPOLOGY_NAMESPACE, job) is not None  # recorded now
