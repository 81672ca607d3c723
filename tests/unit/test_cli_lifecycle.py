"""``stream-assets stop`` / ``start``: the jobs' stop and start through the storage alone.

A real SQLite-backed Dagster instance in a temporary DAGSTER_HOME, no daemon, no code
server: what is left when the control plane is the slow part.
"""

from pathlib import Path

import dagster as dg
import pytest

from stream_assets.cli import main
from stream_assets.control.allocation import allocate
from stream_assets.control.desired_state import DesiredState, DesiredStateStore


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    # No broker here: the start's topology record check warns and goes on (fast refusal).
    monkeypatch.setenv("STREAM_ASSETS_ROCKETMQ_NAMESRV_ADDR", "127.0.0.1:1")
    with dg.DagsterInstance.get() as instance:
        queues = {"sourceTopic": [0, 1, 2, 3], "wordcount__shuffle__aggregate": list(range(8))}
        DesiredStateStore(instance).set("wordcount", DesiredState(2, allocate(queues, 2)))
    return tmp_path


def _desired(home: Path) -> DesiredState | None:
    with dg.DagsterInstance.get() as instance:
        return DesiredStateStore(instance).get("wordcount")


def test_stop_then_start_keeps_the_allocation(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _desired(home)
    assert before is not None and before.allocation is not None
    assert main(["stop", "wordcount"]) == 0
    stopped = _desired(home)
    assert stopped == DesiredState(0, before.allocation)
    assert "wordcount: stopped (2 instances before, 0 runs ended)" in capsys.readouterr().out

    assert main(["start", "wordcount"]) == 0
    assert _desired(home) == before  # the same count on the same allocation, generation kept
    err = capsys.readouterr().err
    assert "resuming 2 instances on the kept allocation" in err


def test_start_refuses_what_the_job_refuses(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with dg.DagsterInstance.get() as instance:
        store = DesiredStateStore(instance)
        state = store.get("wordcount")
        assert state is not None
        store.set("wordcount", DesiredState(0, state.allocation, paused=True))
    assert main(["start", "wordcount"]) == 1
    assert "supervision is paused" in capsys.readouterr().err
    assert _desired(home) == DesiredState(0, state.allocation, paused=True)  # unchanged


def test_an_unknown_topology_changes_nothing(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _desired(home)
    assert main(["stop", "no-such-topology"]) == 1
    assert "unknown topology 'no-such-topology'" in capsys.readouterr().err
    with dg.DagsterInstance.get() as instance:
        assert DesiredStateStore(instance).get("no-such-topology") is None
    assert _desired(home) == before


def test_without_a_dagster_home_it_says_where_to_point(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert main(["stop", "wordcount"]) == 2
    assert "set DAGSTER_HOME" in capsys.readouterr().err
