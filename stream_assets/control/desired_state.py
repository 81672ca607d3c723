"""Durable control-plane state in the Dagster instance's own storage, not in process memory.

Two things must outlive any one run, sensor tick or code-server restart:

- each topology's **desired state**: how many instances it should have and the
  current :class:`~stream_assets.control.allocation.Allocation` (which queues each
  instance owns, under which generation); the scale job writes it, the
  supervisor sensor reads it;
- each running instance's **heartbeat**: Dagster's default run launcher never
  notices a run whose process was killed (the run stays STARTED), so instance
  runs report liveness here and the supervisor compares ages.

Both live in the run storage's key-value table (``kvs``; the same table the
daemons keep their cursors in), via ``DaemonCursorStorage.get_cursor_values`` /
``set_cursor_values``: present on every run storage (SQLite, Postgres, MySQL,
in-memory). So whatever database the deployment's Dagster uses is where this
state is, with no extra service.

Example::

    >>> store = DesiredStateStore(context.instance)  # doctest: +SKIP
    >>> store.set("wordcount", DesiredState(2, allocate(queues, 2)))  # doctest: +SKIP
    >>> store.get("wordcount").target_instances  # doctest: +SKIP
    2
"""

import hashlib
import json
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from sqlalchemy.exc import OperationalError
from tenacity import (
    retry,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from stream_assets.control.allocation import Allocation
from stream_assets.runtime.drive.broker_watch import describe_waiting

#: Every key this module writes starts with this, apart from the daemons' own keys.
KEY_PREFIX = "stream_assets/"

#: MySQL's unique index on kvs.key covers only the first 64 characters
#: (``idx_kvs_keys_unique``, ``mysql_length=64``); longer keys are shortened
#: with a digest so two of them can never collide there.
_MAX_KEY = 64

_FORMAT = 1  # version of the stored JSON documents


def _key(kind: str, name: str) -> str:
    key = f"{KEY_PREFIX}{kind}/{name}"
    if len(key) <= _MAX_KEY:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return f"{key[: _MAX_KEY - len(digest) - 1]}#{digest}"


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) and "locked" in str(exc.orig)


#: SQLite (the default local storage) refuses a write while another thread or process
#: holds its lock ("database is locked", in memory "database table is locked"): a
#: sensor tick, a heartbeat and a stop job meet there on a busy machine. The lock is
#: held for a statement, so waiting is the fix; a stop must not fail of it.
_while_locked = retry(
    retry=retry_if_exception(_locked),
    wait=wait_exponential(multiplier=0.02, max=1.0),
    stop=stop_after_delay(60),
    reraise=True,
)


@_while_locked
def _read(instance: dg.DagsterInstance, keys: Iterable[str]) -> Mapping[str, str]:
    wanted = set(keys)
    return instance.daemon_cursor_storage.get_cursor_values(wanted) if wanted else {}


@_while_locked
def _write(instance: dg.DagsterInstance, key: str, value: str) -> None:
    # One pair per call: SqlRunStorage.set_cursor_values inserts all pairs and,
    # on an integrity error (any key exists), only *updates*, so in a mixed
    # batch the new keys would be dropped silently.
    instance.daemon_cursor_storage.set_cursor_values({key: value})


#: Phases of a rebalance in place (see jobs/scale.py): instances of the new
#: allocation warm up, then every instance whose queues change releases them,
#: then all run the new allocation.
PHASES = ("run", "warm", "release")


