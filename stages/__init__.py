"""Stage entrypoints (`python -m stages.<name>`) and the ML code they share."""

import os

# A stage run without a cluster (no RAY_ADDRESS) starts a private Ray cluster; like the flow's local head it must
# listen on loopback only. Ray reads this switch when it is imported (infra/ray_cluster.py says what it does).
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
