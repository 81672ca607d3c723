"""State queries (stream_assets.control.state_query, `stream-assets state get`, the Dagster job).

No broker: the state topics are the test driver's in-memory ones, read through
a small admin/reader stand-in, so the query's routing, restore and read run
for real against state the engine's own core committed. Expected values come
from the input (``collections.Counter``, hand sums), never from the engine.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import dagster as dg
import pytest

import stream_assets.jobs.state_query as state_query_job_module
from stream_assets import cli
from stream_assets.control import state_query as sq
from stream_assets.control.registry import REGISTRY, TopologyRegistration
from stream_assets.control.state_query import (
    StateAnswer,
    StateQueryError,
    key_queue,
    parse_key,
    parse_window,
    query_state,
    resolve_operator,
)
from stream_assets.dsl.builder import StreamBuilder
from stream_assets.examples import windowed_sum, wordcount
from stream_assets.jobs.state_query import state_query_job
from stream_assets.plan.topology import Topology
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.errors import TopicNotFoundError
from stream_assets.rocketmq.hashing import queue_for_key
from stream_assets.rocketmq.reader import PullBatch, PullStatus, QueueReader
from stream_assets.rocketmq.records import Record
from stream_assets.runtime.core.shuffle_codec import encode_key
from stream_assets.serde import json_deserializer, text_deserializer
from stream_assets.settings import RocketMQSettings
from stream_assets.testing import InMemoryBroker, TopologyTestDriver
from stream_assets.windows import Window

QUEUES = 4


class BrokerView:
    """What a query reads the broker through (admin offsets, reader pulls), over in-memory
    topics; counts pulls so a test can see that only the key's queue was read."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self.broker = broker
        self.settings = RocketMQSettings(namesrv_addr="in-memory:1")
        self.read_queues: set[tuple[str, int]] = set()

    def get_kv(self, namespace: str, key: str) -> None:
        return None  # no stored layouts or records: one broker, queue index == queue id

    def topic_names(self) -> set[str]:
        return set(self.broker.topics)

    def topic_exists(self, topic: str) -> bool:
        return topic in self.broker.topics

    def queues(self, topic: str) -> list[MessageQueue]:
        if topic not in self.broker.topics:
            raise TopicNotFoundError(topic, self.settings.namesrv_addr)
        count = self.broker.topic(topic).queue_count
        return [MessageQueue(topic, "b", q) for q in range(count)]

    def min_offset(self, queue: MessageQueue) -> int:
        return 0

    def max_offset(self, queue: MessageQueue) -> int:
        return self.broker.topic(queue.topic).end(queue.queue_id)

    def pull(self, queue: MessageQueue, offset: int, max_messages: int | None = None) -> PullBatch:
        self.read_queues.add((queue.topic, queue.queue_id))
        end = self.max_offset(queue)
        stop = end if max_messages is None else min(end, offset + max_messages)
        records = self.broker.topic(queue.topic).read(queue.queue_id, offset, stop)
        status = PullStatus.FOUND if records else PullStatus.NO_NEW_MESSAGES
        return PullBatch(queue, status, records, stop, 0, end)

    def read(self, queue: MessageQueue, start: int, end: int | None = None) -> Iterator[Record]:
        self.read_queues.add((queue.topic, queue.queue_id))
        stop = self.max_offset(queue) if end is None else end
        yield from self.broker.topic(queue.topic).read(queue.queue_id, start, stop)

    def close(self) -> None:
        pass


def _query(driver: TopologyTestDriver, key: Any, tmp_path: Path, **kwargs: Any) -> StateAnswer:
    view = BrokerView(driver.broker)
    return query_state(
        driver.topology,
        key,
        admin=cast(RocketMQAdmin, view),
        reader=cast(QueueReader, view),
        scratch_dir=tmp_path,
        **kwargs,
    )


