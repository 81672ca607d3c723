"""The upgrade job: accept a change of a topology that its start refuses, on purpose.

A start (the supervisor's instance runs, ``start_topology_job``, ``scale_job``)
refuses a topology whose change would lose or misread state, naming the
operator (docs/operating.md, "Upgrading a topology"). With the topology stopped
(``stop_topology_job``, with ``drain: true`` when records in flight must reach
the old version) and the new code location deployed, launch::

    ops:
      upgrade:
        config: {topology: wordcount, drop_state: [counts]}

``dry_run: true`` only logs what the start would do. The job refuses while any
run of the topology is unfinished; otherwise it empties the state of each
operator named (:func:`~stream_assets.control.upgrade.apply_upgrade`) and
records the topology. ``start_topology_job`` then starts it.
"""

import dagster as dg
from pydantic import Field

from stream_assets.control.reset_guard import WRITING_JOBS, active_runs, refusal_message
from stream_assets.control.upgrade import apply_upgrade
from stream_assets.jobs.failures import acting_on, failure
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.resources.state_store import RocksDBStateStoreResource
from stream_assets.rocketmq.admin import RocketMQAdmin
from stream_assets.rocketmq.errors import RocketMQError
from stream_assets.state.errors import StateError

UPGRADE_JOB = "upgrade_job"
assert UPGRADE_JOB in WRITING_JOBS  # a reset or another upgrade finds it by this name

_HOW_TO_STOP = "stop it with stop_topology_job (drain: true keeps what is in flight)"


class UpgradeConfig(dg.Config):
    """Which topology, and the operators whose state may go."""

    topology: str
    drop_state: list[str] = Field(default_factory=list)  # operator names: they start empty
    dry_run: bool = False  # only log what the start would do


@dg.op
def upgrade(
    context: dg.OpExecutionContext,
    config: UpgradeConfig,
    rocketmq: RocketMQResource,
    state_store: RocksDBStateStoreResource,
) -> None:
    """Drop the state of ``config.drop_state`` and record ``config.topology``."""
    reg = acting_on(context, config.topology)
    runs = active_runs(context.instance, config.topology, context.run_id)
    if runs and not config.dry_run:
        raise failure(refusal_message(config.topology, runs, _HOW_TO_STOP))
    try:
        with RocketMQAdmin(rocketmq.settings()) as admin:
            outcome = apply_upgrade(
                reg.topology(),
                admin,
                drop=config.drop_state,
                state_root=state_store.root(),
                say=context.log.info,
                apply=not config.dry_run,
            )
    except (RocketMQError, StateError, ValueError) as exc:
        raise failure(f"{exc}. Nothing more was changed.") from exc
    context.log.info(outcome.describe())
    context.add_output_metadata(
        {
            "dropped": ", ".join(outcome.plan.dropped) or "none",
            "carried": ", ".join(outcome.plan.carried) or "none",
            "state_queues_emptied": outcome.emptied,
            "plan": dg.MetadataValue.md(f"```\n{outcome.plan.describe()}\n```"),
        }
    )


@dg.job(
    name=UPGRADE_JOB,
    description="Accept a change of a stopped topology: drop the state of the operators named.",
)
def upgrade_job() -> None:
    """Upgrade a registered topology."""
    upgrade()
