"""Restoring moved queues: which queues, into which store, and what is reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from stream_assets.control import restore as restore_module
from stream_assets.control.restore import restore_queues, stateful_stages
from stream_assets.examples import wordcount
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.state.restore import ProgressCallback, RestoreProgress, RestoreResult
from stream_assets.state.store import QueueStateStore

SHUFFLE = "wordcount__shuffle__key_by-2"
STATE = "wordcount__state__aggregate-3"


def test_only_stateful_queues_are_restored_each_into_a_wiped_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topology = wordcount.build()
    op_id = stateful_stages(topology)[SHUFFLE].aggregate.op_id  # type: ignore[union-attr]
    with QueueStateStore(tmp_path, topology.job_id, op_id, 3) as stale:
        stale.commit({b"old": b"1"}, stale.next_meta())
    calls: list[tuple[str, int, bool]] = []

    def fake_restore(
        store: QueueStateStore,
        state_topic: str,
        queue_id: int,
        admin: Any,
        reader: Any,
        progress: ProgressCallback | None = None,
    ) -> RestoreResult:
        calls.append((state_topic, queue_id, store.is_empty()))
        assert progress is not None
        for read in (100, 200, 250):
            progress(RestoreProgress(queue_id, read, 250, 0, read // 10))
        return RestoreResult(
            queue_id=queue_id,
            keys=25,
            seq=7,
            messages_read=250,
            bytes_read=1000,
            seconds=0.5,
            start_offset=0,
            end_offset=250,
            snapshot_offset=None,
        )

    monkeypatch.setattr(restore_module, "restore_queue", fake_restore)
    lines: list[str] = []
    done = restore_queues(
        topology,
        [("sourceTopic", 1), (SHUFFLE, 3), (SHUFFLE, 0)],
        tmp_path,
        cast(RocketMQAdmin, None),
        cast(QueueReader, None),
        lines.append,
    )
    # The source topic has no state; both shuffle queues are restored, in order, from empty.
    assert calls == [(STATE, 3, True), (STATE, 0, True)]
    assert [(r.topic, r.state_topic, r.queue_id, r.result.keys) for r in done] == [
        (SHUFFLE, STATE, 3, 25),
        (SHUFFLE, STATE, 0, 25),
    ]
    assert lines[:2] == [
        f"restoring {STATE}[3]: 200/250 messages, 20 keys",
        f"restored {STATE}[3]: 25 keys, seq 7, 250 messages in 0.50s",
    ]
