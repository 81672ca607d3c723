"""The instance's answers to the broker's check-backs of its job's exactly-once sink messages.

Every instance of a job with an exactly-once sink registers the job's sink
producer group (:func:`~stream_assets.plan.names.sink_transaction_group`) with
every master, so the broker may ask any of them about a half message whose
step's owner never ended it. The answer comes from the state queue the
message's ``SA_STEP`` names (:func:`~stream_assets.state.step_fate.step_fate`),
never from memory, so any instance answers alike (docs/notes/transactions.md,
"Design of the exactly-once sink"). The broker asks only after a message's end
window (``END_WINDOW_S``), when its step's owner can no longer end it: from then
on the check-back alone decides it.

- the step's delta has not landed yet: **unknown** (the broker asks again);
- another write holds the step's offset: **rollback** (the step never landed);
- landed: **commit** if no consumer sees it yet; **rollback** if one does (a
  check of a copy whose commit the broker had not yet recorded: the committed
  message stays).

Example::

    >>> checks = start_sink_checks(topology, settings, admin, "wordcount")  # doctest: +SKIP
    >>> checks.close()  # the instance stops  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

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
from stream_assets.state.step_fate import PROPERTY_STEP, StepFate, StepRead, StepTag, step_fate

_log = logging.getLogger(__name__)
#: Settled steps' fates kept per instance (a step's messages are checked together).
_SETTLED_KEPT = 1024


def resolve_from_state(admin: StateTopicAdmin, reader: RangeReader) -> Resolve:
    """A check's answer, from the state queue its message names (see the module doc)."""
    sink_reads = SeenIds(admin, reader)
    # A landed or void step stays so: its other messages' checks need no read.
    settled: collections.OrderedDict[str, StepRead] = collections.OrderedDict()

    def fate(raw: str) -> StepRead:
        if raw in settled:
            settled.move_to_end(raw)
            return settled[raw]
        tag = StepTag.decode(raw)
        read = step_fate(admin, reader, state_queue(admin, tag.state_topic, tag.queue_id), tag)
        if read.fate is not StepFate.PENDING:
            settled[raw] = read
            if len(settled) > _SETTLED_KEPT:
                settled.popitem(last=False)
        return read

    def resolve(check: TransactionCheck) -> Outcome:
        raw = check.properties.get(PROPERTY_STEP)
        if raw is None:  # not an engine step's message: someone else's in our group
            _log.warning("a checked half message names no step (%s)", check.prepared.msg_id)
            return Outcome.UNKNOWN
        read = fate(raw)
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
        # One message per result in a step, and the next step waits for these: any
        # order among them keeps each key's.
        unseen = sink_reads.unseen(queue, step.born_ms, ids)
        return Outcome.COMMIT if p.msg_id in unseen else Outcome.ROLLBACK

    return resolve


@dataclass
class SinkChecks:
    """An instance's answers to the checks: the responder and the reader it answers with."""

    responder: CheckResponder
    reader: QueueReader

    def close(self) -> None:
        """Stop answering (the broker asks the group's other producers) and let go of the
        reader."""
        self.responder.close()
        self.reader.close()


def start_sink_checks(
    topology: Topology, settings: RocketMQSettings, admin: RocketMQAdmin, group: str
) -> SinkChecks | None:
    """Answer the broker's checks of ``topology``'s exactly-once sinks (None: it has none).

    ``group`` names this instance's reader of state and sink queues to the broker.
    """
    if not any(stage.exactly_once_topics for stage in topology.stages):
        return None
    reader = QueueReader(admin, f"{group}-sink-checks")
    resolve = resolve_from_state(admin, reader)
    try:
        responder = CheckResponder(settings, sink_transaction_group(topology.job_id), resolve)
        return SinkChecks(responder.start(), reader)
    except BaseException:
        reader.close()
        raise
