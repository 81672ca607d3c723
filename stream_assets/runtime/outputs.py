"""Terminal outputs of a stage: sinks (RocketMQ topics) and print.

Sinks are at-least-once: a batch replayed after a crash sends its outputs
again. Every output message therefore has a deterministic key (job, origin or
result key, position) so consumers can de-duplicate.
"""

from __future__ import annotations

import sys
from typing import Any

from stream_assets.plan import nodes as n
from stream_assets.runtime.task_context import TaskContext, TaskStats


class StageOutputs:
    """Sends a stage's sink/print outputs; ``origin`` names what produced them."""

    def __init__(self, ctx: TaskContext, stats: TaskStats) -> None:
        self.ctx = ctx
        self.stats = stats
        self.origin = ""
        self._seq = 0
        self._last_origin = ""

    def emit(self, node: n.Node, value: Any, ts: int) -> None:
        """An output of the chain fed by ``origin`` (a source record or a result key)."""
        if self.origin != self._last_origin:
            self._last_origin, self._seq = self.origin, 0
        key = f"{self.ctx.job_id}/{node.op_id}/{self.origin}/{self._seq}"
        self._seq += 1
        if isinstance(node, n.Sink):
            self.ctx.producer().send(node.topic, node.serializer(value), key=key)
        elif isinstance(node, n.Print):
            print(value, file=sys.stdout, flush=False)
        self.stats.outputs += 1

    def flush(self) -> None:
        """Flush printed output."""
        sys.stdout.flush()
