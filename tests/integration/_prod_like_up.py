"""`up` of the production-shaped deployment as a process of its own, for a test to kill.

``python -m tests.integration._prod_like_up '<json>'`` builds the deployment from
``{"settings": {...DeploySettings...}, "dagster_env": {...}}`` as the test's own
ProdLike does, and brings every host up without deploying the topology.
"""

from __future__ import annotations

import json
import sys

from stream_assets.deploy.prod_like import ProdLike
from stream_assets.settings import DeploySettings

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    deployment = ProdLike(
        DeploySettings(**spec["settings"]), progress=print, dagster_env=spec["dagster_env"]
    )
    deployment.up(deploy=False)
