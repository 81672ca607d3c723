"""Bad input and unavailable infrastructure give clear, bounded errors."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import shutil
import socket
import string
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stream_assets.broker.local import BrokerStartError, LocalBroker
from stream_assets.examples import wordcount
from stream_assets.plan import nodes as n
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    MessageTooLargeError,
    TopicNotFoundError,
)
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.settings import DEFAULT_MAX_MESSAGE_SIZE, BrokerSettings, RocketMQSettings
from tests.conftest import integration_broker_settings
from tests.integration._engine_util import Message, final_counts, produce, read_topic, unique
from tests.integration._util import free_port, wait_for
from tests.integration.conftest import EngineHarness

pytestmark = pytest.mark.integration

BOUND_S = 10.0


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An address that accepts TCP connections (kernel backlog) but never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


# -- unreachable name server ---------------------------------------------------


def test_admin_route_with_nothing_listening_raises_unreachable() -> None:
    addr = f"127.0.0.1:{free_port()}"
    settings = RocketMQSettings(namesrv_addr=addr, request_timeout_s=2)
    started = time.monotonic()
    with RocketMQAdmin(settings) as admin, pytest.raises(BrokerUnreachableError) as info:
        admin.route("some-topic")
    assert time.monotonic() - started < BOUND_S
    assert addr in str(info.value)
    assert info.value.addr == addr


def test_producer_start_with_nothing_listening_raises_unreachable() -> None:
    addr = f"127.0.0.1:{free_port()}"
    settings = RocketMQSettings(namesrv_addr=addr, request_timeout_s=2)
    producer = Producer(settings)
    started = time.monotonic()
    try:
        with pytest.raises(BrokerUnreachableError) as info:
            producer.start()
    finally:
        producer.close()
    assert time.monotonic() - started < BOUND_S
    assert addr in str(info.value)


def test_silent_name_server_times_out_within_the_request_bound(silent_server: str) -> None:
    settings = RocketMQSettings(namesrv_addr=silent_server, request_timeout_s=2)
    started = time.monotonic()
    with RocketMQAdmin(settings) as admin, pytest.raises(BrokerUnreachableError) as info:
        admin.route("some-topic")
    elapsed = time.monotonic() - started
    # It did wait for an answer (connect succeeded), and no longer than the bound.
    assert 1.5 <= elapsed < BOUND_S
    assert silent_server in str(info.value)

    producer = Producer(settings)
    started = time.monotonic()
    try:
        with pytest.raises(BrokerUnreachableError) as info:
            producer.start()
    finally:
        producer.close()
    assert time.monotonic() - started < BOUND_S
    assert silent_server in str(info.value)


# -- missing topic -----------------------------------------------------------------


def test_send_to_missing_topic_raises_topic_not_found(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = f"it-missing-{uuid.uuid4().hex}"
    with pytest.raises(TopicNotFoundError) as info:
        admin.route(topic)
    assert info.value.topic == topic
    assert topic in str(info.value)
    assert not admin.topic_exists(topic)

    with Producer(client_settings) as producer, pytest.raises(TopicNotFoundError) as info:
        producer.send(topic, b"payload", key="k")
    assert info.value.topic == topic
    assert topic in str(info.value)
    # The broker does not auto-create it as a side effect.
    assert not admin.topic_exists(topic)


# -- message size --------------------------------------------------------------------


def test_body_over_the_default_limit_is_rejected(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = f"it-big-{uuid.uuid4().hex}"
    admin.create_topic(topic, queues=1)
    assert client_settings.max_message_size == DEFAULT_MAX_MESSAGE_SIZE
    with Producer(client_settings) as producer:
        with pytest.raises(MessageTooLargeError) as info:
            producer.send(topic, b"\x00" * (DEFAULT_MAX_MESSAGE_SIZE + 1))
        assert str(DEFAULT_MAX_MESSAGE_SIZE) in str(info.value)
        assert (info.value.size, info.value.limit) == (
            DEFAULT_MAX_MESSAGE_SIZE + 1,
            DEFAULT_MAX_MESSAGE_SIZE,
        )
        # Nothing was stored, and the producer still works.
        assert producer.send(topic, b"small").queue_offset == 0
    (queue,) = admin.queues(topic)
    wait_for(lambda: admin.max_offset(queue) == 1, 10.0, "the small message to be indexed")
    assert admin.max_offset(queue) == 1


def test_custom_limit_accepts_exactly_the_limit_and_rejects_one_more(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    limit = 1024
    topic = f"it-limit-{uuid.uuid4().hex}"
    admin.create_topic(topic, queues=1)
    settings = client_settings.model_copy(update={"max_message_size": limit})
    at_limit = bytes(i % 256 for i in range(limit))
    with Producer(settings) as producer:
        receipt = producer.send(topic, at_limit, queue_id=0)
        with pytest.raises(MessageTooLargeError) as info:
            producer.send(topic, at_limit + b"\x00", queue_id=0)
    assert str(limit) in str(info.value)
    assert "1025" in str(info.value)
    queue = MessageQueue(topic, admin.queues(topic)[0].broker_name, 0)
    wait_for(lambda: admin.max_offset(queue) == 1, 10.0, "the message to be indexed")
    assert admin.max_offset(queue) == 1  # the over-limit body was not stored
    reader = QueueReader(admin, group="it-limit-reader")
    try:
        (record,) = list(reader.read(queue, 0))
    finally:
        reader.close()
    assert (record.queue_offset, record.body) == (receipt.queue_offset, at_limit)


# -- local broker start with busy ports ----------------------------------------------


def _pid_files_alive(home: Path) -> list[int]:
    alive = []
    for pid_file in (home / "run").glob("*.pid"):
        try:
            pid = int(pid_file.read_text().strip())
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def _seed_classpath(home: Path) -> None:
    """Reuse the test broker's resolved classpath so start() never runs Maven here.

    (The ``broker`` fixture in the tests below guarantees it was resolved.)
    """
    src_home = integration_broker_settings().resolved_home()
    for cp in src_home.glob("classpath-*.txt"):
        home.mkdir(parents=True, exist_ok=True)
        shutil.copy(cp, home / cp.name)


def _free_broker_port() -> int:
    """A broker port whose derived ports (port-2, port+1) are free too."""
    for _ in range(50):
        port = free_port()
        if port < 1000:
            continue
        try:
            for p in (port - 2, port + 1):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise AssertionError("no free broker port triple found")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port with a listener on it for the whole test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


def _start_expecting_port_error(settings: BrokerSettings, port: int) -> None:
    home = settings.resolved_home()
    _seed_classpath(home)
    local = LocalBroker(settings, progress=lambda _msg: None)
    try:
        with pytest.raises(BrokerStartError) as info:
            local.start()
        assert str(port) in str(info.value)
        assert "in use" in str(info.value)
        assert _pid_files_alive(home) == [], "a JVM was spawned although a port was taken"
    finally:
        local.stop()  # only ever stops JVMs of this temporary home


def test_start_with_namesrv_port_in_use_fails_naming_it(
    busy_port: int, tmp_path: Path, broker: LocalBroker
) -> None:
    settings = BrokerSettings(
        namesrv_port=busy_port, broker_port=_free_broker_port(), home=tmp_path / "rmq"
    )
    _start_expecting_port_error(settings, busy_port)


def test_start_with_broker_port_in_use_fails_naming_it(
    busy_port: int, tmp_path: Path, broker: LocalBroker
) -> None:
    settings = BrokerSettings(
        namesrv_port=free_port(), broker_port=busy_port, home=tmp_path / "rmq"
    )
    _start_expecting_port_error(settings, busy_port)


# -- invalid topic names -------------------------------------------------------------


@pytest.mark.parametrize(
    "topic",
    ["", "has space", "slash/topic", "dot.topic", "тема", "x" * 128, "semi;colon", "tab\there"],
)
def test_create_topic_rejects_invalid_names(admin: RocketMQAdmin, topic: str) -> None:
    with pytest.raises(ValueError) as info:
        admin.create_topic(topic, queues=1)
    assert repr(topic) in str(info.value)


def test_create_topic_accepts_the_longest_valid_name(admin: RocketMQAdmin) -> None:
    topic = ("it-long-" + uuid.uuid4().hex + "_|%" + "x" * 127)[:127]
    route = admin.create_topic(topic, queues=1)
    assert route.topic == topic
    assert admin.topic_exists(topic)


def test_empty_body_is_rejected_before_sending(
    admin: RocketMQAdmin, client_settings: RocketMQSettings
) -> None:
    topic = f"empty-{uuid.uuid4().hex[:10]}"
    admin.create_topic(topic, queues=1)
    (queue,) = admin.queues(topic)
    with Producer(client_settings) as producer, pytest.raises(ValueError, match="empty body"):
        producer.send(topic, b"")
    assert admin.max_offset(queue) == 0


# -- a word longer than a message key may be -------------------------------------------


def test_a_40000_character_word_in_wordcount_is_counted_and_the_instance_keeps_running(
    engine: EngineHarness,
    admin: RocketMQAdmin,
    client_settings: RocketMQSettings,
    tmp_path: Path,
) -> None:
    """Its sink key (``job/sink/<word>/v<n>/0``) would hold 40 000 characters, over the
    32767 bytes of properties a broker stores, and used to fail the stateful flush on
    every retry. Now its result key part is shortened by the documented rule, the word
    is counted, every other word is exact, and input after it is processed too."""
    job = unique("it-long-word")
    source, sink = f"{job}-src", f"{job}-out"
    admin.create_topic(source, 2)
    rnd = random.Random(18)
    long_word = "".join(rnd.choice(string.ascii_lowercase) for _ in range(40_000))
    vocabulary = ["the", "cat", "sat", "on", "a", "mat", "new", "york"]

    def lines(count: int) -> list[str]:
        return [
            " ".join(rnd.choice(vocabulary) for _ in range(rnd.randint(1, 8))) for _ in range(count)
        ]

    first, then = lines(300), lines(100)
    first[150] += f" {long_word}"
    then[50] = f"{long_word} cat"
    topology = wordcount.build(job, source, sink)
    produce(
        client_settings, source, [Message(x.encode(), queue_id=i % 2) for i, x in enumerate(first)]
    )
    inst = engine.start(engine.instance(topology, tmp_path / "state"))
    inst.await_caught_up(90)
    # Still running: what comes after the long word is processed as well.
    produce(
        client_settings, source, [Message(x.encode(), queue_id=i % 2) for i, x in enumerate(then)]
    )
    inst.await_caught_up(90)
    inst.check_failed()
    assert inst.running

    reference = collections.Counter(w for x in first + then for w in x.split())
    records = read_topic(admin, sink)
    assert final_counts(records) == dict(reference)
    assert reference[long_word] == 2
    (sink_op,) = [node.op_id for node in topology.nodes if isinstance(node, n.Sink)]
    digest = hashlib.sha256(long_word.encode()).hexdigest()[:32]
    shortened = f"{job}/{sink_op}/{long_word[:479]}~{digest}/v"
    long_keys = [r.keys[-1] for r in records if json.loads(r.body)["key"] == long_word]
    assert long_keys and all(k.startswith(shortened) for k in long_keys), long_keys[:1]
    assert read_topic(admin, topology.dead_letter_topic) == []
