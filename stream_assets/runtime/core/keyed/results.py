"""What a keyed stage's batch produces, and the names results go by.

A result is ``(origin, value, event time, key)``. Its origin, the part of the
sink message keys that tells copies from new results, is the same for a
replayed copy and different for a new result: a window's bounds and key, a
stream record's origin for a table join, a processor's input origin and emit
index, and for an unwindowed key its version (:func:`versioned`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stream_assets.plan import nodes as n
from stream_assets.runtime.core.stage0.chain import UserFunctionError
from stream_assets.windows import Window

#: A result: (origin for message keys, as key parts; value; event time; key).
Result = tuple[tuple[str, ...], Any, int, Any]


@dataclass(slots=True)
class Finish:
    """An aggregate's result still to compute, at emit: its accumulator's ``result``
    may be the user's code, and a failure there is that result's dead letter.

    Not frozen: one is made per result, and a frozen dataclass's ``__init__`` cost
    four times as much; nothing changes one after it is made."""

    head: n.Aggregate
    key: Any
    acc: Any
    window: Window | None
    #: With early results on: whether this result closes its window (None: off).
    final: bool | None = None

    def value(self) -> dict[str, Any]:
        """``{"key": ..., <alias>: ..., ["window_start", "window_end"], ["final"]}``."""
        out = {"key": self.key, **self.head.accumulator.result(self.acc)}
        if self.window is not None:
            out["window_start"], out["window_end"] = self.window.start, self.window.end
        if self.final is not None:
            out["final"] = self.final
        return out


@dataclass(frozen=True)
class Expired:
    """A deletion: an unwindowed aggregate's key whose TTL expired (a tombstone).

    It carries the key's next version like an update, so a consumer that keeps
    the highest version per result key forgets the key too. It bypasses the
    stage's user functions (a ``map`` written for results would fail on it) and
    reaches every sink and print downstream of the aggregate in this stage.

    >>> Expired("apple").value()
    {'key': 'apple', 'expired': True}
    """

    key: Any

    def value(self) -> dict[str, Any]:
        """What the sinks get: ``{"key": ..., "expired": True}``, in the sink's serializer."""
        return {"key": self.key, "expired": True}


@dataclass(frozen=True)
class Joined:
    """A pair to join: the joiner runs where user functions run (and may fail), at emit."""

    head: n.Join | n.TableJoin
    left: Any
    right: Any


def computed(head: n.Stateful, value: Any) -> Any:
    """The value of a result, running the user function that finishes it (if any)."""
    if not isinstance(value, Finish | Joined):
        return value
    try:
        if isinstance(value, Finish):
            return value.value()
        return value.head.joiner(value.left, value.right)
    except Exception as exc:
        raise UserFunctionError(head.op_id, exc) from exc


def shown_result(value: Any) -> Any:
    """What a result's dead letter shows: the value, or what it was to be made of."""
    if isinstance(value, Joined):
        return [value.left, value.right]
    if isinstance(value, Finish):
        return {"key": value.key, "accumulator": value.acc}
    if isinstance(value, Expired):
        return value.value()
    return value


def result_key(key: Any) -> str:
    """A grouping key as text (message keys, sink routing): itself, or its JSON.

    >>> result_key("new york"), result_key(("eu", 7)), result_key({("a",): 1})
    ('new york', '["eu", 7]', "{('a',): 1}")
    """
    if isinstance(key, str):
        return key
    try:
        return json.dumps(key, default=str)
    except (TypeError, ValueError):  # JSON has no such map key (a tuple, bytes)
        return repr(key)


def versioned(key: Any, seq: int) -> tuple[str, str]:
    """An updating result's origin: its result key and version, ``<result key>/v<seq>``.

    Every update of an unwindowed key (or an open window's early result) is a
    new result, so the result key alone would give every update the same
    message key and a consumer that drops repeats would drop real updates. The
    version is the seq of the commit that emits the update: a key changes at
    most once per batch, so a new update always gets a new, higher version; a
    batch replayed from the same state (a crash before its commit) has the same
    seq and its copies the same keys; the seq lives in the committed meta, so a
    restore on another executor keeps counting, and a reset's empty snapshot
    carries a seq above everything ever written, so recomputed results are
    newer than the old ones. No state key is added, so state written before
    versions existed needs no conversion.

    Two key parts, so that shortening a long result key
    (:func:`~stream_assets.runtime.core.stage0.outputs.message_key`) keeps the version
    readable: the message key is ``.../<result key>/v<seq>/<n>`` either way.

    >>> versioned("new york", 7), versioned(["eu", 7], 12)
    (('new york', 'v7'), ('["eu", 7]', 'v12'))
    """
    return (result_key(key), f"v{seq}")
