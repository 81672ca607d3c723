"""SingleWorkerRunLauncher's decisions on a real (temporary) Dagster instance.

The code server is what a unit test cannot have: ``start_worker`` and
``worker_running`` (the two calls to it) are replaced by recorders. The real server
is in tests/integration/test_supervision.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import dagster as dg
import pytest
from dagster._core.errors import DagsterUserCodeUnreachableError
from dagster._core.launcher import LaunchRunContext
from dagster._core.storage.tags import GRPC_INFO_TAG

from stream_assets.control.run_launcher import ALREADY_RUNNING, SingleWorkerRunLauncher
from stream_assets.jobs.lifecycle import stop_topology_job

TIMED_OUT = DagsterUserCodeUnreachableError("gRPC Error code: DEADLINE_EXCEEDED")
TRIED = {GRPC_INFO_TAG: '{"host": "localhost"}'}  # what an earlier launch left on the run


class Recorder(SingleWorkerRunLauncher):
    """Starts no process: counts the starts; the server holds a worker or not, or is silent."""

    def __init__(self, reply_times_out: bool, holds_worker: bool | None = None) -> None:
        super().__init__()
        self.reply_times_out, self.holds_worker = reply_times_out, holds_worker
        self.starts = 0

    def start_worker(self, context: LaunchRunContext) -> None:
        self.starts += 1
        if self.reply_times_out:
            raise TIMED_OUT

    def worker_running(self, context: LaunchRunContext) -> bool:
        if self.holds_worker is None:
            raise TIMED_OUT  # the server does not answer this either
        return self.holds_worker


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def _launch(
    instance: dg.DagsterInstance, launcher: Recorder, tags: dict[str, str] | None = None
) -> list[str]:
    """Launch a run through ``launcher``; what the run's log says."""
    launcher.register_instance(instance)
    run = instance.create_run_for_job(
        stop_topology_job,
        run_config={"ops": {"stop_topology": {"config": {"topology": "wc"}}}},
        tags=tags,
    )
    launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
    return [e.message or "" for e in instance.all_logs(run.run_id)]


def test_a_reply_that_timed_out_after_the_worker_started_is_a_launch(
    instance: dg.DagsterInstance,
) -> None:
    launcher = Recorder(reply_times_out=True, holds_worker=True)
    said = _launch(instance, launcher)
    assert launcher.starts == 1
    assert sum(ALREADY_RUNNING in m and "it is launched" in m for m in said) == 1, said


@pytest.mark.parametrize("holds_worker", [False, None], ids=["no-worker", "server-silent"])
def test_a_reply_that_timed_out_without_a_worker_is_left_to_the_queue(
    instance: dg.DagsterInstance, holds_worker: bool | None
) -> None:
    launcher = Recorder(reply_times_out=True, holds_worker=holds_worker)
    with pytest.raises(DagsterUserCodeUnreachableError):
        _launch(instance, launcher)
    assert launcher.starts == 1


def test_a_retried_launch_whose_worker_runs_starts_none(instance: dg.DagsterInstance) -> None:
    launcher = Recorder(reply_times_out=False, holds_worker=True)
    said = _launch(instance, launcher, tags=TRIED)
    assert launcher.starts == 0
    assert sum("not starting another" in m for m in said) == 1, said


@pytest.mark.parametrize(
    "tags", [{}, {GRPC_INFO_TAG: '{"host": "localhost"}'}], ids=["new", "tried"]
)
def test_a_run_no_server_knows_is_started(
    instance: dg.DagsterInstance, tags: dict[str, str]
) -> None:
    launcher = Recorder(reply_times_out=False, holds_worker=False)
    _launch(instance, launcher, tags=tags)
    assert launcher.starts == 1
