"""What a failed stage query tells an operator: the engine's own sentence, not Spark's trace.

An error raised in a Python task reaches the driver as a Py4J error whose text
is Spark's Java stack trace wrapped around the task's Python traceback --
thousands of characters, with the one sentence that says what to do (an outage
past its budget, a fenced generation) on a line near the end. An error of this
project's own is written for operators, so that line is the message; anything
else (a bug in user code) keeps the whole text, whose traceback is the help.

Example::

    >>> text = ("py4j.protocol.Py4JJavaError: An error occurred\\n  at org.apache...\\n"
    ...         "stream_assets.rocketmq.errors.BrokerOutageError: stage 0: the broker was "
    ...         "unavailable for 130 s\\n\\tat org.apache.spark...")
    >>> failure_message(text)
    'stage 0: the broker was unavailable for 130 s (BrokerOutageError)'
    >>> failure_message("ValueError: bad input") == "ValueError: bad input"
    True
"""

from __future__ import annotations

import re

#: The last line of a Python traceback whose error is one of this project's.
_OURS = re.compile(r"^stream_assets\.[\w.]*?\.(\w+): (.+)$", re.MULTILINE)


def failure_message(exc: object) -> str:
    """The sentence of the last error of this project's in ``exc``'s text, else all of it."""
    text = str(exc)
    found = _OURS.findall(text)
    if not found:
        return text
    name, sentence = found[-1]
    return f"{sentence.strip()} ({name})"
