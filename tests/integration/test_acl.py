"""ACL 2.0 against a real RocketMQ 5.3.3 broker with authentication and authorization on.

The module runs a broker of its own (ports 21876/22911, data under
.local/test-rocketmq-acl) with the broker.conf keys docs/acl.md gives, and an
admin (super) user created by ``initAuthenticationUser``. A non-admin user is
created per test, through :mod:`stream_assets.rocketmq.acl`, with exactly the
grants :func:`~stream_assets.rocketmq.acl.topology_grants` lists (the table of
docs/acl.md), and then does what the engine does through the project's own
client classes. The reference answer of the WordCount run is computed here,
independently, with ``collections.Counter``.

The credentials below are throwaway values for this test broker only.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from stream_assets.broker.local import LocalBroker
from stream_assets.examples import wordcount
from stream_assets.plan.names import sink_transaction_group
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq import acl
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.batch_producer import BatchProducer
from stream_assets.rocketmq.errors import CredentialsRefusedError
from stream_assets.rocketmq.producer import Producer
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.records import OutgoingMessage
from stream_assets.rocketmq.transaction_checks import CheckResponder
from stream_assets.rocketmq.transactions import Outcome, TransactionalSender
from stream_assets.settings import BrokerSettings, RocketMQSettings, local_dir
from tests.integration._engine_util import Message, produce, wait_until
from tests.integration.conftest import EngineHarness

NAMESRV_PORT = 21876
BROKER_PORT = 22911
ADMIN_USER = "stream-assets-test-admin"
#: Test-only: the super user initAuthenticationUser creates on the broker's first start.
ADMIN_PASSWORD = "acl-test-admin-Secret-1"
#: The broker.conf keys of docs/acl.md.
ACL_CONF = acl.broker_conf(ADMIN_USER, SecretStr(ADMIN_PASSWORD))
#: A check must answer this fast: the refused start of the issue took 139 s.
FAIL_FAST_S = 5.0
CATCH_UP_S = 240.0


class AclBroker(LocalBroker):
    """The local broker with ACL 2.0's keys appended to its broker.conf (a later key wins).

    Appended here rather than passed as ``LocalBroker(extra_conf=...)``, so this
    module does not depend on how the local broker's own config is laid out.
    """

    def _broker_conf(self) -> Path:
        path = super()._broker_conf()
        with path.open("a") as out:
            out.write("".join(f"{key}={value}\n" for key, value in ACL_CONF.items()))
        return path


@pytest.fixture(scope="module")
def acl_broker() -> Iterator[LocalBroker]:
    """This module's ACL 2.0 broker, started (or reused) and stopped if it started it."""
    settings = BrokerSettings(
        namesrv_port=NAMESRV_PORT,
        broker_port=BROKER_PORT,
        home=local_dir() / "test-rocketmq-acl",
        auto_create_topics=False,
    )
    broker = AclBroker(settings)
    was_running = broker.status().serving
    broker.start()
    yield broker
    if not was_running:
        broker.stop()


def _settings(broker: LocalBroker, user: str, secret: str) -> RocketMQSettings:
    return RocketMQSettings(
        namesrv_addr=broker.settings.namesrv_addr,
        access_key=SecretStr(user),
        secret_key=SecretStr(secret),
    )


@pytest.fixture
def root(acl_broker: LocalBroker) -> Iterator[RocketMQAdmin]:
    """A control-plane client signing as the admin (super) user."""
    with RocketMQAdmin(_settings(acl_broker, ADMIN_USER, ADMIN_PASSWORD)) as admin:
        yield admin


class App:
    """A non-admin user created for one test: its name, secret and client settings."""

    def __init__(self, broker: LocalBroker, root: RocketMQAdmin, grants: list[acl.Grant]) -> None:
        self.user = f"app-{uuid.uuid4().hex[:8]}"
        self.secret = f"s3cret-{uuid.uuid4().hex}"
        acl.create_user(root, self.user, SecretStr(self.secret))
        acl.grant(root, self.user, grants)
        self.settings = _settings(broker, self.user, self.secret)
        self.admin = RocketMQAdmin(self.settings)


def _job(prefix: str, exactly_once: bool = False) -> tuple[str, Topology]:
    job = f"{prefix}-{uuid.uuid4().hex[:8]}"
    return job, wordcount.build(job, f"{job}-src", f"{job}-out", exactly_once)


def _assert_no_secret(secret: str, exc: BaseException) -> None:
    """Neither the exception nor anything it chains to shows ``secret``."""
    seen: BaseException | None = exc
    while seen is not None:
        assert secret not in str(seen) and secret not in repr(seen), f"secret in {seen!r}"
        seen = seen.__cause__ or seen.__context__


