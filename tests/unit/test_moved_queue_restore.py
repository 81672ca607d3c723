"""Warming gained queues: which queues, which stores, and what is reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.runtime.drive import warm_up as warm_up_module
from stream_assets.runtime.drive.warm_up import stateful_stages, warm_queues
from stream_assets.state.restore import RestoreResult
from stream_assets.state.store import QueueStateStore

SHUFFLE = "wordcount__shuffle__aggregate"
STATE = "wordcount__state__aggregate"


def test_warm_up_catches_up_stateful_queues_and_leaves_held_ones_to_their_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topology = wordcount.build()
    op_id = stateful_stages(topology)[SHUFFLE].aggregate.op_id  # type: ignore[union-attr]
    with QueueStateStore(tmp_path, topology.job_id, op_id, 3) as behind:
        behind.commit({b"old": b"1"}, behind.next_meta())
    calls: list[tuple[str, int, bytes | None]] = []

    def fake_state_queue(admin: Any, state_topic: str, queue_id: int) -> tuple[str, int]:
        return state_topic, queue_id

    def fake_ensure_current(
        store: QueueStateStore, log: tuple[str, int], admin: Any, reader: Any
    ) -> RestoreResult:
        # Nothing is wiped: the store keeps what it had and catches up from there.
        calls.append((*log, store.get(b"old")))
        return RestoreResult(
            queue_id=log[1],
            keys=25,
            seq=7,
            messages_read=3,
            bytes_read=100,
            seconds=0.5,
            start_offset=4,
            end_offset=7,
            snapshot_offset=None,
        )

    monkeypatch.setattr(warm_up_module, "state_queue", fake_state_queue)
    monkeypatch.setattr(warm_up_module, "ensure_current", fake_ensure_current)
    lines: list[str] = []
    # Queue 0's store is open here, as its current owner on this machine holds it.
    with QueueStateStore(tmp_path, topology.job_id, op_id, 0):
        done = warm_queues(
            topology,
            [("sourceTopic", 1), (SHUFFLE, 3), (SHUFFLE, 0)],
            tmp_path,
            cast(RocketMQAdmin, None),
            cast(QueueReader, None),
            lines.append,
        )
    # The source topic has no state; queue 3 catches up; queue 0 is its owner's.
    assert calls == [(STATE, 3, b"1")]
    assert [(r.topic, r.state_topic, r.queue_id, r.result.keys) for r in done] == [
        (SHUFFLE, STATE, 3, 25)
    ]
    assert lines == [
        f"warmed {STATE}[3]: 25 keys, seq 7 in 0.50s",
        f"{STATE}[0]: held by its current owner here; nothing to warm",
    ]