def _lines(seed: int, count: int) -> list[str]:
    rnd = random.Random(seed)
    vocab = [f"w{i:02d}" for i in range(40)]
    return [" ".join(rnd.choices(vocab, k=rnd.randint(1, 7))) for _ in range(count)]


# -- routing and reads ---------------------------------------------------------


def test_key_queue_is_stage_zeros_route() -> None:
    # Stage 0 routes a key to queue_for_key(encode_key(key), shuffle queues); so does the query.
    for key in ["the", "", "é", 42, ("eu", 7), 1.5, None, True]:
        for n in (1, 4, 8, 13):
            assert key_queue(key, n) == queue_for_key(encode_key(key), n)
    # A JSON key parses to what key_by would have produced: same bytes, same queue.
    assert key_queue(parse_key('["eu", 7]', as_json=True), 8) == key_queue(("eu", 7), 8)
    assert key_queue(parse_key("7", as_json=True), 8) == key_queue(7, 8)


def test_wordcount_query_equals_counter_and_reads_only_the_keys_queue(tmp_path: Path) -> None:
    lines = _lines(seed=5, count=300)
    reference = Counter(w for line in lines for w in line.split())
    with TopologyTestDriver(
        wordcount.build(), shuffle_queues=QUEUES, snapshot_every=7, max_records_per_batch=40
    ) as driver:
        driver.pipe_many(lines)
        driver.advance()
        for word in sorted(reference)[:12]:
            view = BrokerView(driver.broker)
            answer = query_state(
                driver.topology,
                word,
                admin=cast(RocketMQAdmin, view),
                reader=cast(QueueReader, view),
                scratch_dir=tmp_path,
            )
            assert answer.value == {"count": reference[word]}, word
            assert answer.found and not answer.windowed
            # Stage 0 put the word's records in this queue: the driver's own store agrees.
            assert answer.value == driver.state(word)
            state_topic = driver.topology.state_topics[0]
            assert answer.state_topic == state_topic
            assert answer.queue_id == queue_for_key(encode_key(word), QUEUES)
            assert view.read_queues == {(state_topic, answer.queue_id)}
            assert answer.seq > 0 and answer.keys_in_queue > 0
        never = _query(driver, "never-seen", tmp_path)
        assert not never.found and never.value is None
        # Keys are typed: the word "w01" is not the int 1 nor the JSON string of it.
        assert not _query(driver, parse_key("1", as_json=True), tmp_path).found
    assert list(tmp_path.iterdir()) == []  # every private store was deleted


def test_typed_keys_round_trip(tmp_path: Path) -> None:
    builder = StreamBuilder("sq-typed")
    (
        builder.source("sq-events", json_deserializer)
        .key_by(lambda v: (v["region"], v["n"]))
        .count()
        .to_rstream()
        .sink("sq-out")
    )
    events = [{"region": r, "n": n} for r in ("eu", "us") for n in range(5) for _ in range(n + 1)]
    with TopologyTestDriver(builder.build(), shuffle_queues=QUEUES) as driver:
        driver.pipe_many(events)
        driver.advance()
        answer = _query(driver, parse_key('["eu", 3]', as_json=True), tmp_path)
        assert answer.value == {"count": 4}
        assert answer.json_value() == {"count": 4}
        assert not _query(driver, "eu", tmp_path).found


def test_windowed_open_windows_one_window_and_fired(tmp_path: Path) -> None:
    topology = windowed_sum.build("sq-wsum", "sq-ws-events", "sq-ws-out")
    events = [
        ("a", 1.0, 1_000),
        ("a", 2.0, 4_000),
        ("a", 5.0, 12_000),
        ("b", 7.0, 2_000),
    ]
    with TopologyTestDriver(topology, source_queues=1, shuffle_queues=QUEUES) as driver:
        for key, value, ts in events:
            driver.pipe({"key": key, "value": value, "ts": ts}, event_time=ts)
        driver.advance()
        every = _query(driver, "a", tmp_path)
        assert every.windowed and every.found
        assert every.value == {
            Window(0, 10_000): {"sum": 3.0},
            Window(10_000, 20_000): {"sum": 5.0},
        }
        assert every.json_value() == {"0,10000": {"sum": 3.0}, "10000,20000": {"sum": 5.0}}
        one = _query(driver, "a", tmp_path, window=parse_window("10000,20000"))
        assert one.value == {"sum": 5.0}
        assert not _query(driver, "a", tmp_path, window=Window(20_000, 30_000)).found
        driver.advance_idle()  # every window fires and leaves the state
        fired = _query(driver, "a", tmp_path)
        assert fired.value == {} and not fired.found
        assert "no open window" in fired.describe()