# -- 1. the admin provisions, the non-admin runs with the documented grants --------------


def test_non_admin_with_the_documented_grants_does_what_the_engine_does(
    acl_broker: LocalBroker, root: RocketMQAdmin
) -> None:
    job, topology = _job("acl-grants", exactly_once=True)
    source = topology.source_topic
    root.create_topic(source, 2)  # the admin creates the user's source topic
    produce(root.settings, source, [Message(f"line {i}".encode()) for i in range(10)])
    app = App(acl_broker, root, acl.topology_grants(topology))
    try:
        acl.check_credentials(app.admin, [source], job)
        # The engine creates its own topics (Create on Topic:<job>__* and the sink).
        shuffle = topology.shuffle_topics[0]
        app.admin.create_topic(shuffle, 2)
        app.admin.create_topic(topology.sink_topics[0], 2)
        # Send as the engine does: the C++ client and the batching remoting producer.
        with Producer(app.settings) as producer:
            receipt = producer.send(shuffle, b"a\x00b", key="k", queue_id=1)
        with BatchProducer(app.settings, app.admin) as batch:
            batch.send_all([OutgoingMessage(topology.sink_topics[0], b"out", key="w")])
        acl.check_credentials(
            app.admin, [source, shuffle], job, publish=[shuffle, *topology.sink_topics]
        )
        # Pull, offsets, commits: the source, the shuffle topic, the group and its -planned.
        reader = QueueReader(app.admin, job)
        try:
            pulled = [r.body for q in app.admin.queues(source) for r in reader.read(q, 0)]
            assert sorted(pulled) == sorted(f"line {i}".encode() for i in range(10))
            shuffle_queue = app.admin.queues(shuffle)[receipt.queue_id]
            assert [r.body for r in reader.read(shuffle_queue, 0)] == [b"a\x00b"]
        finally:
            reader.close()
        queues = app.admin.queues(source)
        app.admin.commit_consumer_offsets(job, {q: 5 for q in queues})
        app.admin.commit_consumer_offsets(f"{job}-planned", {queues[0]: 3})
        assert set(app.admin.group_offsets(job, source).values()) == {5}
        assert app.admin.group_offsets(f"{job}-planned", source)[queues[0]] == 3
        assert receipt.queue_offset == 0
        _exactly_once_sink_messages(app, job, topology.sink_topics[0])
        # And nothing beyond the grants: another topic, or publishing to the source.
        # Any refused admin call names the user and what to fix, like the check.
        with pytest.raises(CredentialsRefusedError, match=r"create topic.*no permission"):
            app.admin.create_topic(f"not-{job}", 1)
        with pytest.raises(CredentialsRefusedError, match=r"send \(SEND_MESSAGE_V2\)"):
            acl.check_credentials(app.admin, [], job, publish=[source])
        # The probe stored nothing in the topics it probed.
        assert sum(o.max_offset for o in root.topic_offsets(shuffle).values()) == 1
    finally:
        app.admin.close()


def _exactly_once_sink_messages(app: App, job: str, sink: str) -> None:
    """What an exactly-once sink does, as the user: prepare half messages, commit one,
    answer the broker's check-back, which commits the other, and read back which are
    visible (as a step and a check answer do)."""
    group = sink_transaction_group(job)
    reader = QueueReader(app.admin, f"{job}-sink-checks")

    def seen() -> list[bytes]:
        queues = app.admin.queues(sink)
        return sorted(r.body for q in queues for r in reader.read(q, app.admin.min_offset(q)))

    try:
        with (
            CheckResponder(app.settings, group, lambda check: Outcome.COMMIT) as responder,
            BatchProducer(app.settings, app.admin) as producer,
        ):
            sender = TransactionalSender(producer, group)
            prepared = sender.prepare(
                [
                    OutgoingMessage(sink, b"ended", key="e"),
                    OutgoingMessage(sink, b"checked", key="c"),
                ]
            )
            sender.commit(prepared[:1])
            wait_until(lambda: seen() == [b"checked", b"ended", b"out"], 60, "the checked one")
            assert responder.answered[Outcome.COMMIT] >= 1
    finally:
        reader.close()


# -- 2. a wrong secret fails fast, naming the user and the settings ----------------------


