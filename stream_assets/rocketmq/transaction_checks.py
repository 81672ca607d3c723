"""The broker's check-back: answering "what became of this half message?" for a producer group.

A half message its producer never committed or rolled back (the producer
died between its prepare and its end) stays in the broker's half queue. Every
``transactionCheckInterval`` the broker sends ``CHECK_TRANSACTION_STATE`` for
each one older than ``transactionTimeOut``, one-way, to *any* channel that
registered the message's producer group (``PGROUP``) with a ``HEART_BEAT``
(docs/notes/transactions.md, section 3). The answer is a one-way
``END_TRANSACTION`` naming the checked copy's offsets: commit, roll back, or
unknown (asked again at the next check; after ``transactionCheckMax`` checks
the broker discards the message).

:class:`CheckResponder` is that channel: it registers the group with every
master, keeps one connection to each open, and answers each check with what
its ``resolve`` function says. Whoever runs it decides from durable state,
not from memory, so any process of the group answers alike.

Hand-written, for the reason transactions.py gives; the loop reads frames the
request/response :class:`~stream_assets.rocketmq.remoting.RemotingConnection`
would skip.

Example::

    >>> def resolve(check: TransactionCheck) -> Outcome:  # doctest: +SKIP
    ...     return Outcome.COMMIT if landed(check.properties) else Outcome.ROLLBACK
    >>> with CheckResponder(settings, "wordcount-sink", resolve):  # doctest: +SKIP
    ...     ...  # the broker's checks of the group's transactions are answered here
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from stream_assets.rocketmq.admin import RocketMQAdmin, credentials_of
from stream_assets.rocketmq.message_codec import decode_messages
from stream_assets.rocketmq.remoting import (
    ONEWAY_FLAG,
    RemotingCommand,
    RequestCode,
    describe_socket_error,
    is_response,
    read_frame,
)
from stream_assets.rocketmq.transactions import Outcome, Prepared, end_transaction_fields
from stream_assets.settings import RocketMQSettings

_log = logging.getLogger(__name__)

#: The broker forgets a producer channel after 120 s without a heartbeat
#: (ProducerManager.CHANNEL_EXPIRED_TIMEOUT); the Java client sends one every 30 s.
HEARTBEAT_S = 20.0


@dataclass(frozen=True)
class TransactionCheck:
    """One ``CHECK_TRANSACTION_STATE``: the checked copy of a half message.

    ``prepared`` names the copy the broker re-appended before asking (its own
    offsets), with the real topic and queue; ``properties`` are the message's,
    as its producer set them plus the broker's (``PGROUP``, ``UNIQ_KEY``,
    ``TRANSACTION_CHECK_TIMES``).
    """

    prepared: Prepared
    properties: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""

    @property
    def times_checked(self) -> int:
        """How many checks of this message the broker made, this one included."""
        return int(self.properties.get("TRANSACTION_CHECK_TIMES", "1"))


Resolve = Callable[[TransactionCheck], Outcome]


class CheckResponder:
    """Registers ``group`` with every master and answers the broker's checks of its
    half messages with ``resolve`` (in one background thread; an error in
    ``resolve`` answers :attr:`Outcome.UNKNOWN`, so the broker asks again).

    ``masters`` gives broker name -> master address; by default the name
    server's, read again every ``heartbeat_s``, so a promoted slave or a new
    broker group is registered within one heartbeat.
    """

    def __init__(
        self,
        settings: RocketMQSettings,
        group: str,
        resolve: Resolve,
        masters: Callable[[], Mapping[str, str]] | None = None,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.settings = settings
        self.group = group
        self._resolve = resolve
        self._admin: RocketMQAdmin | None = None
        if masters is None:
            self._admin = RocketMQAdmin(settings)
            masters = self._admin.master_brokers
        self._masters = masters
        self._heartbeat_s = heartbeat_s
        self._credentials = credentials_of(settings)
        # The broker keys producer channels by client id: one per responder.
        self._client_id = f"stream-assets@{os.getpid()}@{uuid.uuid4().hex[:8]}"
        self._selector = selectors.DefaultSelector()
        self._socks: dict[str, socket.socket] = {}
        #: The last master list read: what a heartbeat goes to while the name server is away.
        self._known: dict[str, str] = {}
        self._opaques = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tx-checks-{group}", daemon=True)
        self.answered: dict[Outcome, int] = dict.fromkeys(Outcome, 0)

    def start(self) -> CheckResponder:
        """Register with every master now (raises if none answers); answer in the background."""
        self._heartbeat()
        if not self._socks:
            raise ConnectionError(
                f"no broker master answered the heartbeat of producer group {self.group!r}; "
                "check that the brokers run (`stream-assets broker status`)"
            )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop answering; the broker sends later checks to the group's other producers."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for addr in list(self._socks):
            self._drop(addr)
        self._selector.close()
        if self._admin is not None:
            self._admin.close()

    def __enter__(self) -> CheckResponder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        beat_at = time.monotonic() + self._heartbeat_s
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                try:
                    self._read(str(key.data))
                except Exception:  # never the end of answering: the broker asks again
                    _log.exception("transaction checks of %s: reading %s", self.group, key.data)
            if time.monotonic() >= beat_at:
                self._heartbeat()
                beat_at = time.monotonic() + self._heartbeat_s

    def _heartbeat(self) -> None:
        try:
            self._known = dict(self._masters())
        except Exception as exc:  # the name server may be restarting: keep what we have
            _log.warning("transaction checks of %s: no broker list (%s)", self.group, exc)
        masters = self._known
        for addr in set(self._socks) - set(masters.values()):
            self._drop(addr)  # no longer a master: a promoted slave took over
        body = json.dumps(
            {
                "clientID": self._client_id,
                "producerDataSet": [{"groupName": self.group}],
                "consumerDataSet": [],
                # 0 keeps the broker on the plain heartbeat (non-zero selects V2).
                "heartbeatFingerprint": 0,
            }
        ).encode()
        for name, addr in masters.items():
            try:
                self._send(addr, RequestCode.HEART_BEAT, {}, body, flag=0)
            except OSError as exc:
                self._drop(addr)
                _log.warning(
                    "transaction checks of %s: broker %s at %s: %s",
                    self.group,
                    name,
                    addr,
                    describe_socket_error(exc),
                )

    def _send(self, addr: str, code: int, fields: dict[str, str], body: bytes, flag: int) -> None:
        sock = self._socks.get(addr)
        if sock is None:
            host, _, port = addr.rpartition(":")
            sock = socket.create_connection(
                (host, int(port)), timeout=self.settings.request_timeout_s
            )
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks[addr] = sock
            self._selector.register(sock, selectors.EVENT_READ, addr)
        if self._credentials is not None:
            fields = self._credentials.sign(fields, body)
        command = RemotingCommand(
            code, opaque=next(self._opaques), flag=flag, ext_fields=fields, body=body
        )
        sock.sendall(command.encode())

    def _read(self, addr: str) -> None:
        sock = self._socks.get(addr)
        if sock is None:
            return
        try:
            command = RemotingCommand.decode(read_frame(sock))
        except (OSError, ValueError) as exc:
            _log.info("transaction checks of %s: %s closed (%s)", self.group, addr, exc)
            self._drop(addr)
            return
        if is_response(command):
            if command.code != 0:  # a heartbeat refused, e.g. by ACL
                _log.warning(
                    "transaction checks of %s: broker %s refused the heartbeat: code %s, %s",
                    self.group,
                    addr,
                    command.code,
                    command.remark,
                )
        elif command.code == RequestCode.CHECK_TRANSACTION_STATE:
            self._answer(addr, command)

    def _answer(self, addr: str, command: RemotingCommand) -> None:
        try:
            check = _check_of(addr, command)
        except Exception as exc:  # a header or body we cannot read: the broker asks again
            _log.warning("transaction checks of %s: unreadable check (%s)", self.group, exc)
            return
        try:
            outcome = self._resolve(check)
        except Exception:
            _log.exception(
                "transaction checks of %s: resolving %s failed; the broker asks again",
                self.group,
                check.prepared.msg_id,
            )
            outcome = Outcome.UNKNOWN
        fields = end_transaction_fields(check.prepared, self.group, outcome, from_check=True)
        try:
            self._send(addr, RequestCode.END_TRANSACTION, fields, b"", ONEWAY_FLAG)
        except OSError as exc:
            self._drop(addr)  # the broker checks again
            _log.warning("transaction checks of %s: answer to %s lost: %s", self.group, addr, exc)
            return
        self.answered[outcome] += 1

    def _drop(self, addr: str) -> None:
        sock = self._socks.pop(addr, None)
        if sock is not None:
            try:
                self._selector.unregister(sock)
            finally:
                sock.close()


def _check_of(addr: str, command: RemotingCommand) -> TransactionCheck:
    """The check's copy: offsets from the header, real topic and queue from the body."""
    header = command.ext_fields
    (message,) = decode_messages(command.body)
    prepared = Prepared(
        topic=message.topic,
        queue_index=-1,  # not known from a check, nor needed to end it
        broker_name=header.get("bname", ""),
        addr=addr,
        queue_id=message.queue_id,
        msg_id=header.get("msgId") or message.msg_id,
        tran_state_offset=int(header["tranStateTableOffset"]),
        commit_log_offset=int(header["commitLogOffset"]),
    )
    return TransactionCheck(prepared, message.properties, message.body)
