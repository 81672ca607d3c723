"""What a Dagster run logged: its event-log messages and the output it captured.

An instance run's captured stderr is where its Spark JVM writes, so Spark's
console noise (progress bars, Java stack traces) shows there, not in the event
log. :func:`spark_noise` finds that noise in either.

Example::

    >>> messages, captured = run_log(instance, run_id)  # doctest: +SKIP
    >>> spark_noise(messages) + spark_noise(captured)  # doctest: +SKIP
    []
"""

from __future__ import annotations

import re

import dagster as dg

#: A fragment of Spark's console progress bar: ``[Stage 3:====>   (2 + 1) / 4]``.
PROGRESS_BAR = re.compile(r"\[Stage \d+:")
#: A Java stack frame, or the elision line of a cause's frames.
JAVA_FRAME = re.compile(r"^\s+(?:at \S+\(.*\)|\.\.\. \d+ more)\s*$")


def run_log(instance: dg.DagsterInstance, run_id: str) -> tuple[str, str]:
    """The run's event-log messages, and the stdout and stderr it captured (so far)."""
    entries = instance.all_logs(run_id)
    messages = "\n".join(e.message or "" for e in entries)
    manager = instance.compute_log_manager
    captured: list[str] = []
    for entry in entries:
        if entry.dagster_event_type != dg.DagsterEventType.LOGS_CAPTURED:
            continue
        assert entry.dagster_event is not None
        file_key = entry.dagster_event.logs_captured_data.file_key
        data = manager.get_log_data(manager.build_log_key_for_run(run_id, file_key))
        for stream in (data.stdout, data.stderr):
            captured.append((stream or b"").decode(errors="replace"))
    return messages, "\n".join(captured)


def spark_noise(text: str) -> list[str]:
    """The lines of ``text`` that are a progress-bar fragment or a Java stack frame."""
    # "\r": the progress bar redraws its line in place.
    lines = re.split(r"\r\n|\r|\n", text)
    return [line for line in lines if PROGRESS_BAR.search(line) or JAVA_FRAME.match(line)]
