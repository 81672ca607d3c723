"""Where a queue's RocksDB lives on disk: ``<root>/<job id>/<operator id>/queue-<N>``.

The one place that builds and parses the state directory layout. The store
opens its database at :attr:`StoreLocation.path`
(:class:`~stream_assets.state.store.QueueStateStore`); an instance that stops
walks :func:`job_stores` to make its Python workers let go of them
(:mod:`~stream_assets.runtime.drive.store_handles`), and a reset walks it to find
the local stores to wipe (:mod:`~stream_assets.control.reset`). Beside each
database, ``queue-<N>.release`` is where another process asks the store's
holder to close it: outside the database directory, so a wipe keeps it.

Example::

    >>> where = StoreLocation(Path("/state"), "wordcount", "count-3", 2)
    >>> where.path.as_posix(), where.release_request.name
    ('/state/wordcount/count-3/queue-2', 'queue-2.release')
    >>> job_dir(Path("/state"), "wordcount").as_posix()
    '/state/wordcount'
    >>> job_stores(Path("/nonexistent"), "wordcount")
    []
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: A queue's database directory under its operator's; anything else there is not a store.
_QUEUE_DIR = re.compile(r"queue-(\d+)", re.ASCII)


@dataclass(frozen=True)
class StoreLocation:
    """The state directory of one operator on one queue of one job, under ``root``.

    ``job_id`` and ``operator_id`` become directory names, so they must be
    plain ones (no ``/``, not ``.`` or ``..``); ``queue_id`` is the queue's
    index, never negative.

    >>> StoreLocation(Path("/state"), "wc", "a/b", 0)
    Traceback (most recent call last):
    ...
    ValueError: operator_id must be a plain directory name, got 'a/b'
    """

    root: Path
    job_id: str
    operator_id: str
    queue_id: int

    def __post_init__(self) -> None:
        for name, part in (("job_id", self.job_id), ("operator_id", self.operator_id)):
            if not part or "/" in part or part in (".", ".."):
                raise ValueError(f"{name} must be a plain directory name, got {part!r}")
        if self.queue_id < 0:
            raise ValueError(f"queue_id must be >= 0, got {self.queue_id}")

    @property
    def path(self) -> Path:
        """The database directory: ``root/job_id/operator_id/queue-<queue_id>``."""
        return job_dir(self.root, self.job_id) / self.operator_id / f"queue-{self.queue_id}"

    @property
    def release_request(self) -> Path:
        """The file another process leaves to ask the store's holder to close it."""
        path = self.path
        return path.with_name(path.name + ".release")


def job_dir(root: Path, job_id: str) -> Path:
    """The directory holding every store of ``job_id`` under ``root``."""
    return root / job_id


def job_stores(root: Path, job_id: str) -> list[StoreLocation]:
    """Every store directory of ``job_id`` under ``root``, by operator then queue index.

    Only directories named as :class:`StoreLocation` names them count (a
    release request or anything else left there does not).
    """
    jobs = job_dir(root, job_id)
    if not jobs.is_dir():
        return []
    found = []
    for op_dir in (p for p in jobs.iterdir() if p.is_dir()):
        for queue_dir in op_dir.iterdir():
            match = _QUEUE_DIR.fullmatch(queue_dir.name)
            if match and queue_dir.is_dir():
                found.append(StoreLocation(root, job_id, op_dir.name, int(match.group(1))))
    return sorted(found, key=lambda s: (s.operator_id, s.queue_id))
