"""An alert hook for the Dagster tests: appends each Alert as a JSON line to a file.

The code server calls it (``STREAM_ASSETS_ALERT_HOOKS=tests.integration._alert_hook:record``);
the file is ``STREAM_ASSETS_TEST_ALERT_FILE``, which the test reads.
"""

from __future__ import annotations

import json
import os

from stream_assets.control.alerts import Alert


def record(alert: Alert) -> None:
    """Append ``alert`` to the test's alert file."""
    with open(os.environ["STREAM_ASSETS_TEST_ALERT_FILE"], "a") as out:
        out.write(json.dumps(alert.to_dict()) + "\n")


def recorded(path: str) -> list[dict[str, object]]:
    """Every alert recorded in ``path`` so far."""
    if not os.path.exists(path):
        return []
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]
