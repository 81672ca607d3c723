"""CheckResponder against a stand-in broker socket: what it registers, and that a check it
cannot read neither kills it nor gets an answer (the real broker's checks and answers:
tests/integration/test_transactions.py)."""

from __future__ import annotations

import json
import socket
import threading

from stream_assets.rocketmq.remoting import RemotingCommand, RequestCode, is_response, read_frame
from stream_assets.rocketmq.transaction_checks import CheckResponder
from stream_assets.rocketmq.transactions import Outcome
from stream_assets.settings import RocketMQSettings


def test_an_unreadable_check_is_left_for_the_next_and_heartbeats_go_on() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    addr = f"127.0.0.1:{server.getsockname()[1]}"
    frames: list[RemotingCommand] = []
    beats = threading.Semaphore(0)

    def broker() -> None:
        conn, _ = server.accept()
        conn.settimeout(10)
        with conn:
            while True:
                try:
                    frame = RemotingCommand.decode(read_frame(conn))
                except OSError:
                    return
                frames.append(frame)
                if frame.code == RequestCode.HEART_BEAT:
                    reply = RemotingCommand(0, frame.opaque, flag=1)
                    conn.sendall(reply.encode())
                    if len(frames) == 1:  # then a check whose body is no message
                        check = RemotingCommand(
                            RequestCode.CHECK_TRANSACTION_STATE, 7, body=b"not a message"
                        )
                        conn.sendall(check.encode())
                    beats.release()

    thread = threading.Thread(target=broker, daemon=True)
    thread.start()
    asked: list[object] = []
    responder = CheckResponder(
        RocketMQSettings(namesrv_addr="127.0.0.1:1"),
        "job__sink-tx",
        lambda check: asked.append(check) or Outcome.COMMIT,  # type: ignore[func-returns-value]
        masters=lambda: {"broker-a": addr},
        heartbeat_s=0.2,
    )
    with responder:
        for _ in range(3):  # the first, then two more after the bad check
            assert beats.acquire(timeout=10), "the responder stopped sending heartbeats"
    server.close()
    heartbeat = json.loads(frames[0].body)
    assert heartbeat["producerDataSet"] == [{"groupName": "job__sink-tx"}]
    assert heartbeat["heartbeatFingerprint"] == 0
    assert not asked and responder.answered == dict.fromkeys(Outcome, 0)
    assert all(f.code == RequestCode.HEART_BEAT and not is_response(f) for f in frames)
