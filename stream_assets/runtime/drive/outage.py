"""Riding out a broker outage: retry an idempotent step while RocketMQ is unreachable.

A broker restart (or a name server that has not yet re-learnt the routes) makes
every client call fail for a few seconds. The engine's steps are safe to repeat
-- a queue task commits state, changelog and offset together or not at all, and
sends carry deterministic keys and origins -- so instead of failing the query
(and making Dagster relaunch the whole instance) a running instance repeats the
step with backoff for up to ``EngineSettings.broker_outage_s``.

Example::

    >>> calls = []
    >>> def flaky() -> str:
    ...     calls.append(1)
    ...     if len(calls) < 2:
    ...         raise ConnectionRefusedError("broker restarting")
    ...     return "done"
    >>> ride_out_outage(flaky, budget_s=5, what="demo", log=lambda m: None, first_wait_s=0)
    'done'
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from stream_assets.rocketmq.errors import (
    BrokerUnreachableError,
    RemotingError,
    SendError,
    TopicNotFoundError,
)

T = TypeVar("T")

#: Errors a restarting broker produces. A topic "not found" is among them: the
#: name server forgets a broker's routes until it registers again. Wrong input
#: (oversize messages, bad values) is not, and fails at once.
TRANSIENT: tuple[type[BaseException], ...] = (
    BrokerUnreachableError,
    TopicNotFoundError,
    SendError,
    RemotingError,
    OSError,
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` looks like an unreachable or restarting broker."""
    return isinstance(exc, TRANSIENT)


def stderr_log(message: str) -> None:
    """Default progress sink inside Spark tasks: the worker's stderr (the driver's log)."""
    print(f"[stream-assets] {message}", file=sys.stderr, flush=True)


def ride_out_outage(
    step: Callable[[], T],
    *,
    budget_s: float,
    what: str,
    log: Callable[[str], None] = stderr_log,
    first_wait_s: float = 0.5,
) -> T:
    """Run ``step``; while it fails with a transient broker error, retry for ``budget_s``.

    ``step`` must be idempotent. The last error is re-raised once the budget is
    spent (``budget_s=0``: the first one).

    The steps ridden out are a running instance's, on topics that existed when
    it started; a topic without a route there means its broker group is down
    or restarting (not registered with the name server), not that the topic
    was never created. The log says so, and a :class:`TopicNotFoundError`
    still raised at the end is the same error for a topic known to have
    existed (:meth:`TopicNotFoundError.route_lost`), which names the
    unreachable broker instead of asking to create the topic.
    """

    def announce(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log(
            f"{what}: {_outage_cause(exc)}; retry {state.attempt_number} "
            f"after {state.seconds_since_start:.1f}s of {budget_s:.0f}s"
        )

    retrying = Retrying(
        retry=retry_if_exception(is_transient),
        stop=stop_after_delay(budget_s),
        wait=wait_exponential(multiplier=first_wait_s, max=5.0),
        before_sleep=announce,
        reraise=True,
    )
    began = time.monotonic()
    try:
        return retrying(step)
    except TopicNotFoundError as exc:
        if exc.existed or type(exc) is not TopicNotFoundError:
            raise  # already says it, or a subclass that knows better
        raise exc.route_lost(time.monotonic() - began) from exc


def _outage_cause(exc: BaseException | None) -> str:
    """What a retry log line says went wrong."""
    if isinstance(exc, TopicNotFoundError):
        return (
            f"the name server {exc.namesrv} has no route for topic {exc.topic!r} now "
            "(its broker group restarting or down, not registered with the name server?)"
        )
    return f"broker unavailable ({exc})"