def test_wrong_secret_is_refused_within_seconds_and_named_without_the_secret(
    acl_broker: LocalBroker, root: RocketMQAdmin
) -> None:
    job, topology = _job("acl-rotated")
    root.create_topic(topology.source_topic, 2)
    app = App(acl_broker, root, acl.topology_grants(topology))
    app.admin.close()
    rotated = f"rotated-{uuid.uuid4().hex}"
    with RocketMQAdmin(_settings(acl_broker, app.user, rotated)) as wrong:
        started = time.monotonic()
        with pytest.raises(CredentialsRefusedError) as caught:
            acl.check_credentials(wrong, topology.source_topics, job)
        took = time.monotonic() - started
        assert took < FAIL_FAST_S, f"the refusal took {took:.1f}s"
        text = str(caught.value)
        assert repr(app.user) in text
        assert "STREAM_ASSETS_ROCKETMQ_ACCESS_KEY" in text
        assert "STREAM_ASSETS_ROCKETMQ_SECRET_KEY" in text
        assert "check signature failed" in text
        assert not caught.value.missing_grant
        _assert_no_secret(rotated, caught.value)
        # The control plane's own error of a refused call holds no secret either.
        with pytest.raises(CredentialsRefusedError, match="check signature failed") as refused:
            wrong.topic_offsets(topology.source_topic)
        _assert_no_secret(rotated, refused.value)
    # A user the broker does not know, and a client without credentials.
    with RocketMQAdmin(_settings(acl_broker, "nobody-" + app.user, rotated)) as unknown:
        with pytest.raises(CredentialsRefusedError, match="is not found") as caught:
            acl.check_credentials(unknown, topology.source_topics, job)
        _assert_no_secret(rotated, caught.value)
    anonymous = RocketMQSettings(namesrv_addr=acl_broker.settings.namesrv_addr)
    with (
        RocketMQAdmin(anonymous) as anon,
        pytest.raises(CredentialsRefusedError, match="ACCESS_KEY is not set"),
    ):
        acl.check_credentials(anon, topology.source_topics, job)


# -- 3. a missing grant is refused, naming the operation ---------------------------------


def test_a_user_lacking_a_grant_is_refused_with_the_operation_named(
    acl_broker: LocalBroker, root: RocketMQAdmin
) -> None:
    job, topology = _job("acl-lacking")
    source = topology.source_topic
    root.create_topic(source, 2)
    root.create_topic(topology.sink_topics[0], 2)
    grants = acl.topology_grants(topology)
    without_group = [g for g in grants if g.resource != f"Group:{job}"]
    without_pub = [g for g in grants if g.resource != f"Topic:{topology.sink_topics[0]}"]
    for lacking, resource, operation in (
        (without_group, f"Group:{job}", "QUERY_CONSUMER_OFFSET"),
        (without_pub, f"Topic:{topology.sink_topics[0]}", "SEND_MESSAGE_V2"),
    ):
        app = App(acl_broker, root, lacking)
        try:
            started = time.monotonic()
            with pytest.raises(CredentialsRefusedError) as caught:
                acl.check_credentials(app.admin, [source], job, publish=topology.sink_topics)
            assert time.monotonic() - started < FAIL_FAST_S
            refused = caught.value
            assert refused.missing_grant and refused.resource == resource
            assert operation in refused.operation and operation in str(refused)
            assert repr(app.user) in str(refused)
            _assert_no_secret(app.secret, refused)
        finally:
            app.admin.close()


# -- 4. WordCount end to end as the non-admin ---------------------------------------------


def test_an_instance_with_a_rotated_secret_fails_before_spark_and_leaves_no_secret(
    acl_broker: LocalBroker, root: RocketMQAdmin, tmp_path: Path
) -> None:
    _, topology = _job("acl-start")
    root.create_topic(topology.source_topic, 2)
    app = App(acl_broker, root, acl.topology_grants(topology))
    app.admin.close()
    rotated = f"rotated-{uuid.uuid4().hex}"
    harness = EngineHarness(_settings(acl_broker, app.user, rotated))
    inst = harness.instance(topology, tmp_path / "state")
    started = time.monotonic()
    try:
        with pytest.raises(CredentialsRefusedError) as caught:
            harness.start(inst)
    finally:
        harness.stop_all()
        inst.close()
    took = time.monotonic() - started
    assert took < FAIL_FAST_S, f"the refusal took {took:.1f}s"
    assert inst._spark is None, "Spark was started for an instance whose user is refused"
    text = str(caught.value)
    assert repr(app.user) in text and "STREAM_ASSETS_ROCKETMQ_SECRET_KEY" in text
    _assert_no_secret(rotated, caught.value)
    # Nothing was provisioned with the refused user, and no file holds the secret.
    assert not root.topic_exists(topology.shuffle_topics[0])
    for folder in (local_dir() / "checkpoints", tmp_path):
        for path in folder.rglob("*") if folder.exists() else []:
            if path.is_file():
                assert rotated.encode() not in path.read_bytes(), f"secret in {path}"
