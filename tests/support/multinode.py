"""Multi-node test bodies on one local multi-node Ray cluster in a fresh process.

Ray reads its settings (loopback single-node mode off, token auth for every raylet of the local cluster) when it is
imported, so the cluster and its driver cannot share the pytest process. Starting that process and its cluster
costs more than most bodies, so every test module of the session that asks for `multinode_checks` has its body
(`multinode_check(model, output)`, on a cluster of the most `NODES` any of them needs, one CPU a node) run in one
such process, one body after the other; a body that fails is reported with its traceback and the next still runs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import secrets
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from vime_engine.runtime.cluster import SINGLE_NODE_SWITCH

REPO = Path(__file__).resolve().parents[2]


def run_checks_on_a_local_cluster(modules: list[str], nodes: int, timeout: int) -> dict[str, str]:
    """Each module's `multinode_check` on one fresh cluster of `nodes` raylets: module -> what the body printed,
    or its traceback after a line `FAILED`."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), SINGLE_NODE_SWITCH: "0"}
    with tempfile.TemporaryDirectory(prefix="vimeflow-multinode-") as scratch:
        report = Path(scratch) / "report.json"
        run = subprocess.run([sys.executable, "-m", __name__, str(report), str(nodes), *modules], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=timeout)
        assert report.is_file(), run.stdout[-3000:] + run.stderr[-5000:]  # the cluster itself failed
        return json.loads(report.read_text())


def _run_checks(report: Path, nodes: int, modules: list[str]) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from vime_engine.models.builtin import materialize_builtin_model

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
    outcomes = {}
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        root = Path(tempfile.mkdtemp())
        model = materialize_builtin_model("tiny-qwen3", root / "model")
        for module in modules:
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    importlib.import_module(module).multinode_check(model, root / module)
                outcomes[module] = printed.getvalue()
            except Exception:  # noqa: BLE001  (reported to the module's test; the next body still runs)
                outcomes[module] = f"{printed.getvalue()}FAILED\n{traceback.format_exc()}"
    finally:
        ray.shutdown()
        cluster.shutdown()
    report.write_text(json.dumps(outcomes))


if __name__ == "__main__":
    _run_checks(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
