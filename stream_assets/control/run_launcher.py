"""Dagster's default run launcher, made idempotent: one run worker per run, however slow
the code server is to answer.

Why: the code server answers a launch only once the run worker it spawned has
loaded the code location. On a loaded machine that load outlasts the daemon's
gRPC deadline, and Dagster takes the DEADLINE_EXCEEDED for "not started": it puts
the run back in the queue (``run_queue: max_user_code_failure_retries``). The
worker, done loading, then finds its run QUEUED, takes itself for a duplicate
("Ignoring a duplicate run") and exits, and the code server marks the run FAILURE
from outside; or, when the queue's next try comes first, a second worker starts
for the same run, and the server, which books one process per run id, loses
track of the first, which serves on unsupervised.

So a launch whose reply did not come asks the code server whether it holds a
worker for the run; if it does, the launch did happen: it returns as launched
(the run's log says so) and the run is never re-queued. A launch that an earlier
try already took to the server (the run carries the launcher's gRPC tag) asks
the same before it starts anything. Only a server that does not know the run
starts a worker. Everything else is Dagster's ``DefaultRunLauncher``; nothing
here is a copy of it.

Configured in ``dagster.yaml`` (infra/dagster and infra/deploy/dagster)::

    run_launcher:
      module: stream_assets.control.run_launcher
      class: SingleWorkerRunLauncher
"""

from __future__ import annotations

from dagster._core.errors import DagsterUserCodeUnreachableError
from dagster._core.launcher import DefaultRunLauncher, LaunchRunContext
from dagster._core.remote_representation.code_location import GrpcServerCodeLocation
from dagster._core.storage.tags import GRPC_INFO_TAG
from dagster._grpc.types import CanCancelExecutionRequest, CanCancelExecutionResult
from dagster._serdes import deserialize_value

#: What the run's log says when a launch finds the worker of an earlier call running.
ALREADY_RUNNING = "the code server holds a worker for this run"


class SingleWorkerRunLauncher(DefaultRunLauncher):
    """``DefaultRunLauncher`` that never starts a second worker for one run.

    Example (what ``dagster.yaml`` makes of the config above)::

        >>> from stream_assets.control.run_launcher import SingleWorkerRunLauncher
        >>> isinstance(SingleWorkerRunLauncher(), DefaultRunLauncher)
        True
    """

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        if GRPC_INFO_TAG in run.tags and self._holds_worker(context):
            self._say(context, f"Launched again, but {ALREADY_RUNNING}: not starting another.")
            return
        try:
            self.start_worker(context)
        except DagsterUserCodeUnreachableError:
            if not self._holds_worker(context):
                raise
            self._say(
                context,
                f"The code server's reply timed out, but {ALREADY_RUNNING}: it is launched.",
            )

    def start_worker(self, context: LaunchRunContext) -> None:
        """Ask the code server to start the run's worker (Dagster's own launch)."""
        super().launch_run(context)

    def worker_running(self, context: LaunchRunContext) -> bool:
        """Whether the run's code server holds a worker for it that it was not told to end.

        An unreachable server raises DagsterUserCodeUnreachableError.
        """
        origin = context.dagster_run.remote_job_origin
        if context.workspace is None or origin is None:
            return False
        location = context.workspace.get_code_location(
            origin.repository_origin.code_location_origin.location_name
        )
        if not isinstance(location, GrpcServerCodeLocation):
            return False
        request = CanCancelExecutionRequest(run_id=context.dagster_run.run_id)
        reply = location.client.can_cancel_execution(request)
        return deserialize_value(reply, CanCancelExecutionResult).can_cancel

    def _holds_worker(self, context: LaunchRunContext) -> bool:
        try:
            return self.worker_running(context)
        except DagsterUserCodeUnreachableError:
            return False  # not known to run: the caller launches, or lets the queue retry

    def _say(self, context: LaunchRunContext, message: str) -> None:
        self._instance.report_engine_event(message, context.dagster_run, cls=self.__class__)
