"""W&B (offline, no network) and MLflow (SQLite store) hold a killed and resumed run once per rollout.

The trackers are read back from their own stores: W&B's transaction logs (`run-<id>.wandb`, one per start of
the run) and MLflow's database through MlflowClient. The kill is real in one case (a child process exits
without closing anything, so W&B has not written its buffered rows) and a clean stop in the other (both
trackers hold rollouts 4 and 5 already when the run resumes from its checkpoint at 3).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from vime_engine.config import ConfigError, EngineConfig, build_config
from vime_engine.tracking.sink import MetricsSink
from vime_engine.runtime.driver import train
from vime_engine.tracking.resume import RUN_KEY_FILE
from vime_engine.tracking.mlflow_tracker import default_tracking_uri
from vime_engine.tracking.wandb_log import history_rows, read_records, run_logs

REPO = Path(__file__).resolve().parents[2]
BASELINE = {"eval/aime": 0.05, "eval/aime-pass@4": 0.125}


def _flags(root: Path) -> dict:
    return {"hf-checkpoint": "model", "prompt-data": "data.jsonl", "save": str(root / "ckpt"),
            "output-dir": str(root / "out"), "lr": 3e-6, "use-wandb": True, "wandb-mode": "offline",
            "wandb-project": "vime-tests", "wandb-group": "resume", "use-mlflow": True}


def _metrics(rollout_id: int) -> dict:
    """What the run logs at a rollout: a function of the rollout id, as a resumed CPU run reproduces it."""
    return {"rollout/raw_reward": rollout_id / 10, "train/pg_loss": -rollout_id / 100, "weight_version": rollout_id + 1}


def _first_attempt(flags: dict, killed: bool) -> None:
    """Log the baseline and rollouts 0..5, then die (no close) or stop cleanly."""
    script = f"""
import os, json
from vime_engine.config import build_config
from vime_engine.tracking.sink import MetricsSink
from vime_engine.runtime.cluster import ray_cluster
from vime_engine.runtime.driver import train
from tests.component.test_tracking import BASELINE, _metrics
sink = MetricsSink(build_config([], **json.loads({json.dumps(json.dumps(flags))})))
sink.rewrite([])
sink.log(-1, BASELINE)
for rollout_id in range(6):
    sink.log(rollout_id, _metrics(rollout_id))
if {killed}:
    os._exit(9)
sink.close()
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == (9 if killed else 0), done.stderr[-3000:]


def _resume_from_rollout_3(cfg: EngineConfig) -> None:
    history = [{"rollout_id": -1, **BASELINE}] + [{"rollout_id": r, **_metrics(r)} for r in range(4)]
    sink = MetricsSink(cfg)
    sink.rewrite(history)  # what RunContext.open does with the checkpoint's history
    for rollout_id in range(4, 8):
        sink.log(rollout_id, _metrics(rollout_id))
    sink.close()


@pytest.mark.parametrize("killed", [True, False], ids=["killed", "stopped"])
def test_a_resumed_run_appends_to_the_same_tracker_runs_once_per_rollout(tmp_path, killed):
    flags = _flags(tmp_path)
    _first_attempt(flags, killed)
    cfg = build_config([], **flags)
    _resume_from_rollout_3(cfg)

    key = (tmp_path / "ckpt" / RUN_KEY_FILE).read_text()
    expected = [(r, r / 10) for r in range(8)]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["rollout_id"] for line in lines] == list(range(-1, 8))

    logs = run_logs(tmp_path / "out", key)
    assert len(logs) == 2  # one per start of the run
    rows = [row for log in logs for row in history_rows(log)]
    print(f"W&B rows per start: {[len(history_rows(log)) for log in logs]}")
    assert [(row["rollout_id"], row["rollout/raw_reward"]) for row in rows if "rollout/raw_reward" in row] == expected
    assert [(row["rollout_id"], row["eval/aime-pass@4"]) for row in rows if "eval/aime-pass@4" in row] == [(-1, 0.125)]
    steps = [row["_step"] for row in rows]
    assert steps == sorted(set(steps))  # W&B's own step keeps rising across the starts: `wandb sync` appends
    run = [r.run for r in read_records(logs[-1]) if r.WhichOneof("record_type") == "run"][0]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert (run.run_id, run.project, run.run_group) == (key, "vime-tests", "resume")
    assert config["lr"] == 3e-6 and config["use_mlflow"] is True

    client = MlflowClient(default_tracking_uri(str(tmp_path / "out")))
    runs = client.search_runs([client.get_experiment_by_name("vimeflow").experiment_id])
    assert len(runs) == 1
    run_id = runs[0].info.run_id
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "rollout/raw_reward"))
    assert history == expected
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/aime-pass_at_4")] == [(-1, 0.125)]
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED"
    assert finished.data.params["lr"] == "3e-06" and finished.data.tags["vime.run_key"] == key


