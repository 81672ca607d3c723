"""``RocksDBStateStoreResource``: where instances keep RocksDB state, as a Dagster resource.

The root directory defaults to the engine's (``STREAM_ASSETS_ENGINE_STATE_DIR``,
else ``.local/state``), resolved when used rather than when the Definitions
load, so the UI's config schema never bakes in one machine's path. Besides
handing the root to the engine, the resource opens single queue stores (for
inspection and restore) and reports state size per queue for the UI.

Example::

    >>> store = RocksDBStateStoreResource(root_dir="/tmp/state")
    >>> engine = store.with_state_dir(EngineSettings())
    >>> str(engine.resolved_state_dir())
    '/tmp/state'
    >>> [s.queue_id for s in store.queue_stats("wordcount")]  # doctest: +SKIP
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
from pydantic import Field

from stream_assets.settings import EngineSettings
from stream_assets.state.errors import StateLockedError
from stream_assets.state.store import QueueStateStore

_QUEUE_DIR = re.compile(r"^queue-(\d+)$")


@dataclass(frozen=True)
class QueueStateStats:
    """The local state of one operator on one queue.

    ``keys`` and ``seq`` are None when the store could not be opened because a
    running task holds its RocksDB lock (or ``count_keys=False``).
    """

    job_id: str
    operator_id: str
    queue_id: int
    size_bytes: int
    keys: int | None
    seq: int | None


class RocksDBStateStoreResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """RocksDB state root and write options."""

    root_dir: str | None = Field(
        default=None,
        description="RocksDB root; unset = STREAM_ASSETS_ENGINE_STATE_DIR, else .local/state.",
    )
    sync: bool = Field(
        default=False,
        description=(
            "fsync the WAL on every commit (survives power loss, not only a killed process); "
            "off by default because the state topic already covers lost local state."
        ),
    )

    def root(self) -> Path:
        """The resolved state root."""
        if self.root_dir:
            return Path(self.root_dir).expanduser()
        return EngineSettings().resolved_state_dir()

    def with_state_dir(self, engine: EngineSettings) -> EngineSettings:
        """``engine`` with this resource's root as its ``state_dir``.

        Example::

            >>> spark, store = SparkResource(), RocksDBStateStoreResource()  # doctest: +SKIP
            >>> engine = store.with_state_dir(spark.engine_settings())  # doctest: +SKIP
            >>> Instance(topology, engine=engine)  # doctest: +SKIP
        """
        return engine.model_copy(update={"state_dir": self.root()})

    def store(self, job_id: str, operator_id: str, queue_id: int) -> QueueStateStore:
        """An unopened store for one queue (use it as a context manager)."""
        return QueueStateStore(self.root(), job_id, operator_id, queue_id, sync=self.sync)

    @contextmanager
    def open_store(self, job_id: str, operator_id: str, queue_id: int) -> Iterator[QueueStateStore]:
        """An opened store for one queue, closed on exit.

        RocksDB locks a database to one process: this fails while an instance's
        task has the same queue open, so use it on queues nobody runs.

        Example::

            >>> with resource.open_store("wordcount", "aggregate-3", 2) as s:  # doctest: +SKIP
            ...     s.key_count()
        """
        with self.store(job_id, operator_id, queue_id) as store:
            yield store

    def queue_stats(self, job_id: str, count_keys: bool = True) -> list[QueueStateStats]:
        """Size (and key count, when the store is free) of every local queue store of a job.

        Sorted by operator and queue. Key counting scans the keys, so pass
        ``count_keys=False`` for frequent polling of large states.
        """
        job_dir = self.root() / job_id
        if not job_dir.is_dir():
            return []
        out: list[QueueStateStats] = []
        for op_dir in sorted(p for p in job_dir.iterdir() if p.is_dir()):
            queue_ids = sorted(
                int(m.group(1))
                for p in op_dir.iterdir()
                if p.is_dir() and (m := _QUEUE_DIR.match(p.name))
            )
            for queue_id in queue_ids:
                out.append(self._stats(job_id, op_dir.name, queue_id, count_keys))
        return out

    def _stats(
        self, job_id: str, operator_id: str, queue_id: int, count_keys: bool
    ) -> QueueStateStats:
        store = self.store(job_id, operator_id, queue_id)
        keys: int | None = None
        seq: int | None = None
        if count_keys:
            try:
                # Without waiting: a running instance keeps its stores open, and a
                # look at the stats must not ask it to hand them over.
                store.open(wait_s=0)
            except StateLockedError:
                pass
            else:
                try:
                    keys, seq = store.key_count(), store.meta.seq
                finally:
                    store.close()
        return QueueStateStats(job_id, operator_id, queue_id, store.size_bytes(), keys, seq)
