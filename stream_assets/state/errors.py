"""Errors of the state layer: each says what was wrong and what to do."""

from __future__ import annotations


class StateError(Exception):
    """Base class of every error raised by :mod:`stream_assets.state`."""


class StateFormatError(StateError):
    """Stored meta or a changelog record could not be decoded."""


class StateSequenceError(StateError):
    """A commit's sequence number does not follow the store's (stale meta or two writers)."""


class StateRestoreError(StateError):
    """The state topic cannot rebuild the queue's state (history missing or inconsistent)."""


class ChangelogConflictError(StateError):
    """A changelog record did not land where its writer expected: someone else appended.

    The record is void (a restore ignores it) and nothing was committed
    locally; the caller fails the batch, and the next attempt restores from
    the state topic before it writes again.
    """


class FencedError(StateError):
    """A writer of an older allocation generation found a newer owner in the state topic."""


class StateLockedError(StateError):
    """Another process holds a store's RocksDB lock and did not release it in time."""
