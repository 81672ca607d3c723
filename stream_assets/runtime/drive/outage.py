"""Riding out a broker outage: retry an idempotent step while RocketMQ is unreachable.

A broker restart (or a name server that has not yet re-learnt the routes) makes
every client call fail for a few seconds, and a master's restart on a busy
machine takes minutes. The engine's steps are safe to repeat -- a queue task
commits state, changelog and offset together or not at all, and sends carry
deterministic keys and origins -- so instead of failing the query (and making
Dagster relaunch the whole instance) a running instance repeats the step with
backoff for as long as the outage lasts (:class:`OutagePolicy`), saying what
it waits for: the first retry, then every :data:`REPORT_EVERY_S`, then when
the broker is back.

Example::

    >>> calls = []
    >>> def flaky() -> str:
    ...     calls.append(1)
    ...     if len(calls) < 2:
    ...         raise ConnectionRefusedError("broker restarting")
    ...     return "done"
    >>> ride_out_outage(flaky, policy=OutagePolicy(), what="demo", log=lambda m: None,
    ...                 first_wait_s=0)
    'done'
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from stream_assets.rocketmq.errors import (
    BrokerOutageError,
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


#: Seconds between two "still waiting" lines of one step's outage.
REPORT_EVERY_S = 30.0


@dataclass(frozen=True)
class OutagePolicy:
    """How a running instance waits for an unreachable broker (``EngineSettings``).

    ``budget_s``: None waits as long as the outage lasts; a number fails the
    step after that long (0: at once). ``backoff_max_s``: the longest pause
    between retries. ``status_command``: what the messages tell an operator
    to run.

    >>> OutagePolicy.decode(OutagePolicy(budget_s=None).encode()).budget_s is None
    True
    """

    budget_s: float | None = None
    backoff_max_s: float = 5.0
    status_command: str = "stream-assets broker status"

    def encode(self) -> str:
        """As a string option (Spark data source options are strings)."""
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> OutagePolicy:
        """Read :meth:`encode`'s output."""
        return cls(**json.loads(text))

    def describe_budget(self) -> str:
        """``no budget: it waits as long as it lasts`` or ``budget 120 s``."""
        if self.budget_s is None:
            return "no budget: it waits as long as the outage lasts"
        return f"budget {self.budget_s:.0f} s"


#: No retries: a step outside a running instance (and the unit tests' default).
FAIL_AT_ONCE = OutagePolicy(budget_s=0.0)


def ride_out_outage(
    step: Callable[[], T],
    *,
    policy: OutagePolicy,
    what: str,
    log: Callable[[str], None] = stderr_log,
    first_wait_s: float = 0.5,
) -> T:
    """Run ``step``; while it fails with a transient broker error, retry as ``policy`` says.

    ``step`` must be idempotent. Past a set budget (``budget_s=0``: the first
    failure) a :class:`BrokerOutageError` says how long, the budget, the
    setting and the last error.

    The steps ridden out are a running instance's, on topics that existed when
    it started; a topic without a route there means its broker group is down
    or restarting (not registered with the name server), not that the topic
    was never created. The log and the error say so, instead of asking to
    create the topic.
    """
    budget = math.inf if policy.budget_s is None else policy.budget_s
    reported_at = -math.inf

    def announce(state: RetryCallState) -> None:
        nonlocal reported_at
        waited = state.seconds_since_start or 0.0
        if waited - reported_at < REPORT_EVERY_S:
            return
        reported_at = waited
        exc = state.outcome.exception() if state.outcome else None
        log(
            f"{what}: waiting for the broker, {waited:.0f} s so far "
            f"({policy.describe_budget()}; `{policy.status_command}`): {_outage_cause(exc)}"
        )

    retrying = Retrying(
        retry=retry_if_exception(is_transient),
        stop=stop_after_delay(budget),
        wait=wait_exponential(multiplier=first_wait_s, max=policy.backoff_max_s),
        before_sleep=announce,
        reraise=True,
    )
    began = time.monotonic()
    try:
        result = retrying(step)
    except TRANSIENT as exc:
        waited = time.monotonic() - began
        raise BrokerOutageError(
            what, waited, budget, _outage_cause(exc), policy.status_command
        ) from exc
    if reported_at > -math.inf:
        log(f"{what}: the broker is back after {time.monotonic() - began:.0f} s")
    return result


def _outage_cause(exc: BaseException | None) -> str:
    """What a retry log line says went wrong."""
    if isinstance(exc, TopicNotFoundError):
        return (
            f"the name server {exc.namesrv} has no route for topic {exc.topic!r} now "
            "(its broker group restarting or down, not registered with the name server?)"
        )
    return f"broker unavailable ({exc})"
