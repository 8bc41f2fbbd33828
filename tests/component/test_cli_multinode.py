"""`vimeflow train --ray-address` from a process of its own, as a user joins a cluster somebody else started: the
shared loopback multi-node cluster (raylets on 127.0.0.1, token auth; tests.support.multinode) is joined by a
separate `vimeflow train`, whose environment lacks Ray's loopback switch, so the command must set it itself; and an
address where nothing listens fails within 30 s with exit 3 and what to check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.ports import free_port
from vime_engine.runtime.cluster import SINGLE_NODE_SWITCH

REPO = Path(__file__).resolve().parents[2]
NODES = 2  # the trainer rank and the engine, one CPU "device" a node
TINY_RUN = ["--prompt-data", "builtin://arithmetic", "--input-key", "question", "--label-key", "answer",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
            "--vllm-kv-cache-gb", "0.25", "--num-rollout", "1"]


def _vimeflow(args: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_separate_vimeflow_train_joins_the_loopback_cluster(multinode_checks):
    printed = multinode_checks[Path(__file__).stem]
    assert "joined the loopback cluster and trained" in printed, printed


def multinode_check(model: Path, output: Path) -> None:
    import ray

    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:"), address
    env = {k: v for k, v in os.environ.items() if k != SINGLE_NODE_SWITCH}
    run = _vimeflow(["--hf-checkpoint", str(model), *TINY_RUN, "--ray-address", address,
                     "--output-dir", str(output / "out")], env, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    [record] = [json.loads(line) for line in (output / "out" / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout_id"] == 0
    print("joined the loopback cluster and trained")


def test_an_address_where_nothing_listens_fails_within_30_s_naming_it(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    run = _vimeflow(["--hf-checkpoint", "builtin://tiny-qwen3", *TINY_RUN, "--ray-address", address,
                     "--output-dir", str(tmp_path / "out")], dict(os.environ), timeout=120)
    assert time.monotonic() - started <= 30
    assert run.returncode == 3, run.stderr
    assert "Traceback" not in run.stderr
    message = run.stderr[run.stderr.index("error:"):]
    for part in (f"--ray-address {address}", "nothing answers", "the head is running", "RAY_AUTH_TOKEN"):
        assert part in message, message
