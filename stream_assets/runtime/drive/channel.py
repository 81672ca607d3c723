"""The real-time mode's line between an instance and its long-running tasks.

A real-time task runs for a whole interval (:mod:`~stream_assets.runtime.drive.interval`),
so what a micro-batch hands back when its job ends has to travel while the
task runs: each step's stats rows (the instance commits their offsets and
counts them at once), what the step printed, and, the other way, the
instance's stop, which must reach a task within one small step rather than
at the end of its interval.

Spark has no such channel for Python (accumulators arrive when a task ends),
so this is a plain TCP connection from each task to a server in the instance
process. Wire format, version 1: frames of a 4-byte big-endian length and a
msgpack map. A task's first frame is ``{"v": 1, "token": ...}`` (the server
drops a connection with another token: the port is reachable from the
cluster); then ``{"rows": [...]}`` and ``{"text": [...]}``. The server's only
message is one byte, ``S``: stop after this step. A task that loses the
connection stops too: its instance is gone.

Example::

    >>> got = []
    >>> server = ChannelServer("127.0.0.1", on_rows=got.extend, on_text=print)
    >>> client = ChannelClient(server.address, server.token)
    >>> client.send_rows([{"queue_id": 3}]); client.stop_requested()
    False
    >>> server.request_stop(); client.wait(5.0)
    True
    >>> client.close(); server.close(); got
    [{'queue_id': 3}]
"""

from __future__ import annotations

import contextlib
import secrets
import select
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

VERSION = 1
_STOP = b"S"
_LENGTH = struct.Struct(">I")
#: A frame larger than this is a broken or foreign peer, not a step's stats.
_MAX_FRAME = 64 * 1024 * 1024


class ChannelError(RuntimeError):
    """The instance's channel could not be reached or spoke another protocol."""


def _frame(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


class _Peer:
    """One task's connection, as the server reads it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.greeted = False

    def frames(self) -> list[dict[str, Any]]:
        out = []
        while len(self.buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self.buffer)
            if size > _MAX_FRAME:
                raise ChannelError(f"a frame of {size} bytes")
            if len(self.buffer) < _LENGTH.size + size:
                break
            body = bytes(self.buffer[_LENGTH.size : _LENGTH.size + size])
            del self.buffer[: _LENGTH.size + size]
            out.append(msgpack.unpackb(body, raw=False))
        return out


class ChannelServer:
    """The instance's end: takes every task's rows and prints, and sends the stop.

    ``on_rows`` and ``on_text`` run on the server's thread, one frame at a
    time, in the order each task sent them.
    """

    def __init__(
        self,
        host: str,
        on_rows: Callable[[list[dict[str, Any]]], None],
        on_text: Callable[[str], None],
    ) -> None:
        self.token = secrets.token_hex(16)
        self._on_rows, self._on_text = on_rows, on_text
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._peers: dict[socket.socket, _Peer] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._closed = threading.Event()
        #: The first error a handler raised (the instance reports it as the run's failure).
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="real-time-channel", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Tell every task, and every task that connects from now on, to stop after its step."""
        with self._lock:
            self._stopping = True
            peers = list(self._peers.values())
        for peer in peers:
            self._send_stop(peer)

    def resume(self) -> None:
        """Tasks that connect from now on run again (after an interval ended early to
        deal the queues anew, :class:`~stream_assets.runtime.spark.real_time.RealTimeQuery`)."""
        with self._lock:
            self._stopping = False

    def close(self) -> None:
        """Stop serving; tasks still connected see the connection end (and stop)."""
        self._closed.set()
        self._thread.join(timeout=5)
        for peer in list(self._peers.values()):
            peer.sock.close()
        self._selector.close()
        self._listener.close()

    def _send_stop(self, peer: _Peer) -> None:
        # Gone already: it stops by itself.
        with contextlib.suppress(OSError):
            peer.sock.sendall(_STOP)

    def _serve(self) -> None:
        while not self._closed.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                else:
                    self._read(self._peers[sock])

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)
        sock.settimeout(5.0)
        with self._lock:
            self._peers[sock] = _Peer(sock)
        self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, peer: _Peer) -> None:
        self._selector.unregister(peer.sock)
        with self._lock:
            self._peers.pop(peer.sock, None)
        peer.sock.close()

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        peer.buffer.extend(data)
        try:
            for message in peer.frames():
                self._handle(peer, message)
        except (ChannelError, ValueError, msgpack.UnpackException):
            self._drop(peer)  # not one of ours
        except BaseException as exc:
            if self.error is None:
                self.error = exc
            self._drop(peer)  # the task sees the connection end and stops

    def _handle(self, peer: _Peer, message: dict[str, Any]) -> None:
        if not peer.greeted:
            if message.get("v") != VERSION or message.get("token") != self.token:
                raise ChannelError("a peer without this channel's token or version")
            peer.greeted = True
            with self._lock:
                stopping = self._stopping
            if stopping:
                self._send_stop(peer)
            return
        if "rows" in message:
            self._on_rows(list(message["rows"]))
        if "text" in message:
            self._on_text("".join(message["text"]))


class ChannelClient:
    """A task's end: sends its steps' rows and prints, and hears the stop.

    Also the :class:`~stream_assets.runtime.drive.printing.Lines` a step's
    prints go to.
    """

    def __init__(self, address: str, token: str, timeout_s: float = 30.0) -> None:
        host, _, port = address.rpartition(":")
        try:
            self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        except OSError as exc:
            raise ChannelError(
                f"a real-time task could not reach its instance at {address} ({exc}): the "
                "executors must be able to connect to the driver's host (spark.driver.host)"
            ) from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._stopped = False
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self._send({"v": VERSION, "token": token})

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._sock.sendall(_frame(message))
        except OSError as exc:
            raise ChannelError(f"the instance's channel closed ({exc})") from exc

    def send_rows(self, rows: list[dict[str, Any]]) -> None:
        """One step's stats rows (:meth:`TaskStats.as_row`)."""
        self._send({"rows": rows})

    def add(self, term: list[str]) -> None:
        """What a step printed (the ``Lines`` protocol)."""
        self._send({"text": term})

    def stop_requested(self) -> bool:
        """Whether the instance said stop, or is gone; never blocks."""
        return self.wait(0.0)

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a stop; whether one came (or the instance is gone)."""
        if self._stopped:
            return True
        if not self._poll.poll(seconds * 1000):
            return False
        self._stopped = True  # a stop byte, or the end of the connection: both stop
        return True

    def close(self) -> None:
        """Close the connection (the server drops it)."""
        self._sock.close()
