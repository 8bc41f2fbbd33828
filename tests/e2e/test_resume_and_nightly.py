"""Resume after a SIGKILL in the middle of chunk 2, and the nightly regression gate."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import REPO, DeployedRun, tiny_parameters
from tests.support.prefect_server import PrefectAPI, task_runs_of


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _flow_process(params_file: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.rl_pipeline", str(params_file)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _latest_flow_run(api: PrefectAPI, after: set[str]) -> dict:
    runs = api.post("/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 20}).json()
    return next(r for r in runs if r["id"] not in after)


def test_killed_run_resumes_and_ends_bit_identical(prefect_api: PrefectAPI, deployed_run: DeployedRun, tmp_path):
    from tasks.engine_job.layout import make_layout

    root = tmp_path / "storage"
    params = tiny_parameters(root.as_uri())
    params["storage"]["run_name"] = "killed"
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    layout = make_layout(root.as_uri(), "killed")
    in_chunk = Path(layout.work_dir) / "checkpoints" / "rollout_0000002" / "manifest.json"
    before = {r["id"] for r in prefect_api.post("/flow_runs/filter", {}).json()}

    proc = _flow_process(params_file, prefect_api.env)
    deadline = time.monotonic() + 400
    while not in_chunk.is_file():  # chunk 2 (rollouts 2-3) has committed its first in-chunk checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, "the flow ended before chunk 2 got going"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    newest = max(int(p.name.split("_")[1]) for p in (Path(layout.work_dir) / "checkpoints").glob("rollout_*")
                 if (p / "manifest.json").is_file())
    killed_run = _latest_flow_run(prefect_api, before)
    assert killed_run["state"]["type"] == "RUNNING"  # outside a worker only heartbeats would mark it crashed

    resumed_at = time.monotonic()
    rerun = subprocess.run([sys.executable, "-m", "flows.rl_pipeline", str(params_file)], cwd=REPO,
                           env=prefect_api.env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    print(f"re-run took {time.monotonic() - resumed_at:.1f} s")
    second = _latest_flow_run(prefect_api, before | {killed_run["id"]})
    states = {t["name"]: t["state"]["name"] for t in task_runs_of(prefect_api, second["id"])}
    assert states["train_chunk-from-0"] == "Cached", states
    assert states["train_chunk-from-2"] == "Completed", states

    published = root / "runs" / "killed" / "published"
    lineage = json.loads((published / "lineage.json").read_text())
    assert lineage["chunks"][1]["resumed_from"] == newest  # chunk 2 went on from its last in-chunk checkpoint
    [reference] = list(deployed_run.storage_root.glob("runs/*/checkpoints/rollout_0000003/model.safetensors"))
    final = root / "runs" / "killed" / "checkpoints" / "rollout_0000003" / "model.safetensors"
    assert _sha256(final) == _sha256(reference)
    [reference_hf] = list(deployed_run.storage_root.glob("runs/*/published/hf/model.safetensors"))
    assert _sha256(published / "hf" / "model.safetensors") == _sha256(reference_hf)


def test_nightly_passes_on_its_baseline_and_fails_with_a_readable_diff(prefect_api: PrefectAPI,
                                                                        deployed_run: DeployedRun, tmp_path):
    from flows.nightly_regression import RegressionDetected, nightly_regression

    root = deployed_run.storage_root.as_uri()  # the same pinned config: training and eval come from the cache
    observed = nightly_regression(storage_root=root)
    assert observed["step_time_ratio"] > 0 and observed["reward_last"] is not None

    baseline = yaml.safe_load((REPO / "configs" / "nightly-baseline.yaml").read_text())
    baseline["bands"][0].update(baseline=0.9, below=0.05)  # reward_last: a bar this run cannot reach
    broken = tmp_path / "baseline.yaml"
    broken.write_text(yaml.safe_dump(baseline))
    with pytest.raises(RegressionDetected) as failure:
        nightly_regression(storage_root=root, baseline_file=str(broken))
    diff = str(failure.value)
    assert "1 of 4 metric(s) outside their band" in diff
    assert "| ❌ | reward_last |" in diff and "[0.85, 1.2]" in diff and "under" in diff
    artifact = prefect_api.get("/artifacts/nightly-regression/latest").json()
    assert "| ❌ | reward_last |" in artifact["data"]
