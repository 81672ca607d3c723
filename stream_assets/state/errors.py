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