def test_explicit_run_ids_continue_those_runs(tmp_path):
    flags = {**_flags(tmp_path), "save": None, "wandb-run-id": "given-run"}
    sink = MetricsSink(build_config([], **{**flags, "wandb-host": "https://wandb.example.test"}))  # offline: no call
    assert sink.trackers[0].run.settings.base_url == "https://wandb.example.test"  # vime's --wandb-host
    sink.log(0, _metrics(0))
    sink.close()
    client = MlflowClient(default_tracking_uri(str(tmp_path / "out")))
    (run,) = client.search_runs([client.get_experiment_by_name("vimeflow").experiment_id])

    sink = MetricsSink(build_config([], **{**flags, "mlflow-run-id": run.info.run_id}))
    sink.rewrite([{"rollout_id": 0, **_metrics(0)}])
    sink.log(1, _metrics(1))
    sink.close()

    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/pg_loss")) == [0, 1]
    rows = [row for log in run_logs(tmp_path / "out", "given-run") for row in history_rows(log)]
    assert [row["rollout_id"] for row in rows] == [0, 1]
    assert not (tmp_path / "out" / RUN_KEY_FILE).exists()

    with pytest.raises(ConfigError, match="--mlflow-run-id no-such-run: no such run"):
        MetricsSink(build_config([], **{**flags, "mlflow-run-id": "no-such-run"}))


def test_a_transaction_log_cut_short_reads_as_its_complete_rows(tmp_path):
    """A kill can leave half a chunk at the end of W&B's log: the rows before it still read, none after."""
    sink = MetricsSink(build_config([], **{**_flags(tmp_path), "use-mlflow": False, "save": None,
                                           "wandb-run-id": "cut"}))
    for rollout_id in range(40):
        sink.log(rollout_id, _metrics(rollout_id))
    sink.close()
    (log,) = run_logs(tmp_path / "out", "cut")
    whole = log.read_bytes()
    full = [row["rollout_id"] for row in history_rows(log)]
    assert full == list(range(40))
    seen = set()
    for cut in range(7, len(whole), 97):
        log.write_bytes(whole[:cut])
        ids = [row["rollout_id"] for row in history_rows(log)]
        assert ids == full[:len(ids)]
        seen.add(len(ids))
    assert len(seen) > 20  # the cuts fell between many rows, not only at the ends


def test_the_engine_loop_continues_its_tracker_runs_chunk_after_chunk(tmp_path, tiny_model, arithmetic_data, cluster):
    """Two chunks of one run (rollouts 0-1, then 2): each opens the trackers anew and they append."""
    cfg = build_config([], **{
        "hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data), "input-key": "question",
        "label-key": "answer", "apply-chat-template": True, "num-rollout": 3, "rollout-batch-size": 2,
        "n-samples-per-prompt": 2, "rollout-max-response-len": 8, "global-batch-size": 4, "lr": 1e-2,
        "vllm-kv-cache-gb": 0.25, "custom-rm-path": "tests/support/tiny_task.py:digit_share", "colocate": True,
        "save": str(tmp_path / "ckpt"), "output-dir": str(tmp_path / "out"),
        "use-wandb": True, "wandb-mode": "offline", "use-mlflow": True,
    })
    train(cfg, end_rollout_id=2)
    result = train(cfg)
    assert result.rollouts_done == [2]

    key = (tmp_path / "ckpt" / RUN_KEY_FILE).read_text()
    logged = {line["rollout_id"]: line for line in map(json.loads, (tmp_path / "out" / "metrics.jsonl").open())}
    assert sorted(logged) == [0, 1, 2]
    rows = [row for log in run_logs(tmp_path / "out", key) for row in history_rows(log)]
    for name in ("rollout/raw_reward", "train/grad_norm", "perf/rollout_time"):
        assert [(row["rollout_id"], row[name]) for row in rows if name in row] == [
            (r, logged[r][name]) for r in range(3)]
    client = MlflowClient(default_tracking_uri(str(tmp_path / "out")))
    (run,) = client.search_runs([client.get_experiment_by_name("vimeflow").experiment_id])
    for name in ("rollout/raw_reward", "train/pg_loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert history == [(r, pytest.approx(logged[r][name])) for r in range(3)]
    assert run.data.params["num_rollout"] == "3"
