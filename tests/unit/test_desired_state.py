"""Desired state and heartbeats live in the Dagster instance's storage (real instances)."""

import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from stream_assets.control.allocation import allocate
from stream_assets.control.desired_state import (
    DesiredState,
    DesiredStateStore,
    Heartbeat,
    heartbeat_key,
    heartbeats,
    record_heartbeat,
)


@pytest.fixture
def dagster_home(tmp_path: Path) -> Path:
    home = tmp_path / "dagster_home"
    home.mkdir()
    return home


@pytest.fixture
def instance(dagster_home: Path) -> Iterator[dg.DagsterInstance]:
    # A real SQLite-backed instance in a temporary DAGSTER_HOME (what `dagster dev` uses).
    with dg.DagsterInstance.local_temp(str(dagster_home)) as inst:
        yield inst


def test_desired_state_round_trips(instance: dg.DagsterInstance) -> None:
    store = DesiredStateStore(instance)
    assert store.get("wordcount") is None
    a = allocate({"sourceTopic": [0, 1, 2, 3], "wordcount__shuffle__aggregate": list(range(8))}, 3)
    store.set("wordcount", DesiredState(3, a))
    got = store.get("wordcount")
    assert got == DesiredState(3, a)
    assert got is not None and got.allocation is not None
    assert got.allocation.for_instance(2) == a.for_instance(2)


def test_set_replaces_and_keeps_topologies_apart(instance: dg.DagsterInstance) -> None:
    store = DesiredStateStore(instance)
    store.set("wordcount", DesiredState(1))
    store.set("windowed-sum", DesiredState(2))
    a = allocate({"t": [0, 1]}, 4)
    store.set("wordcount", DesiredState(4, a))  # an update of an existing key
    assert store.get("wordcount") == DesiredState(4, a)
    assert store.get("windowed-sum") == DesiredState(2)
    assert store.get_many(["wordcount", "windowed-sum", "nope"]) == {
        "wordcount": DesiredState(4, a),
        "windowed-sum": DesiredState(2),
    }


def test_state_is_durable_across_instances_and_processes(dagster_home: Path) -> None:
    a = allocate({"events": [0, 1, 2, 3]}, 2)
    with dg.DagsterInstance.local_temp(str(dagster_home)) as first:
        DesiredStateStore(first).set("windowed-sum", DesiredState(2, a))
        record_heartbeat(first, "windowed-sum", a.generation, 1, "run-1", ts=123.0)

    # A fresh Python process opening the same DAGSTER_HOME sees it: nothing in memory.
    script = textwrap.dedent(
        """
        import dagster as dg
        from stream_assets.control.desired_state import DesiredStateStore, heartbeats
        with dg.DagsterInstance.get() as inst:
            state = DesiredStateStore(inst).get("windowed-sum")
            beat = heartbeats(inst, ["run-1"])["run-1"]
            print(state.allocation.to_json(), beat.instance_index, beat.ts)
        """
    )
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [a.to_json(), "1", "123.0"]


def test_ephemeral_instance_works_too() -> None:
    # In-memory run storage is also a SQL run storage with the kvs table.
    with dg.DagsterInstance.ephemeral() as inst:
        store = DesiredStateStore(inst)
        store.set("wordcount", DesiredState(2))
        assert store.get("wordcount") == DesiredState(2)


def test_long_job_ids_get_distinct_short_keys(instance: dg.DagsterInstance) -> None:
    # MySQL's unique index on kvs keys covers 64 characters.
    a_id, b_id = "x" * 79 + "a", "x" * 79 + "b"
    ka, kb = DesiredStateStore.key(a_id), DesiredStateStore.key(b_id)
    assert len(ka) <= 64 and len(kb) <= 64 and ka != kb
    store = DesiredStateStore(instance)
    store.set(a_id, DesiredState(1))
    store.set(b_id, DesiredState(2))
    assert store.get(a_id) == DesiredState(1) and store.get(b_id) == DesiredState(2)
    assert len(heartbeat_key("0f5e2b1c-6a7d-4e3f-9a8b-1c2d3e4f5a6b")) <= 64


def test_heartbeats_by_run(instance: dg.DagsterInstance) -> None:
    record_heartbeat(instance, "wordcount", 3, 0, "run-a", ts=100.0, lag={"sourceTopic": 5})
    record_heartbeat(instance, "wordcount", 3, 1, "run-b", ts=101.0)
    latest = record_heartbeat(instance, "wordcount", 3, 0, "run-a", ts=130.0)
    beats = heartbeats(instance, ["run-a", "run-b", "run-never"])
    assert set(beats) == {"run-a", "run-b"}
    assert beats["run-a"] == latest
    assert beats["run-a"].lag == {}
    assert beats["run-b"].age(now=131.0) == pytest.approx(30.0)
    assert heartbeats(instance, []) == {}


def test_heartbeat_with_lag_round_trips(instance: dg.DagsterInstance) -> None:
    record_heartbeat(instance, "wordcount", 2, 1, "run-c", ts=5.5, lag={"sourceTopic": 42})
    assert heartbeats(instance, ["run-c"])["run-c"] == Heartbeat(
        "wordcount",
        2,
        1,
        "run-c",
        5.5,
        {"sourceTopic": 42},
        pid=os.getpid(),
        host=socket.gethostname(),
    )


def test_a_heartbeat_says_which_broker_group_the_run_waits_for(
    instance: dg.DagsterInstance,
) -> None:
    record_heartbeat(instance, "wordcount", 2, 1, "run-w", ts=5.5, waiting={"broker-b": 1.5})
    beat = heartbeats(instance, ["run-w"])["run-w"]
    assert beat.waiting == {"broker-b": 1.5}
    assert beat.activity(now=46.5) == (
        "waiting for broker group broker-b: no master answers, for 45 s"
    )


def test_invalid_desired_state_is_rejected() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        DesiredState(-1)
    with pytest.raises(ValueError, match="phase"):
        DesiredState(1, phase="dance")
    with pytest.raises(ValueError, match="format"):
        DesiredState.from_json('{"format": 99, "target_instances": 1}')


def test_a_write_waits_out_a_table_lock_instead_of_failing() -> None:
    # The in-memory storage (shared-cache SQLite) refuses a write at once while another
    # connection holds kvs, "database table is locked: kvs": what failed a stop job
    # while an instance's run reported itself. The store waits for the lock instead.
    instance = dg.DagsterInstance.ephemeral()
    storage = instance.daemon_cursor_storage
    attempts: list[int] = []
    attempted = threading.Event()
    real_set = storage.set_cursor_values

    def counted(pairs: dict[str, str]) -> None:
        attempts.append(1)
        if len(attempts) >= 2:
            attempted.set()
        real_set(pairs)

    storage.set_cursor_values = counted  # type: ignore[method-assign]
    holder = storage._engine.connect()  # type: ignore[attr-defined]
    held = holder.begin()
    holder.execute(sa.text("INSERT INTO kvs (key, value) VALUES ('holder', 'x')"))
    errors: list[BaseException] = []

    def write() -> None:
        try:
            DesiredStateStore(instance).set("wordcount", DesiredState(0))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
            attempted.set()

    writer = threading.Thread(target=write)
    writer.start()
    assert attempted.wait(30), "the write was never retried"
    held.commit()
    holder.close()
    writer.join(60)
    assert not errors, errors
    assert len(attempts) >= 2  # refused at least once while the lock was held
    assert DesiredStateStore(instance).get("wordcount") == DesiredState(0)
