"""rl-pipeline end to end on the tiny model, triggered through the REST API and executed by a worker."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tasks.publish import embed_plots
from tests.e2e.conftest import DeployedRun, tiny_parameters
from tests.support.prefect_server import PrefectAPI, task_runs_of

STAGES = {"stage_model", "stage_data", "convert_checkpoint", "train_chunk", "evaluate", "publish"}


def _published(run: DeployedRun):
    [published] = list(run.storage_root.glob("runs/*/published"))
    return published


def test_every_stage_ran_and_the_published_report_is_consistent(prefect_api: PrefectAPI, deployed_run: DeployedRun):
    state = deployed_run.flow_run["state"]
    assert state["type"] == "COMPLETED", state["message"]
    tasks = task_runs_of(prefect_api, deployed_run.flow_run["id"])
    names = {t["task_key"].split("-")[0] for t in tasks}
    assert STAGES <= names, names
    assert all(t["state"]["type"] == "COMPLETED" for t in tasks), [(t["name"], t["state"]["name"]) for t in tasks]
    chunk_runs = sorted(t["name"] for t in tasks if t["name"].startswith("train_chunk"))
    assert chunk_runs == ["train_chunk-from-0", "train_chunk-from-2"]

    out = _published(deployed_run)
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in history if "rollout/raw_reward" in r] == [0, 1, 2, 3]
    assert any(r["rollout_id"] == -1 and "eval/aime" in r for r in history)  # the baseline before training
    for png in ("reward.png", "logprob_diff.png", "response_length.png", "eval_scores.png"):
        assert (out / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "eval").glob("aime_rollout_*.jsonl"))
    assert (out / "hf" / "model.safetensors").is_file()

    lineage = json.loads((out / "lineage.json").read_text())
    assert [c["rollouts"] for c in lineage["chunks"]] == [[0, 1], [2, 3]]
    for chunk in lineage["chunks"]:  # each chunk's checkpoint is committed where lineage says, with that manifest
        relative = chunk["checkpoint"].removeprefix(deployed_run.storage_root.as_uri() + "/")
        ckpt_dir = deployed_run.storage_root / relative
        stored = json.loads((ckpt_dir / "manifest.json").read_text())
        assert stored["meta"]["engine_manifest_sha256"] == chunk["manifest_sha256"]
    assert lineage["model"]["source"] == "builtin://tiny-qwen3" and len(lineage["model"]["manifest_sha256"]) == 64
    assert {"torch", "prefect", "ray", "python"} <= set(lineage["versions"])
    assert lineage["config"]["engine_flags"]["custom-rm-path"] == "vime_engine.rewards.digit_share:digit_share"

    report = (out / "report.md").read_text()
    assert lineage["chunks"][-1]["checkpoint"] in report and lineage["config"]["identity_hash"] in report
    rewards = [r["rollout/raw_reward"] for r in history if "rollout/raw_reward" in r]
    assert f"| reward, last rollout | {rewards[-1]:.4g} |" in report
    # The final evaluation is the engine's at the last rollout (run once, inside the last chunk).
    [before], [final] = ([r for r in history if r["rollout_id"] == i and "eval/aime" in r] for i in (-1, 3))
    assert f"| aime | avg@2 | {before['eval/aime']:.4g} | {final['eval/aime']:.4g} |" in report
    assert "- `aime`: `builtin://aime-synthetic`: 30 AIME-shaped problems" in report and "ratio" not in report

    artifacts = prefect_api.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [
        deployed_run.flow_run["id"]]}}}).json()
    kinds = {a["type"] for a in artifacts}
    assert {"markdown", "table", "progress"} <= kinds, kinds
    links = {a["key"].rsplit("-link-", 1)[1]: a["data"] for a in artifacts if a["key"] and "-link-" in a["key"]}
    assert set(links) == {"report", "checkpoint", "hf-export"}
    assert lineage["chunks"][-1]["checkpoint"] in links["checkpoint"]
    plots = sorted(png.name for png in (out / "plots").glob("*.png"))
    # The UI's copy of the report carries its plots inline (tests/e2e/test_ui_artifacts.py sees them rendered).
    assert any(a["type"] == "markdown" and a["data"] == embed_plots(report, out / "plots", plots) for a in artifacts)
    [eval_table] = [json.loads(a["data"]) for a in artifacts if a["key"] and a["key"].endswith("-eval")]
    assert {"eval set": "aime", "metric": "avg@2", "before training": before["eval/aime"],
            "final": final["eval/aime"]} in eval_table
    progress = sorted(a["data"] for a in artifacts if a["type"] == "progress")
    assert progress == [50.0, 100.0]  # one per chunk: chunk 1 ends half way, chunk 2 at the end

    # The engine's output (Ray, its workers, vLLM) went to one log a job under the run's work dir.
    from tasks.engine_job.layout import make_layout
    from vime_engine.assets import cache_dir

    layout = make_layout(deployed_run.storage_root.as_uri(), lineage["config"]["identity_hash"][:12])
    logs = Path(layout.work_dir) / "logs"
    assert cache_dir() in Path(layout.work_dir).parents
    assert sorted(f.name for f in logs.glob("*.log")) == ["chunk-0000000.log", "chunk-0000002.log",
                                                         "export-rollout_0000003.log"]
    assert "Initializing a V1 LLM engine" in (logs / "chunk-0000002.log").read_text()
    # The export alone needs no engine: the job writes it in its own process, from the last checkpoint's weights.
    export_log = (logs / "export-rollout_0000003.log").read_text()
    assert "Initializing a V1 LLM engine" not in export_log and "Started a local Ray instance" not in export_log
    from safetensors.torch import load_file

    last = deployed_run.storage_root / lineage["chunks"][-1]["checkpoint"].removeprefix(
        deployed_run.storage_root.as_uri() + "/")
    trained, exported = load_file(last / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    assert exported.keys() <= trained.keys() and all(torch.equal(exported[k], trained[k]) for k in exported)


def test_parameters_round_trip(prefect_api: PrefectAPI, deployed_run: DeployedRun):
    stored = prefect_api.get(f"/flow_runs/{deployed_run.flow_run['id']}").json()["parameters"]
    assert stored == deployed_run.parameters


def test_bad_parameter_is_rejected_by_the_server(prefect_api: PrefectAPI, deployed: str, tmp_path):
    params = tiny_parameters(tmp_path.as_uri())
    params["training"]["rollouts_per_chunk"] = 0
    response = prefect_api.post(f"/deployments/{deployed}/create_flow_run", {"parameters": params})
    assert response.status_code == 409, response.text
    detail = response.json()["detail"]
    assert "rollouts_per_chunk" in detail and "0 is less than the minimum of 1" in detail, detail


def test_crash_automations_are_installed(prefect_api: PrefectAPI, deployed: str):
    automations = prefect_api.post("/automations/filter", {}).json()
    by_name = {a["name"]: a for a in automations}
    rerun = by_name["vimeflow: re-run crashed rl-pipeline runs"]
    assert rerun["trigger"]["expect"] == ["prefect.flow-run.Crashed"]
    assert rerun["actions"][0]["type"] == "change-flow-run-state" and rerun["actions"][0]["state"] == "SCHEDULED"
    zombie = by_name["vimeflow: mark flow runs without heartbeats crashed"]
    assert zombie["trigger"]["posture"] == "Proactive" and zombie["actions"][0]["state"] == "CRASHED"
    deployment = prefect_api.get(f"/deployments/{deployed}").json()
    assert deployment["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
    assert deployment["enforce_parameter_schema"] is True
