"""The instance's answers to the broker's check-backs of its job's exactly-once sink messages.

Every instance of a job with an exactly-once sink registers the job's sink
producer group (:func:`~stream_assets.plan.names.sink_transaction_group`) with
every master, so the broker may ask any of them about a half message whose
step's owner never ended it. The answer comes from the state queue the
message's ``SA_STEP`` names (:func:`~stream_assets.state.step_fate.step_fate`),
never from memory, so any instance answers alike (docs/notes/transactions.md,
"Design of the exactly-once sink"):

- the step's delta has not landed yet, or is its queue's latest commit:
  **unknown** (the broker asks again): its owner ends it, or the next owner's
  first commit makes it no longer the latest;
- another write holds the step's offset: **rollback** (the step never landed);
- landed, and a later commit followed: **commit** if no consumer sees it yet
  and every message before it in its sink queue (by the delta's record) is
  seen; **rollback** if it is already seen (a check of a copy whose commit the
  broker had not yet recorded: the committed message stays).

Example::

    >>> checks = start_sink_checks(topology, settings, admin, "wordcount")  # doctest: +SKIP
    >>> checks.close()  # the instance stops  # doctest: +SKIP
"""

from __future__ import annotations

import logging

from stream_assets.plan.names import sink_transaction_group
from stream_assets.plan.topology import Topology
from stream_assets.rocketmq.admin import MessageQueue, RocketMQAdmin
from stream_assets.rocketmq.reader import QueueReader
from stream_assets.rocketmq.transaction_checks import CheckResponder, Resolve, TransactionCheck
from stream_assets.rocketmq.transactions import Outcome
from stream_assets.runtime.core.sink_transactions import TX, SeenIds, StepMessages
from stream_assets.settings import RocketMQSettings
from stream_assets.state.ports import RangeReader, StateTopicAdmin
from stream_assets.state.restore import state_queue
from stream_assets.state.step_fate import PROPERTY_STEP, StepFate, StepTag, step_fate

_log = logging.getLogger(__name__)


def resolve_from_state(admin: StateTopicAdmin, reader: RangeReader) -> Resolve:
    """A check's answer, from the state queue its message names (see the module doc)."""
    sink_reads = SeenIds(admin, reader)

    def resolve(check: TransactionCheck) -> Outcome:
        raw = check.properties.get(PROPERTY_STEP)
        if raw is None:  # not an engine step's message: someone else's in our group
            _log.warning("a checked half message names no step (%s)", check.prepared.msg_id)
            return Outcome.UNKNOWN
        tag = StepTag.decode(raw)
        read = step_fate(admin, reader, state_queue(admin, tag.state_topic, tag.queue_id), tag)
        if read.fate is StepFate.VOID:
            return Outcome.ROLLBACK
        if read.fate is not StepFate.LANDED or read.meta is None or TX not in read.meta.extra:
            return Outcome.UNKNOWN
        step = StepMessages.from_wire(read.meta.extra[TX])
        p = check.prepared
        queue = MessageQueue(p.topic, p.broker_name, p.queue_id)
        ids = step.queues.get(queue, [])
        if p.msg_id not in ids:
            return Outcome.UNKNOWN  # not the step's: the state queue cannot say
        unseen = sink_reads.unseen(queue, step.born_ms, ids)
        if p.msg_id not in unseen:
            return Outcome.ROLLBACK
        # The queue's order: an earlier message of it first (its check commits it).
        return Outcome.COMMIT if unseen[0] == p.msg_id else Outcome.UNKNOWN

    return resolve


def start_sink_checks(
    topology: Topology, settings: RocketMQSettings, admin: RocketMQAdmin, group: str
) -> CheckResponder | None:
    """Answer the broker's checks of ``topology``'s exactly-once sinks (None: it has none).

    ``group`` names this instance's reader of state and sink queues to the broker.
    """
    if not any(stage.exactly_once_topics for stage in topology.stages):
        return None
    reader = QueueReader(admin, f"{group}-sink-checks")
    resolve = resolve_from_state(admin, reader)
    return CheckResponder(settings, sink_transaction_group(topology.job_id), resolve).start()
