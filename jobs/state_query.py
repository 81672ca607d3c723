"""The state query job: a key's current aggregate (or a window's), without stopping anything.

Launch it from the Launchpad with, e.g.::

    ops:
      query_state:
        config: {topology: wordcount, key: "the"}

``key_is_json: true`` parses ``key`` as JSON (``42`` is an int, ``["eu", 7]`` a
tuple); ``window: "START,END"`` (epoch ms) asks for one window of a windowed
aggregate, otherwise every open window of the key is returned; ``operator``
names the aggregate when the topology has several.

The op rebuilds the queue that owns the key from the topology's state topic
into a temporary RocksDB (:mod:`stream_assets.control.state_query`): it reads
committed state only, and the running instances are not paused or touched.
It logs the answer and returns it (:class:`~stream_assets.control.state_query.StateAnswer`)
with the value as JSON in the output metadata. A key without state is an
answer too (``found: false``, logged as a warning); a query that cannot be
answered (unknown topology, no state topic yet) fails the run, saying why.

Example::

    >>> from stream_assets.control.state_query import StateAnswer
    >>> result = state_query_job.execute_in_process(
    ...     run_config={"ops": {"query_state": {"config": {"topology": "wordcount",
    ...                                                    "key": "the"}}}},
    ...     resources={"rocketmq": RocketMQResource()})  # doctest: +SKIP
    >>> result.output_for_node("query_state").value  # doctest: +SKIP
    {'count': 1042}
"""

import json

import dagster as dg

from stream_assets.control.state_query import (
    StateAnswer,
    StateQueryError,
    jsonable,
    parse_key,
    parse_window,
    query_state,
)
from stream_assets.resources.rocketmq import RocketMQResource
from stream_assets.rocketmq.errors import RocketMQError

STATE_QUERY_JOB = "state_query_job"


class StateQueryConfig(dg.Config):
    """Which topology, which key (and window, and aggregate) to read."""

    topology: str
    key: str
    key_is_json: bool = False  # parse ``key`` as JSON: 42 is an int, [1, 2] a tuple
    window: str = ""  # "START,END" in epoch ms; empty: every open window of the key
    operator: str = ""  # the aggregate's op id; empty: the topology's only one


@dg.op(name="query_state")
def query_state_op(
    context: dg.OpExecutionContext, config: StateQueryConfig, rocketmq: RocketMQResource
) -> dg.Output[StateAnswer]:
    """Read ``config.key``'s committed state from its state-topic queue; log and return it."""
    try:
        key = parse_key(config.key, as_json=config.key_is_json)
        window = parse_window(config.window) if config.window else None
        answer = query_state(
            config.topology,
            key,
            window=window,
            operator=config.operator or None,
            rocketmq=rocketmq.settings(),
            progress=context.log.info,
        )
    except (StateQueryError, RocketMQError) as exc:
        raise dg.Failure(description=f"state query failed: {exc}. Nothing was changed.") from exc
    if answer.found:
        context.log.info(answer.describe())
    else:
        context.log.warning(
            f"{answer.describe()}: the key was never seen (or, windowed, its windows fired); "
            "check its type (key_is_json for numbers and lists)"
        )
    value = answer.json_value()
    return dg.Output(
        answer,
        metadata={
            "topology": answer.topology,
            "operator": answer.operator,
            "key": dg.MetadataValue.text(json.dumps(jsonable(answer.key), ensure_ascii=False)),
            "found": answer.found,
            # A JSON tree for results and window maps; a scalar (or null) as its JSON text.
            "value": (
                dg.MetadataValue.json(value)
                if isinstance(value, dict | list)
                else dg.MetadataValue.text(json.dumps(value))
            ),
            "state_topic": answer.state_topic,
            "queue": answer.queue_id,
            "seq": answer.seq,
            "read_from": answer.read_from,
            "keys_in_queue": answer.keys_in_queue,
            "seconds": round(answer.seconds, 3),
        },
    )


@dg.job(
    name=STATE_QUERY_JOB,
    description="Read a key's current aggregate from a topology's state topic (no pause).",
)
def state_query_job() -> None:
    """Answer one state query."""
    query_state_op()
