"""Resume equivalence: a run killed with SIGKILL anywhere and resumed ends bit-identical to one never killed.

Every run is a real `vimeflow train` process (Ray cluster, vLLM engine, torch trainer). Kills are injected
by tests/support/faults/sitecustomize.py inside a chosen function call of whichever process runs it
(tests/support/killed_runs.py runs them).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.killed_runs import REPO, run_train, write_config
from vime_engine.checkpoint.store import DRIVER_STATE, find_latest
from vime_engine.checkpoint.run_history import HISTORY_FILE
from vime_engine.runtime.run_state import BUFFER_FILE

NUM_ROLLOUT = 4


@pytest.fixture(scope="module")
def base_config(tmp_path_factory, tiny_model, arithmetic_data) -> dict:
    return {
        "hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data), "input-key": "question",
        "label-key": "answer", "apply-chat-template": True, "rollout-shuffle": True,
        "custom-rm-path": str(REPO / "tests/support/tiny_task.py") + ":digit_share",
        "num-rollout": NUM_ROLLOUT, "rollout-batch-size": 4, "n-samples-per-prompt": 4,
        "global-batch-size": 8,  # two optimizer steps per rollout: the optimizer state matters
        "rollout-max-response-len": 8, "lr": 1e-3, "save-interval": 1, "vllm-kv-cache-gb": 0.25,
        # Over-sampling: 6 prompts drawn for 4 groups, so kept surplus groups carry over across rollouts
        # (and across the kills below, through the checkpoint's buffer).
        "over-sampling-batch-size": 6,
    }


def _final(run_dir: Path) -> tuple[str, list[dict]]:
    """sha256 of the final weights and the per-rollout metrics without timings."""
    ref = find_latest(run_dir / "ckpt")
    assert ref is not None and ref.rollout_id == NUM_ROLLOUT - 1
    weights = hashlib.sha256((ref.path / "model.safetensors").read_bytes()).hexdigest()
    history = [
        {k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
        for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    return weights, history


@pytest.fixture(scope="module")
def reference(tmp_path_factory, base_config) -> tuple[Path, str, list[dict]]:
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_train(write_config(run_dir, base_config)) == 0
    weights, history = _final(run_dir)
    assert [h["rollout_id"] for h in history] == list(range(NUM_ROLLOUT))
    return run_dir, weights, history


def test_kills_during_generation_optimizer_step_and_checkpoint_write_resume_bit_identical(
    tmp_path, base_config, reference, caplog
):
    _, ref_weights, ref_history = reference
    config = write_config(tmp_path, base_config)
    # Rollout 1's generation (the 2nd round submitted to vLLM by the first process).
    run_train(config, fault="vime_engine.rollout.vllm_engine:VLLMEngine.submit:2")
    assert find_latest(tmp_path / "ckpt").rollout_id == 0
    # Resumed at rollout 1 (2 optimizer steps); killed inside rollout 2's first optimizer step.
    run_train(config, fault="torch.optim.adamw:AdamW.step:3")
    assert find_latest(tmp_path / "ckpt").rollout_id == 1
    # Resumed at rollout 2; killed while its checkpoint is written (files there, manifest not yet).
    run_train(config, fault="vime_engine.checkpoint.store:build_manifest:1")
    assert find_latest(tmp_path / "ckpt").rollout_id == 1
    assert list((tmp_path / "ckpt").glob(".rollout_0000002.partial-*")), "the interrupted save left no trace"
    # Rollout 2's history lines went to the file before its manifest; the resume cuts them off again.
    history_file = tmp_path / "ckpt" / HISTORY_FILE
    assert len(history_file.read_text().splitlines()) == NUM_ROLLOUT - 1
    # The newest checkpoint corrupt (one flipped byte, size unchanged): reported, and the one before it resumes.
    newest = tmp_path / "ckpt" / "rollout_0000001" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert find_latest(tmp_path / "ckpt").rollout_id == 0
    assert "rollout_0000001" in caplog.text and "model.safetensors" in caplog.text
    # Resumed at rollout 1 again, to the end.
    assert run_train(config) == 0
    assert "skipping checkpoint" in (tmp_path / "log.txt").read_text()

    weights, history = _final(tmp_path)
    assert weights == ref_weights
    assert history == ref_history
    assert [json.loads(line) for line in history_file.read_text().splitlines()] == [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert "history" not in json.loads((find_latest(tmp_path / "ckpt").path / DRIVER_STATE).read_text())


def test_two_chunks_equal_one_run(tmp_path, base_config, reference):
    _, ref_weights, ref_history = reference
    config = write_config(tmp_path, base_config)
    for start in (0, 2):
        code = (
            "import sys; from vime_engine.config import build_config; from vime_engine.chunk import run_chunk; "
            f"r = run_chunk(build_config(yaml_path=sys.argv[1]), {start}, 2); print(r)"
        )
        assert run_train(config, command=[sys.executable, "-c", code, str(config)]) == 0
    weights, history = _final(tmp_path)
    assert weights == ref_weights
    assert history == ref_history


def test_truncated_checkpoint_is_not_a_checkpoint(tmp_path, reference, caplog):
    ref_dir, _, _ = reference
    shutil.copytree(ref_dir / "ckpt", tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / "rollout_0000003" / "trainer.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    assert find_latest(tmp_path / "ckpt").rollout_id == 2
    assert "trainer.pt" in caplog.text
    (tmp_path / "ckpt" / "rollout_0000002" / "manifest.json").unlink()
    assert find_latest(tmp_path / "ckpt").rollout_id == 1


def test_sigterm_finishes_the_step_checkpoints_exits_75_and_resumes_bit_identical(tmp_path, base_config, reference):
    _, ref_weights, ref_history = reference
    config = write_config(tmp_path, base_config, **{"save-interval": None})  # only the preemption save
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "--config", str(config)], cwd=REPO,
                            env=env, start_new_session=True, stdout=open(tmp_path / "log.txt", "a"),
                            stderr=subprocess.STDOUT)
    metrics = tmp_path / "out" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # to the driver only, as a scheduler's preemption notice would
        assert proc.wait(timeout=240) == 75
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped_at = find_latest(tmp_path / "ckpt").rollout_id
    assert stopped_at < NUM_ROLLOUT - 1
    assert "preempted after rollout" in (tmp_path / "log.txt").read_text()

    assert run_train(config) == 0
    weights, history = _final(tmp_path)
    assert weights == ref_weights
    assert history == ref_history


# 2 groups kept of 6 generated, responses ending at different steps (see test_engine_loop.py): the groups still
# generating are cut off and continued in the next rollout, across the checkpoint in between (the multi-turn test
# below kills a run there).
PARTIAL = {"partial-rollout": True, "rollout-batch-size": 2, "over-sampling-batch-size": 6, "global-batch-size": 4,
           "rollout-max-response-len": 32, "vllm-max-model-len": 88}


# FSDP2 (`--train-backend fsdp`): each rank holds a shard of the weights and Adam moments, gathered into whole
# tensors for the checkpoint and cut again on resume, by two ranks or (the last part) by one.
def test_two_sharded_data_parallel_ranks_resume_bit_identical_and_their_checkpoint_loads_on_one(
        tmp_path_factory, base_config):
    dp2 = {"actor-num-gpus-per-node": 2, "train-backend": "fsdp"}
    reference_dir = tmp_path_factory.mktemp("dp2-reference")
    assert run_train(write_config(reference_dir, base_config, **dp2)) == 0
    ref_weights, ref_history = _final(reference_dir)

    run_dir = tmp_path_factory.mktemp("dp2-killed")
    config = write_config(run_dir, base_config, **dp2)
    # A rank killed in its 3rd optimizer step: rollout 1's first (two steps a rollout); the other rank waits in
    # its next collective until the whole run is taken down.
    run_train(config, fault="torch.optim.adamw:AdamW.step:3")
    assert find_latest(run_dir / "ckpt").rollout_id == 0
    assert run_train(config) == 0
    assert _final(run_dir) == (ref_weights, ref_history)

    # The two ranks' checkpoint of rollout 2, resumed by a trainer of one rank for the last rollout.
    one_dir = tmp_path_factory.mktemp("dp2-to-dp1")
    shutil.copytree(reference_dir / "ckpt", one_dir / "ckpt", ignore=shutil.ignore_patterns("rollout_0000003"))
    (one_dir / "ckpt" / "LATEST").write_text("rollout_0000002")
    assert run_train(write_config(one_dir, base_config)) == 0
    from safetensors.torch import load_file

    ours = load_file(find_latest(one_dir / "ckpt").path / "model.safetensors")
    theirs = load_file(find_latest(reference_dir / "ckpt").path / "model.safetensors")
    assert max((ours[k] - theirs[k]).abs().max().item() for k in theirs) <= 1e-5
    last = json.loads((one_dir / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["rollout_id"] == NUM_ROLLOUT - 1
    assert last["train/pg_loss"] == pytest.approx(ref_history[-1]["train/pg_loss"], rel=1e-4, abs=1e-7)


# Multi-turn conversations (tests/support/two_turn_agent.py: two model turns around an environment reply) under
# partial rollout: rollout 0 cuts conversations off, some mid-turn and some after their tool reply, and the
# checkpoint's buffer holds them; the run is killed as rollout 1 starts continuing them.
MULTI_TURN = {**PARTIAL, "vllm-max-model-len": 176, "rollout-max-turns": 2,
              "custom-generate-function-path": str(REPO / "tests/support/two_turn_agent.py") + ":generate"}


def test_multi_turn_conversations_cut_off_and_killed_resume_bit_identical(tmp_path_factory, base_config):
    reference_dir = tmp_path_factory.mktemp("multi-turn-reference")
    assert run_train(write_config(reference_dir, base_config, **MULTI_TURN)) == 0
    ref_weights, ref_history = _final(reference_dir)
    assert all(h["rollout/model_turns/mean"] > 1 for h in ref_history)
    assert sum(h["rollout/aborted_groups"] for h in ref_history) > 0

    run_dir = tmp_path_factory.mktemp("multi-turn-killed")
    config = write_config(run_dir, base_config, **MULTI_TURN)
    run_train(config, fault="vime_engine.rollout.custom_generate:CustomRound.__init__:2")
    latest = find_latest(run_dir / "ckpt")
    assert latest.rollout_id == 0
    carry = pickle.loads((latest.path / BUFFER_FILE).read_bytes())
    assert len(carry.partial) == ref_history[0]["rollout/aborted_groups"] == ref_history[1]["rollout/resumed_groups"]
    cut = [s for group in carry.partial for s in group if not s.finished]
    assert any(0 in s.loss_mask and s.loss_mask[0] == 1 for s in cut), "no conversation was cut after a tool reply"
    assert all(len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length for s in cut)
    assert run_train(config) == 0

    weights, history = _final(run_dir)
    assert weights == ref_weights
    assert history == ref_history


# Megatron in the same run as vLLM (megatron-core 0.16 in this lane), each rollout generated right after a weight
# sync, so Megatron's log-probs of the sampled tokens must equal vLLM's (fp32), and a rank SIGKILLed in rollout 1's
# first optimizer step resumes from the torch_dist checkpoint of rollout 0 to the same HF export, bit for bit. Each
# rank maps megatron-core's hard-coded CUDA calls onto the CPU itself (vime_engine/devices/megatron_on_cpu.py), as a
# user's run does.
# - tp2-colocated: tensor parallel over two Ray ranks (gloo), colocated with one vLLM engine tensor parallel across
#   the same two ranks' processes (vime's layout); the kill takes the rank's engine shard with it.
# - ep2-moe: the tiny Qwen3-MoE at expert parallelism 2 (each rank four of the eight experts; the dense weights data
#   parallel over both), with vime's qwen3-30B-A3B.sh MoE flags and the router's load-balancing loss; the sync
#   gathers the experts of both ranks into HF names, the checkpoint holds each rank's experts.
MEGATRON_TP2 = {"train-backend": "megatron", "tensor-model-parallel-size": 2, "actor-num-gpus-per-node": 2,
                "colocate": True, "rollout-num-gpus-per-engine": 2, "micro-batch-size": 4,
                "num-rollout": 2, "over-sampling-batch-size": 4}  # no surplus groups: every sample is fresh
MEGATRON_EP2_MOE = {
    "hf-checkpoint": "builtin://tiny-qwen3-moe", "train-backend": "megatron", "expert-model-parallel-size": 2,
    "expert-tensor-parallel-size": 1, "actor-num-gpus-per-node": 2, "num-rollout": 2, "over-sampling-batch-size": 4,
    "moe-aux-loss-coeff": 0.01, "num-experts": 8, "moe-router-topk": 2, "moe-ffn-hidden-size": 64,
    "moe-layer-freq": "[1, 1]", "moe-token-dispatcher-type": "alltoall", "moe-router-dtype": "fp32",
    "moe-grouped-gemm": True, "moe-permute-fusion": True,
}
# Two optimizer steps a rollout; with experts Megatron steps a dense and an expert AdamW in each.
MEGATRON_RUNS = {"tp2-colocated": (MEGATRON_TP2, "torch.optim.adamw:AdamW.step:3"),
                 "ep2-moe": (MEGATRON_EP2_MOE, "torch.optim.adamw:AdamW.step:5")}


@pytest.mark.parametrize("layout", MEGATRON_RUNS, ids=list(MEGATRON_RUNS))
def test_megatron_killed_mid_step_resumes_bit_identical(tmp_path_factory, base_config, layout):
    flags, fault = MEGATRON_RUNS[layout]

    def finished(run_dir: Path) -> tuple[str, list[dict]]:
        export = hashlib.sha256((run_dir / "hf" / "model.safetensors").read_bytes()).hexdigest()
        history = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                   for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
        return export, history

    def config(run_dir: Path) -> Path:
        return write_config(run_dir, base_config, **flags, **{"save-hf": str(run_dir / "hf")})

    reference_dir = tmp_path_factory.mktemp(f"megatron-{layout}-reference")
    assert run_train(config(reference_dir)) == 0
    ref_export, ref_history = finished(reference_dir)
    assert [h["rollout_id"] for h in ref_history] == [0, 1]
    assert all(h["train/train_rollout_logprob_abs_diff"] <= 1e-5 for h in ref_history), ref_history
    assert ref_history[0]["train/pg_loss"] != ref_history[1]["train/pg_loss"]
    if layout == "ep2-moe":  # Megatron's Switch loss of each MoE layer: 1 when the experts share the tokens evenly
        assert all(0.9 < h["train/moe_aux_loss"] < 2.0 for h in ref_history), ref_history
        from safetensors import safe_open

        with safe_open(str(reference_dir / "hf" / "model.safetensors"), "pt") as exported:
            assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)} <= set(exported.keys())

    run_dir = tmp_path_factory.mktemp(f"megatron-{layout}-killed")
    # The 3rd optimizer step is rollout 1's first; the other rank waits in its collective.
    run_train(config(run_dir), fault=fault)
    assert find_latest(run_dir / "ckpt").rollout_id == 0
    assert run_train(config(run_dir)) == 0
    assert finished(run_dir) == (ref_export, ref_history)