@dataclass(frozen=True)
class DesiredState:
    """What a topology's group should look like: ``target_instances`` and their queues.

    ``allocation`` is None before the first scale (nothing allocated yet).
    ``target_instances`` 0 is a stopped topology: no instance runs, state and
    offsets stay where they are, and a later scale resumes exactly.
    ``paused`` is set while a job (reset) must keep the supervisor away: it
    then leaves the topology alone. ``phase`` is the step of a rebalance in
    place the scale job has reached for ``allocation`` (``"run"`` when none
    is under way). ``drain`` (with ``target_instances`` 0): the instances
    stop reading the sources and exit only once every shuffle topic is consumed.

    Example::

        >>> DesiredState(2).to_json()
        '{"allocation":null,"format":1,"paused":false,"phase":"run","target_instances":2}'
    """

    target_instances: int
    allocation: Allocation | None = None
    paused: bool = False
    phase: str = "run"
    drain: bool = False

    def __post_init__(self) -> None:
        if self.target_instances < 0:
            raise ValueError(f"target_instances must be >= 0, got {self.target_instances}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        # Frozen dataclass with a dict inside (the allocation): not hashable.

    __hash__ = None  # type: ignore[assignment]

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(
            {
                "format": _FORMAT,
                "target_instances": self.target_instances,
                "allocation": None if self.allocation is None else self.allocation.to_dict(),
                "paused": self.paused,
                "phase": self.phase,
                # Only when set: what earlier releases wrote reads back unchanged.
                **({"drain": True} if self.drain else {}),
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> "DesiredState":
        """Parse :meth:`to_json` output."""
        data = json.loads(text)
        if data.get("format") != _FORMAT:
            raise ValueError(f"unknown desired-state format {data.get('format')!r}")
        raw = data.get("allocation")
        return cls(
            target_instances=int(data["target_instances"]),
            allocation=None if raw is None else Allocation.from_dict(raw),
            paused=bool(data.get("paused", False)),
            phase=str(data.get("phase", "run")),
            drain=bool(data.get("drain", False)),
        )


class DesiredStateStore:
    """Desired state per topology (``job_id``), in ``instance``'s run storage.

    Last writer wins (the storage has no compare-and-set): let one writer, the
    scale job, own a topology's desired state at a time (e.g. a run queue tag
    concurrency limit of 1 per topology on the scale job).

    Example::

        >>> store = DesiredStateStore(dg.DagsterInstance.ephemeral())
        >>> store.get("wordcount") is None
        True
        >>> store.set("wordcount", DesiredState(3))
        >>> store.get("wordcount")
        DesiredState(target_instances=3, allocation=None, paused=False, phase='run', drain=False)
    """

    def __init__(self, instance: dg.DagsterInstance) -> None:
        self.instance = instance

    @staticmethod
    def key(job_id: str) -> str:
        """The kvs key of ``job_id``'s desired state."""
        return _key("desired", job_id)

    def get(self, job_id: str) -> DesiredState | None:
        """The stored desired state of ``job_id``, or None if never set."""
        key = self.key(job_id)
        raw = _read(self.instance, [key]).get(key)
        return None if raw is None else DesiredState.from_json(raw)

    def get_many(self, job_ids: Iterable[str]) -> dict[str, DesiredState]:
        """Desired states of several topologies in one query (missing ones left out)."""
        keys = {self.key(j): j for j in job_ids}
        raw = _read(self.instance, keys)
        return {keys[k]: DesiredState.from_json(v) for k, v in raw.items()}

    def set(self, job_id: str, state: DesiredState) -> None:
        """Store ``state`` as ``job_id``'s desired state (replacing any previous)."""
        _write(self.instance, self.key(job_id), state.to_json())


@dataclass(frozen=True)
class Heartbeat:
    """One instance run's latest sign of life.

    ``lag`` is optional per-topic lag the instance measured itself, so the
    supervisor can report it without asking the broker.
    """

    job_id: str
    generation: int
    instance_index: int
    run_id: str
    ts: float
    lag: dict[str, int] = field(default_factory=dict)
    pid: int = 0  # the run's process: liveness beside the heartbeat, and what to terminate
    host: str = ""  # where ``pid`` lives
    #: Rebalance in place: the latest generation this run has warmed up for,
    #: released its changed queues for (and when; 0 when it had none to
    #: release), and runs (since when).
    warmed: int = -1
    released: int = -1
    released_at: float = 0.0
    running: int = -1
    running_at: float = 0.0
    #: Progress, beside liveness (the beat itself comes from a thread of its own):
    #: when the run loop last went round (0: unknown), the long step it is in
    #: ("" when none) and since when, when a micro-batch last completed (0: none yet).
    loop_at: float = 0.0
    busy: str = ""
    busy_since: float = 0.0
    batch_at: float = 0.0
    #: Draining for a stop: this run no longer reads the sources.
    draining: bool = False
    #: Broker groups this run waits for (no master answers), and since when (epoch s):
    #: alive and waiting, not stalled -- its steps resume when the group is back.
    waiting: dict[str, float] = field(default_factory=dict)

    __hash__ = None  # type: ignore[assignment]

    def age(self, now: float | None = None) -> float:
        """Seconds since this heartbeat (``now`` defaults to ``time.time()``)."""
        return (time.time() if now is None else now) - self.ts

    def stalled_s(self, now: float | None = None) -> float:
        """Seconds since the run loop last went round (0 when the beat does not say).

        Example::

            >>> Heartbeat("wc", 1, 0, "r", ts=100.0, loop_at=40.0).stalled_s(now=100.0)
            60.0
        """
        if self.loop_at <= 0:
            return 0.0
        return max(0.0, (time.time() if now is None else now) - self.loop_at)

    def activity(self, now: float | None = None) -> str:
        """What the run is busy with or waits for, and for how long; "" when nothing.

        Example::

            >>> Heartbeat("wc", 1, 0, "r", ts=0.0, busy="starting", busy_since=5.0).activity(50.0)
            'starting (for 45 s)'
            >>> Heartbeat("wc", 1, 0, "r", ts=0.0, waiting={"broker-b": 20.0}).activity(50.0)
            'waiting for broker group broker-b: no master answers, for 30 s'
        """
        at = time.time() if now is None else now
        parts = [f"{self.busy} (for {at - self.busy_since:.0f} s)"] if self.busy else []
        if self.waiting:
            parts.append(f"waiting for {describe_waiting(self.waiting, at)}")
        return "; ".join(parts)

    def to_json(self) -> str:
        """The stored form."""
        data: dict[str, Any] = {
            "format": _FORMAT,
            "job_id": self.job_id,
            "generation": self.generation,
            "instance_index": self.instance_index,
            "run_id": self.run_id,
            "ts": self.ts,
            "lag": dict(self.lag),
            "pid": self.pid,
            "host": self.host,
            "warmed": self.warmed,
            "released": self.released,
            "released_at": self.released_at,
            "running": self.running,
            "running_at": self.running_at,
            "loop_at": self.loop_at,
            "busy": self.busy,
            "busy_since": self.busy_since,
            "batch_at": self.batch_at,
            "draining": self.draining,
            "waiting": dict(self.waiting),
        }
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Heartbeat":
        """Parse :meth:`to_json` output."""
        data = json.loads(text)
        return cls(
            job_id=str(data["job_id"]),
            generation=int(data["generation"]),
            instance_index=int(data["instance_index"]),
            run_id=str(data["run_id"]),
            ts=float(data["ts"]),
            lag={str(k): int(v) for k, v in data.get("lag", {}).items()},
            pid=int(data.get("pid", 0)),
            host=str(data.get("host", "")),
            warmed=int(data.get("warmed", -1)),
            released=int(data.get("released", -1)),
            released_at=float(data.get("released_at", 0.0)),
            running=int(data.get("running", -1)),
            running_at=float(data.get("running_at", 0.0)),
            loop_at=float(data.get("loop_at", 0.0)),
            busy=str(data.get("busy", "")),
            busy_since=float(data.get("busy_since", 0.0)),
            batch_at=float(data.get("batch_at", 0.0)),
            draining=bool(data.get("draining", False)),
            waiting={str(k): float(v) for k, v in data.get("waiting", {}).items()},
        )


def heartbeat_key(run_id: str) -> str:
    """The kvs key of a run's heartbeat."""
    return _key("hb", run_id)


def record_heartbeat(
    instance: dg.DagsterInstance,
    job_id: str,
    generation: int,
    instance_index: int,
    run_id: str,
    ts: float | None = None,
    lag: Mapping[str, int] | None = None,
    *,
    warmed: int = -1,
    released: int = -1,
    released_at: float = 0.0,
    running: int = -1,
    running_at: float = 0.0,
    loop_at: float = 0.0,
    busy: str = "",
    busy_since: float = 0.0,
    batch_at: float = 0.0,
    draining: bool = False,
    waiting: Mapping[str, float] | None = None,
) -> Heartbeat:
    """Record that run ``run_id`` (instance ``instance_index`` of ``job_id``) is alive.

    Keyed by run id, not by instance index: a run presumed dead that is in
    fact still writing can then never overwrite the heartbeat of the run that
    replaced it, and the supervisor looks heartbeats up for exactly the runs
    it lists (``heartbeats(instance, [r.run_id for r in runs])``).

    Example::

        >>> inst = dg.DagsterInstance.ephemeral()
        >>> record_heartbeat(inst, "wordcount", 1, 0, "run-a", ts=100.0).age(now=104.5)
        4.5
    """
    beat = Heartbeat(
        job_id=job_id,
        generation=generation,
        instance_index=instance_index,
        run_id=run_id,
        ts=time.time() if ts is None else ts,
        lag=dict(lag or {}),
        pid=os.getpid(),
        host=socket.gethostname(),
        warmed=warmed,
        released=released,
        released_at=released_at,
        running=running,
        running_at=running_at,
        loop_at=loop_at,
        busy=busy,
        busy_since=busy_since,
        batch_at=batch_at,
        draining=draining,
        waiting=dict(waiting or {}),
    )
    _write(instance, heartbeat_key(run_id), beat.to_json())
    return beat


def heartbeats(instance: dg.DagsterInstance, run_ids: Iterable[str]) -> dict[str, Heartbeat]:
    """The latest heartbeat of each run in ``run_ids`` that ever sent one, by run id.

    A run missing from the result has not beaten yet: judge it by its start
    time (``instance.get_run_record_by_id(run_id).start_time``) instead.

    Example::

        >>> inst = dg.DagsterInstance.ephemeral()
        >>> _ = record_heartbeat(inst, "wordcount", 1, 0, "run-a", ts=1.0)
        >>> sorted(heartbeats(inst, ["run-a", "run-b"]))
        ['run-a']
    """
    keys = {heartbeat_key(r): r for r in run_ids}
    raw = _read(instance, keys)
    return {keys[k]: Heartbeat.from_json(v) for k, v in raw.items()}
