"""`vimeflow train` end to end on the tiny model: vime's Qwen3-4B launch flags as they are (colocated, Megatron at
TP=2 on two ranks with one vLLM engine tensor parallel across both), eval-only runs, HF export; nothing of the
private Ray cluster left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tests.unit.test_config import QWEN3_4B_SCRIPT
from tests.unit.test_model_flags import TINY_QWEN3_MODEL_FLAGS

REPO = Path(__file__).resolve().parents[2]


def _vimeflow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "train", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)


def _swap_paths(flags: list[str], mapping: dict[str, str]) -> list[str]:
    return [mapping.get(f, f) for f in flags]


def test_vime_qwen3_4b_flags_run_scaled_down_then_eval_only_and_export(tmp_path, tiny_model, arithmetic_data, aime_data):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    flags = _swap_paths(QWEN3_4B_SCRIPT, {
        "/models/m": str(tiny_model), "/data/p.jsonl": str(arithmetic_data), "/data/aime.jsonl": str(aime_data),
        "/ckpt": str(ckpt),
    })
    scaled_down = [  # later flags win: the same script at CPU size, on gsm8k-shaped data
        "--input-key", "question", "--label-key", "answer", "--num-rollout", "2", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--global-batch-size", "4", "--rollout-max-response-len", "8",
        "--eval-max-response-len", "8", "--n-samples-per-eval-prompt", "2", "--eval-interval", "1",
        "--eval-input-key", "prompt", "--eval-label-key", "label", "--eval-rm-type", "math",
        "--max-tokens-per-gpu", "512", "--vllm-kv-cache-gb", "0.25", "--output-dir", str(out),
        "--actor-num-gpus-per-node", "2",  # two ranks (one Ray CPU each), the script's engine of 2 across them
        "--train-memory-margin-bytes", "0",  # on CPU nothing is handed back: a margin is refused, naming why
        "--train-backend", "megatron", "--tensor-model-parallel-size", "2",  # the script's Megatron part
        # flags of its NPU variants that act here (the others are refused naming why: test_every_flag_acts.py)
        "--rollout-backend", "vllm", "--megatron-to-hf-mode", "raw", "--attention-backend", "flash", "--use-flash-attn",
        "--no-gradient-accumulation-fusion", "--vllm-max-num-seqs", "64", "--vllm-enforce-eager",
        "--save-hf", str(tmp_path / "hf-trained"),
        *TINY_QWEN3_MODEL_FLAGS,  # the script's scripts/models/qwen3-4B.sh part, for the tiny model
    ]
    # Where the private cluster keeps its session (a short path: Ray's sockets live in it), removed at the end.
    with tempfile.TemporaryDirectory(prefix="vf-") as ray_tmp:
        run = _vimeflow(*flags, *scaled_down, env={**os.environ, "VIMEFLOW_RAY_TMP": ray_tmp})
        assert not any(Path(ray_tmp).iterdir())
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rollout    1 | reward" in run.stdout
    # A quiet console: the live view and a line per rollout; Ray's, the workers' and vLLM's output is in the log.
    console = (run.stdout + run.stderr).splitlines()
    assert len(console) <= 8, "\n".join(console)  # the log's name, 2 rollouts, the bar, metrics, checkpoint
    assert not any("pid=" in line or "WARNING" in line for line in console), "\n".join(console)
    log = out / "logs" / "engine.log"
    assert f"engine and worker logs: {log}" in run.stdout
    logged = log.read_text()
    assert "(ColocatedActor pid=" in logged and "Initializing a V1 LLM engine" in logged
    assert "tensor_parallel_size=2" in logged  # one engine's shards, one in each rank's process
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [line for line in lines if "train/kl_loss" in line]
    assert [line["rollout_id"] for line in train_lines] == [0, 1]
    assert all(line["train/train_rollout_logprob_abs_diff"] <= 1e-5 for line in train_lines)
    assert "eval/aime-pass@2" in lines[0] and lines[0]["rollout_id"] == -1  # the baseline before training
    assert (ckpt / "LATEST").read_text() == "rollout_0000001"

    # Eval only on the saved (torch_dist) checkpoint, exporting the weights as an HF directory.
    hf_dir = tmp_path / "hf"
    run = _vimeflow(*flags, *scaled_down, "--num-rollout", "0", "--n-samples-per-eval-prompt", "4",
                    "--save-hf", str(hf_dir))
    assert run.returncode == 0, run.stdout + run.stderr
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"eval/aime", "eval/aime-pass@1", "eval/aime-pass@2", "eval/aime-pass@4",
            "eval/aime/truncated_ratio"} <= set(last)
    rows = [json.loads(r) for r in (out / "eval" / "aime_rollout_0000002.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and all(len(r["answers"]) == 4 and len(r["correct"]) == 4 for r in rows)
    assert {"problem", "label", "answers", "extracted", "correct"} <= set(rows[0])

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    # The weights restored from the checkpoint are the ones the first run trained, bit for bit.
    exported = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    trained = load_file(str(tmp_path / "hf-trained" / "model.safetensors"))
    initial = load_file(str(tiny_model / "model.safetensors"))
    assert set(trained) <= set(exported.state_dict())
    for name, tensor in trained.items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    assert max((trained[n] - initial[n]).abs().max().item() for n in trained) > 0  # training moved them


def test_bad_flag_fails_before_any_model_loads(tmp_path):
    run = _vimeflow("--hf-checkpoint", "x", "--prompt-data", "y", "--global-batch-size", "3")
    assert run.returncode == 2
    assert "--global-batch-size 3 does not divide" in run.stderr and "Traceback" not in run.stderr
