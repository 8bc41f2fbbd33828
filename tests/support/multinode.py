"""Running a multi-node test body in a fresh process: Ray reads its settings (loopback single-node mode off, token
auth for every raylet of the local cluster) when it is imported, so the cluster and its driver cannot share the
pytest process."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from vime_engine.runtime.cluster import SINGLE_NODE_SWITCH

REPO = Path(__file__).resolve().parents[2]


def run_module_on_a_local_cluster(module: str, timeout: int) -> str:
    """`python -m module` from the repository with multi-node Ray switched on; its stdout, once it exited 0."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), SINGLE_NODE_SWITCH: "0"}
    run = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run.stdout
