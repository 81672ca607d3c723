"""Alerts about a topology, and the user hooks that receive them.

An :class:`Alert` is raised when an instance run of a topology fails (its
process crashed or was killed, the supervisor found it dead or hung, or the
op raised), again, as a ``crash_loop``, when failures come so fast that
the supervisor backs off before relaunching, and as ``dead_letters`` when
records of the topology became dead letters since the previous check (once
per new batch, not once per check). Crash alerts come from the Dagster alert
sensor (jobs/alerts.py), dead-letter alerts from the checks (jobs/checks.py);
each is logged, shown in the UI as a failed asset check (crashes: ERROR on
the topology's asset; dead letters: WARN on its dead-letter topic), and
passed to every hook named in ``STREAM_ASSETS_ALERT_HOOKS`` (comma-separated
``module:function``), each with the :class:`Alert`.

A hook is plain Python: page someone, post to a chat, write a file. It runs
in the Dagster code server at each sensor tick, so keep it short; an error in
one hook is logged and does not stop the others.

Example::

    # my_alerts.py, with STREAM_ASSETS_ALERT_HOOKS=my_alerts:page
    def page(alert):
        requests.post(WEBHOOK, json={"text": alert.describe()})

    >>> alert = Alert("wordcount", 1, "3f2a", "process 4242 on node-1 is gone", crashes=1)
    >>> alert.describe()
    'instance 1 of wordcount failed (run 3f2a): process 4242 on node-1 is gone'
    >>> notify(alert, ["no_such_module:hook"], lambda _error: None)
    ["alert hook 'no_such_module:hook' cannot be imported: No module named 'no_such_module'..."]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

AlertKind = Literal["crash", "crash_loop", "dead_letters", "launch_failed"]


@dataclass(frozen=True)
class Alert:
    """Something an operator should know about a topology (or one of its instances).

    ``instance`` is the instance index, or None for an alert about the whole
    topology (dead letters: any instance may have written them). ``crashes`` is
    the number of failed runs of this instance within the supervisor's crash
    window (``STREAM_ASSETS_CRASH_WINDOW_S``), this one included. ``kind`` is
    ``"crash_loop"`` when the supervisor backs off before relaunching
    (``retry_in_s`` from the failure), ``"crash"`` for another failed run, and
    ``"dead_letters"`` for ``dead_letters`` new dead letters (``message`` says
    where and how many in all), and ``"launch_failed"`` for a run Dagster could
    not launch because its code server did not answer: not a crash, not counted
    in ``crashes``, and the supervisor launches the instance again at once.

    Example::

        >>> print(Alert("wc", 0, "r1", "boom", 3, "crash_loop", 60.0).describe())
        instance 0 of wc is crash-looping: 3 failures in the window; next attempt in 60 s ...
        >>> Alert("wc", None, "", "2 new dead letter(s) in wc__dead-letters (5 in all)", 0,
        ...       "dead_letters", dead_letters=2).describe()
        'wc: 2 new dead letter(s) in wc__dead-letters (5 in all)'
    """

    topology: str
    instance: int | None
    run_id: str
    message: str
    crashes: int
    kind: AlertKind = "crash"
    retry_in_s: float = 0.0
    dead_letters: int = 0

    def describe(self) -> str:
        """One line for logs and chat."""
        if self.kind == "dead_letters":
            return f"{self.topology}: {self.message}"
        if self.kind == "launch_failed":
            return (
                f"instance {self.instance} of {self.topology} could not be launched (run "
                f"{self.run_id}): {self.message}; not a crash, launched again"
            )
        if self.kind == "crash_loop":
            return (
                f"instance {self.instance} of {self.topology} is crash-looping: {self.crashes} "
                f"failures in the window; next attempt in {self.retry_in_s:.0f} s "
                f"(run {self.run_id}): {self.message}"
            )
        return (
            f"instance {self.instance} of {self.topology} failed (run {self.run_id}): "
            f"{self.message}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (for JSON)."""
        return asdict(self)


AlertHook = Callable[[Alert], object]


def load_hook(spec: str) -> AlertHook:
    """The callable named by ``spec`` (``"package.module:function"``).

    Raises ValueError saying what is wrong (format, import, missing or not callable).

    Example::

        >>> load_hook("builtins:print") is print
        True
        >>> load_hook("builtins")
        Traceback (most recent call last):
        ...
        ValueError: alert hook 'builtins' must be 'module:function'
    """
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"alert hook {spec!r} must be 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"alert hook {spec!r} cannot be imported: {exc} (is the module on the code "
            "server's Python path?)"
        ) from exc
    hook = getattr(module, attr, None)
    if hook is None or not callable(hook):
        raise ValueError(f"alert hook {spec!r}: module {module_name!r} has no callable {attr!r}")
    return hook  # type: ignore[no-any-return]


def notify(alert: Alert, hooks: Sequence[str], log_error: Callable[[str], None]) -> list[str]:
    """Call every hook in ``hooks`` with ``alert``; return (and log) the errors.

    One failing hook never keeps the others from running.
    """
    errors: list[str] = []
    for spec in hooks:
        try:
            load_hook(spec)(alert)
        except ValueError as exc:
            errors.append(str(exc))
        except Exception as exc:
            errors.append(f"alert hook {spec!r} raised {type(exc).__name__}: {exc}")
    for error in errors:
        log_error(error)
    return errors