# -- errors --------------------------------------------------------------------


def test_unknown_topology_lists_the_registered_ones() -> None:
    with pytest.raises(StateQueryError, match=r"no topology 'nope' is registered.*wordcount"):
        query_state("nope", "x")


def test_topology_without_state() -> None:
    builder = StreamBuilder("sq-stateless")
    builder.source("sq-in", text_deserializer).map(str.upper).sink("sq-out")
    with pytest.raises(StateQueryError, match="keeps no state"):
        query_state(builder.build(), "x")


def test_missing_state_topic_asks_whether_the_topology_ever_ran(tmp_path: Path) -> None:
    view = BrokerView(InMemoryBroker())
    with pytest.raises(StateQueryError, match=r"does not exist .*has the topology ever run"):
        query_state(
            wordcount.build(),
            "x",
            admin=cast(RocketMQAdmin, view),
            reader=cast(QueueReader, view),
            scratch_dir=tmp_path,
        )


def test_window_on_an_unwindowed_aggregate() -> None:
    with pytest.raises(StateQueryError, match="not windowed"):
        query_state(wordcount.build(), "x", window=Window(0, 10))


def test_operator_choice() -> None:
    def stage(op_id: str) -> Any:
        return SimpleNamespace(
            queryable=SimpleNamespace(op_id=op_id),
            state_topic=f"j__state__{op_id}",
            input_topic=f"j__shuffle__{op_id}",
        )

    stateless = SimpleNamespace(queryable=None, state_topic=None, input_topic="src")
    two = cast(
        Topology, SimpleNamespace(job_id="j", stages=(stateless, stage("a-1"), stage("b-2")))
    )
    with pytest.raises(StateQueryError, match=r"several stateful operators.*\['a-1', 'b-2'\]"):
        resolve_operator(two)
    assert resolve_operator(two, "b-2").state_topic == "j__state__b-2"
    with pytest.raises(StateQueryError, match=r"no stateful operator 'c'; choose one of"):
        resolve_operator(two, "c")


def test_key_and_window_parsing() -> None:
    assert parse_key("42") == "42" and parse_key("42", as_json=True) == 42
    assert parse_key('{"a": [1, [2]]}', as_json=True) == {"a": (1, (2,))}
    with pytest.raises(StateQueryError, match=r"not valid JSON.*drop --json"):
        parse_key("apple", as_json=True)
    assert parse_window(" 0 , 10 ") == Window(0, 10)
    for bad in ("10", "a,b", "10,5", "1,2,3"):
        with pytest.raises(StateQueryError, match="START,END"):
            parse_window(bad)


def test_unencodable_key() -> None:
    with pytest.raises(StateQueryError, match="cannot be a grouping key"):
        key_queue(object(), 4)


# -- the command line ----------------------------------------------------------


@pytest.fixture
def registered_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TopologyTestDriver]:
    """WordCount under a registered name, its state in a driver; queries read the driver."""
    topology = wordcount.build("sq-cli-wc", "sq-cli-src", "sq-cli-out")
    monkeypatch.setitem(REGISTRY, "sq-cli-wc", TopologyRegistration("sq-cli-wc", lambda: topology))
    with TopologyTestDriver(topology, shuffle_queues=QUEUES) as driver:
        view = BrokerView(driver.broker)
        reading_driver = partial(
            sq.query_state,
            admin=cast(RocketMQAdmin, view),
            reader=cast(QueueReader, view),
            scratch_dir=tmp_path,
        )
        monkeypatch.setattr(sq, "query_state", reading_driver)  # the CLI imports it when run
        monkeypatch.setattr(state_query_job_module, "query_state", reading_driver)
        yield driver


