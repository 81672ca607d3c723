"""A topology's run over lines, as the count path tests compare them: what reached the
sink (the last count per key), the dead letters and the shuffle's messages."""

from __future__ import annotations

from typing import Any

from stream_assets.plan.topology import Topology
from stream_assets.runtime.core.shuffle_codec import decode
from stream_assets.testing import TopologyTestDriver

#: The broker's message limit in these runs: small, so big values and batches meet it.
MAX_MESSAGE = 4096
#: Characters of a value over any shuffle entry under MAX_MESSAGE.
HUGE = 5000


def run_lines(topology: Topology, lines: list[str], batch: int | None) -> dict[str, Any]:
    """Pipe ``lines`` over 2 source queues (3 shuffle queues, batches of ``batch``)."""
    with TopologyTestDriver(
        topology,
        source_queues=2,
        shuffle_queues=3,
        max_records_per_batch=batch,
        max_message_size=MAX_MESSAGE,
    ) as driver:
        for i, line in enumerate(lines):
            driver.pipe(line, event_time=1_000 + (i * 37) % 500, queue=i % 2)
        driver.advance()
        shuffle_topic = topology.stages[1].input_topic
        return {
            "outputs": final_counts(driver.outputs()),
            "dead": sorted(
                (body, props["operator"], props["reason"]) for body, props in driver.dead_letters()
            ),
            "shuffle": sorted(
                (r.queue_id, _canonical(r.body)) for r in driver.output_records(shuffle_topic)
            ),
        }


def final_counts(outputs: list[dict[str, Any]]) -> dict[Any, int]:
    """The last count (field ``n``) per key."""
    last: dict[Any, int] = {}
    for out in outputs:
        last[out["key"]] = out["n"]
    return last


def _canonical(body: bytes) -> str:
    """A shuffle message as text, a combined one's entries sorted (their order is free)."""
    message = decode(body)
    if "comb" in message:
        message["comb"] = sorted(message["comb"], key=repr)
    return repr(sorted(message.items()))
