"""Keyed, synchronous sends through the RocketMQ C++ client (PyPI ``rocketmq``).

Every send goes through the client's orderly send with a queue selector, so the
queue is always chosen here: by the stable key hash
(:func:`~stream_assets.rocketmq.hashing.key_hash`), by an explicit queue id, or
round-robin. Bodies are set with the client's length-aware setter, so any bytes
(zero bytes included) travel unchanged. Failed sends are retried with tenacity;
a retried send may be stored twice (at-least-once), which is why stream-assets
gives every output message a deterministic key.

Example::

    >>> with Producer(RocketMQSettings()) as producer:  # doctest: +SKIP
    ...     receipt = producer.send("orders", b'{"id": 1}', key="customer-7")
    >>> receipt.queue_id == queue_for_key("customer-7", 8)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import uuid
from collections.abc import Mapping
from typing import Any

from rocketmq import client as rmq
from rocketmq.exceptions import RocketMQException
from rocketmq.ffi import QUEUE_SELECTOR_CALLBACK, dll
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from stream_assets.rocketmq.admin import RocketMQAdmin, TopicRoute, validate_topic_name
from stream_assets.rocketmq.batch_producer import check_message
from stream_assets.rocketmq.errors import RocketMQError, SendError
from stream_assets.rocketmq.hashing import choose_queue
from stream_assets.rocketmq.message_codec import normalize_msg_id
from stream_assets.rocketmq.records import OutgoingMessage, SendReceipt
from stream_assets.settings import RocketMQSettings

_LOG_LEVEL_WARN = 3
#: librocketmq's client create/start/shutdown is not safe across threads: once, in
#: CI, a StartProducer segfaulted while another thread had just created its producer.
#: Sends stay concurrent; only the lifecycle is serialized.
_LIFECYCLE = threading.Lock()
# The ffi module leaves this one undeclared; without argtypes ctypes would
# truncate the 64-bit handle to a C int.
dll.SetProducerCompressMsgBodyOverHowmuch.argtypes = [ctypes.c_void_p, ctypes.c_int]
dll.SetProducerCompressMsgBodyOverHowmuch.restype = ctypes.c_int


class _TransientSendError(Exception):
    """A send the C++ client failed and that is worth another try."""


class Producer:
    """A started C++-client producer plus the route knowledge to pick queues.

    Not thread-safe per instance (one outstanding send at a time); create one
    per thread.
    """

    def __init__(
        self,
        settings: RocketMQSettings,
        admin: RocketMQAdmin | None = None,
        group: str | None = None,
    ) -> None:
        self.settings = settings
        self._admin = admin or RocketMQAdmin(self.settings)
        self._owns_admin = admin is None
        self._group = group or self.settings.producer_group
        self._routes: dict[str, TopicRoute] = {}
        self._round_robin = itertools.count()
        self._client: Any = None
        self._lock = threading.Lock()
        # The selector runs inside the client's send call; it records the queue
        # index it chose so the receipt can name it.
        self._chosen = -1
        self._selector = QUEUE_SELECTOR_CALLBACK(self._select)

    def _select(self, mq_size: int, _msg: int | None, arg: int | None) -> int:
        assert arg is not None, "send() always passes a selector argument"
        value = ctypes.c_int.from_address(arg).value
        self._chosen = value % mq_size
        return self._chosen

    def start(self) -> Producer:
        """Check the name server answers (bounded), then start the client."""
        self._admin.master_brokers()  # raises BrokerUnreachableError naming the address
        with _LIFECYCLE:
            self._client = self._started_client()
        return self

    def _started_client(self) -> Any:
        client = rmq.Producer(
            f"{self._group}",
            timeout=self.settings.send_timeout_ms,
            max_message_size=self.settings.max_message_size,
        )
        log_dir = self.settings.resolved_client_log_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        dll.SetProducerLogPath(client._handle, str(log_dir).encode())
        dll.SetProducerLogLevel(client._handle, _LOG_LEVEL_WARN)
        # Unique per process: two producers of one group in one process would
        # otherwise share a client instance in the C++ library.
        dll.SetProducerInstanceName(client._handle, uuid.uuid4().hex.encode())
        # Never compress: bodies must arrive byte-identical for any reader.
        dll.SetProducerCompressMsgBodyOverHowmuch(client._handle, 2**31 - 1)
        client.set_namesrv_addr(self.settings.namesrv_addr)
        if self.settings.access_key is not None and self.settings.secret_key is not None:
            client.set_session_credentials(
                self.settings.access_key.get_secret_value(),
                self.settings.secret_key.get_secret_value(),
                "ALIYUN",
            )
        client.start()
        return client

    def close(self) -> None:
        """Shut the client down."""
        if self._client is not None:
            with _LIFECYCLE:
                self._client.shutdown()
            self._client = None
        if self._owns_admin:
            self._admin.close()

    def __enter__(self) -> Producer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def route(self, topic: str) -> TopicRoute:
        """The (cached) route of ``topic``; raises TopicNotFoundError if it has none."""
        route = self._routes.get(topic)
        if route is None:
            validate_topic_name(topic)
            route = self._admin.route(topic)
            self._routes[topic] = route
        return route

    def send(
        self,
        topic: str,
        body: bytes,
        key: str | None = None,
        tags: str | None = None,
        properties: Mapping[str, str] | None = None,
        queue_id: int | None = None,
    ) -> SendReceipt:
        """Send one message synchronously and return where it was stored.

        The queue is ``queue_id`` if given, else the stable hash of ``key``,
        else round-robin. ``key`` is also stored as the message key. A message
        the broker would refuse (body, key, tags or properties:
        :func:`~stream_assets.rocketmq.batch_producer.check_message`) raises
        before anything is sent.
        """
        if self._client is None:
            raise RocketMQError("producer is not started; call start() or use it as a context")
        props = dict(properties) if properties else None
        outgoing = OutgoingMessage(topic, body, key, tags, props, queue_id)
        body = check_message(outgoing, self.settings.max_message_size).body
        queue_count = self.route(topic).write_queue_count
        # The selector callback is handed the chosen queue index.
        selector_arg = choose_queue(
            topic, queue_count, queue_id, key, lambda: next(self._round_robin)
        )
        msg = rmq.Message(topic)
        dll.SetByteMessageBody(msg._handle, body, len(body))
        if key is not None:
            msg.set_keys(key)
        if tags is not None:
            msg.set_tags(tags)
        for name, value in (properties or {}).items():
            msg.set_property(name, value)
        arg = ctypes.c_int(selector_arg)
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(self.settings.send_retries + 1),
                wait=wait_exponential(multiplier=0.05, max=2.0),
                retry=retry_if_exception_type(_TransientSendError),
                reraise=False,
            ):
                with attempt:
                    result = self._send_once(msg, arg)
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            raise SendError(
                f"send to topic {topic!r} failed after {self.settings.send_retries + 1} "
                f"attempts: {cause}"
            ) from cause
        return SendReceipt(topic, self._chosen, result.offset, result.msg_id)

    def _send_once(self, msg: Any, arg: ctypes.c_int) -> Any:
        with self._lock:
            cres = rmq._CSendResult()
            try:
                rmq.ffi_check(
                    dll.SendMessageOrderly(
                        self._client._handle,
                        msg,
                        self._selector,
                        ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p),
                        0,
                        ctypes.pointer(cres),
                    )
                )
            except RocketMQException as exc:
                raise _TransientSendError(str(exc)) from exc
            if cres.sendStatus != rmq.SendStatus.OK:
                raise _TransientSendError(f"broker answered {rmq.SendStatus(cres.sendStatus).name}")
            return rmq.SendResult(
                rmq.SendStatus(cres.sendStatus),
                normalize_msg_id(cres.msgId.decode("utf-8", errors="replace")),
                cres.offset,
            )