def test_cli_parses_state_get() -> None:
    args = cli.build_parser().parse_args(
        ["state", "get", "wc", "7", "--json", "--window", "0,10", "--operator", "aggregate"]
    )
    assert (args.action, args.topology, args.key, args.json, args.window, args.operator) == (
        "get",
        "wc",
        "7",
        True,
        "0,10",
        "aggregate",
    )
    plain = cli.build_parser().parse_args(["state", "get", "wc", "the"])
    assert (plain.json, plain.window, plain.operator) == (False, None, None)


def test_cli_prints_the_value_as_json(
    registered_driver: TopologyTestDriver, capsys: pytest.CaptureFixture[str]
) -> None:
    registered_driver.pipe_many(["the cat", "the dog"])
    registered_driver.advance()
    assert cli.main(["state", "get", "sq-cli-wc", "the"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"count": 2}
    assert "sq-cli-wc__state__" in err  # where it was read goes to stderr


def test_cli_key_without_state_exits_1(
    registered_driver: TopologyTestDriver, capsys: pytest.CaptureFixture[str]
) -> None:
    registered_driver.pipe_many(["the cat"])
    registered_driver.advance()
    assert cli.main(["state", "get", "sq-cli-wc", "dog"]) == 1
    out, err = capsys.readouterr()
    queue = queue_for_key(encode_key("dog"), QUEUES)
    assert out == ""
    assert f"no state for key 'dog' in queue {queue} of sq-cli-wc__state__" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["state", "get", "nope", "x"], "no topology 'nope' is registered"),
        (["state", "get", "sq-cli-wc", "x", "--window", "5"], "START,END"),
        (["state", "get", "sq-cli-wc", "x", "--window", "0,10"], "not windowed"),
        (["state", "get", "sq-cli-wc", "{", "--json"], "not valid JSON"),
        (["state", "get", "sq-cli-wc", "x", "--operator", "zz"], "no stateful operator 'zz'"),
    ],
)
def test_cli_errors_say_what_was_wrong(
    registered_driver: TopologyTestDriver,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("stream-assets: error: ") and message in err
    assert "Traceback" not in err


# -- the Dagster job -----------------------------------------------------------


def test_dagster_job_answers_and_records_metadata(registered_driver: TopologyTestDriver) -> None:
    registered_driver.pipe_many(["a b a", "a"])
    registered_driver.advance()
    result = state_query_job.execute_in_process(
        run_config={"ops": {"query_state": {"config": {"topology": "sq-cli-wc", "key": "a"}}}},
        resources={"rocketmq": RocketMQResource(namesrv_addr="127.0.0.1:1")},
    )
    answer = result.output_for_node("query_state")
    assert isinstance(answer, StateAnswer) and answer.value == {"count": 3}
    events = [e for e in result.all_node_events if e.is_successful_output]
    metadata = {k: v.value for k, v in events[0].step_output_data.metadata.items()}
    assert metadata["value"] == {"count": 3}
    assert metadata["found"] is True
    assert metadata["queue"] == queue_for_key(encode_key("a"), QUEUES)


def test_dagster_job_fails_clearly_on_an_unknown_topology() -> None:
    result = state_query_job.execute_in_process(
        run_config={"ops": {"query_state": {"config": {"topology": "nope", "key": "a"}}}},
        resources={"rocketmq": RocketMQResource(namesrv_addr="127.0.0.1:1")},
        raise_on_error=False,
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    assert "no topology 'nope' is registered" in str(failure.event_specific_data)


def test_definitions_register_the_job() -> None:
    from stream_assets.definitions import defs

    assert defs.get_job_def("state_query_job").name == "state_query_job"
