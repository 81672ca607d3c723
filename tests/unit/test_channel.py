"""The real-time mode's channel: rows arrive in order, a stop reaches a waiting task at once,
a stranger is dropped, and a failing handler becomes the query's error."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import msgpack
import pytest

from stream_assets.runtime.drive.channel import ChannelClient, ChannelError, ChannelServer


def _server(rows: list[dict[str, Any]], texts: list[str] | None = None) -> ChannelServer:
    arrived = threading.Condition()

    def on_rows(batch: list[dict[str, Any]]) -> None:
        with arrived:
            rows.extend(batch)
            arrived.notify_all()

    server = ChannelServer("127.0.0.1", on_rows, (texts if texts is not None else []).append)
    server.arrived = arrived  # type: ignore[attr-defined]
    return server


def _await(server: ChannelServer, condition: Any) -> None:
    arrived = server.arrived  # type: ignore[attr-defined]
    with arrived:
        assert arrived.wait_for(condition, timeout=10), "the rows never arrived"


def test_rows_from_two_tasks_arrive_each_in_its_order() -> None:
    rows: list[dict[str, Any]] = []
    server = _server(rows)
    a, b = ChannelClient(server.address, server.token), ChannelClient(server.address, server.token)
    try:
        for step in range(200):
            a.send_rows([{"task": "a", "step": step}])
            b.send_rows([{"task": "b", "step": step}, {"task": "b", "step": step}])
        _await(server, lambda: len(rows) == 600)
        for task in ("a", "b"):
            steps = [r["step"] for r in rows if r["task"] == task]
            assert steps == sorted(steps) and set(steps) == set(range(200))
    finally:
        a.close(), b.close(), server.close()


def test_a_stop_wakes_a_waiting_task_at_once_and_reaches_later_ones() -> None:
    server = _server([])
    client = ChannelClient(server.address, server.token)
    try:
        assert not client.stop_requested()
        woke: list[float] = []
        waiter = threading.Thread(target=lambda: woke.append(float(client.wait(60.0))))
        waiter.start()
        server.request_stop()
        waiter.join(timeout=10)
        assert woke == [1.0], "the stop did not end the task's wait"
        assert client.stop_requested()  # and it stays stopped
        late = ChannelClient(server.address, server.token)  # connects after the stop
        assert late.wait(10.0)
        late.close()
    finally:
        client.close(), server.close()


def test_after_resume_a_new_task_runs_and_a_later_stop_still_reaches_it() -> None:
    """An interval ended early to deal the queues anew: the next interval's tasks run."""
    rows: list[dict[str, Any]] = []
    server = _server(rows)
    try:
        server.request_stop()
        server.resume()
        task = ChannelClient(server.address, server.token)
        task.send_rows([{"step": 1}])
        # The greeting is handled before the rows: a stop would already be on its way.
        _await(server, lambda: len(rows) == 1)
        assert not task.stop_requested()
        server.request_stop()
        assert task.wait(10.0)
        task.close()
    finally:
        server.close()


def test_a_task_whose_instance_is_gone_stops() -> None:
    server = _server([])
    client = ChannelClient(server.address, server.token)
    server.close()
    assert client.wait(10.0)
    client.close()


def test_a_peer_without_the_token_is_dropped_and_its_rows_ignored() -> None:
    rows: list[dict[str, Any]] = []
    server = _server(rows)
    host, port = server.address.rsplit(":", 1)
    try:
        stranger = socket.create_connection((host, int(port)), timeout=5)
        for message in ({"v": 1, "token": "guess"}, {"rows": [{"x": 1}]}):
            body = msgpack.packb(message)
            stranger.sendall(struct.pack(">I", len(body)) + body)
        stranger.settimeout(10)
        # Dropped with our second message unread, the kernel answers with a reset, not a FIN.
        try:
            dropped = stranger.recv(1) == b""
        except ConnectionResetError:
            dropped = True
        assert dropped, "the server kept a peer with a wrong token"
        stranger.close()
        ours = ChannelClient(server.address, server.token)
        ours.send_rows([{"x": 2}])
        _await(server, lambda: len(rows) == 1)
        assert rows == [{"x": 2}]
        ours.close()
    finally:
        server.close()


def test_a_failing_handler_is_the_servers_error_and_ends_that_task() -> None:
    def refuse(_rows: list[dict[str, Any]]) -> None:
        raise RuntimeError("commit refused")

    server = ChannelServer("127.0.0.1", refuse, lambda _text: None)
    client = ChannelClient(server.address, server.token)
    try:
        client.send_rows([{"x": 1}])
        # The server records the error before it closes the connection the task waits on.
        assert client.wait(10.0), "the task was not told"
        assert isinstance(server.error, RuntimeError) and "commit refused" in str(server.error)
    finally:
        client.close(), server.close()


def test_an_unreachable_instance_says_what_to_check() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ChannelError, match=r"spark\.driver\.host"):
        ChannelClient(f"127.0.0.1:{port}", "t", timeout_s=2)
