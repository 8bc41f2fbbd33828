"""Prepared CUDA check for a lent GPU machine (a few minutes): run `python tests/gpu/check_cuda.py [--model DIR]`.

Needs a CUDA venv with Python 3.12: torch (CUDA), `vllm` (CUDA wheel), megatron-core 0.19.2 (Transformer Engine
optional: without it Megatron's local layers are used; no megatron-bridge: the HF mapping is the engine's own,
and with TE its fused-norm layer names are mapped but not yet run on a GPU), transformers, and this
project (`pip install --no-deps -e .`). No test shim: the real CUDA calls run.

Phases, each in its own process (vLLM and Megatron each want to own torch.distributed's default group):
  rollout   vLLM on cuda:0, bf16, generates a GRPO rollout (processed log-probs) and keeps running as the
            weight-sync receiver;
  torch     the torch backend (bf16) trains on that rollout;
  megatron  the Megatron backend (bf16) trains on it, then pushes its weights to the rollout process:
            NCCL broadcast (vime_engine.weight_sync endpoints, bucketed, pause / reset-cache / resume) when two
            GPUs are visible (NCCL refuses two ranks on one GPU), else the same load through vLLM in process
            from the exported stream.
After the sync the rollout process regenerates and the Megatron process recomputes those samples' log-probs.
Prints one JSON line: `train/train_rollout_logprob_abs_diff` of each backend, weight-sync seconds and GB/s,
the post-sync |vLLM - Megatron| log-prob difference, the engine settings vLLM ran with, and the checks below;
exits 1 when any check fails:
  - bf16 |train - rollout| log-prob difference <= 0.01 for each backend (vime reports 0.010-0.015 on Ascend);
  - weight sync <= 1 s when the model has at most 1B parameters;
  - the CUDA engine runs with CUDA graphs, prefix caching and chunked prefill (the device's defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
BUCKET_BYTES = 64 * 2**20
LOGPROB_DIFF_LIMIT = 0.01
SYNC_SECONDS_LIMIT, SYNC_LIMIT_MAX_PARAMS = 1.0, 1_000_000_000


def _cfg(model: str, backend: str):
    from vime_engine.config import from_flat

    return from_flat({
        "hf_checkpoint": model, "prompt_data": "unused.jsonl", "dtype": "bfloat16", "train_backend": backend,
        "rollout_batch_size": 8, "n_samples_per_prompt": 4, "global_batch_size": 16, "micro_batch_size": 4,
        "rollout_max_response_len": 48, "lr": 1e-6, "num_rollout": 1, "device": "cuda",
    })


def _samples(engine, model: str, seed: int):
    from transformers import AutoTokenizer

    from tests.support.tiny_task import digit_share
    from vime_engine.rollout.vllm_engine import Request, SamplingSettings
    from vime_engine.sample import Sample

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {a + 3}?"}],
                                            add_generation_prompt=True, tokenize=True)) for a in range(8)]
    # All 32 (8 prompts x 4 samples): GRPO groups and the batch size need them.
    requests = [Request(f"{g}/{j}", prompts[g], 48, seed + g + j) for g in range(8) for j in range(4)]
    samples = []
    for c in engine.generate(requests, SamplingSettings(max_tokens=48)):
        g = int(c.key.split("/")[0])
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        samples.append(Sample(
            group_index=g, prompt="", label="", prompt_tokens=prompts[g], response_tokens=c.token_ids,
            response=text, rollout_log_probs=c.log_probs, loss_mask=[1] * len(c.token_ids),
            reward=digit_share(text, ""), status=c.status, version_segments=[(engine.weight_version, len(c.token_ids))],
        ))
    return samples


def phase_rollout(model: str, work: Path, two_gpus: bool) -> None:
    from vime_engine.rollout.vllm_engine import EngineSettings, VLLMEngine
    from vime_engine.weight_sync.buckets import specs_of
    from vime_engine.weight_sync.endpoints import BroadcastReceiver, load_into_engine
    from vime_engine.weight_sync.group import GroupAddress

    engine = VLLMEngine(EngineSettings(model_path=model, dtype="bfloat16", gpu_memory_utilization=0.3))
    vllm_config = engine.llm.llm_engine.vllm_config  # what vLLM made of the arguments, not just what it was given
    (work / "engine.json").write_text(json.dumps({
        "kwargs": engine.engine_args, "cudagraph_mode": str(vllm_config.compilation_config.cudagraph_mode),
        "enforce_eager": vllm_config.model_config.enforce_eager,
        "prefix_caching": vllm_config.cache_config.enable_prefix_caching,
        "chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
    }))
    (work / "rollout.pkl").write_bytes(pickle.dumps(_samples(engine, model, seed=0)))
    (work / "rollout.ready").touch()
    _wait(work / "sender.json")
    sender = json.loads((work / "sender.json").read_text())
    if two_gpus:
        import torch

        specs = specs_of((n, torch.empty(s, dtype=getattr(torch, d), device="meta")) for n, s, d in sender["specs"])
        receiver = BroadcastReceiver(GroupAddress(**sender["address"]), specs, BUCKET_BYTES, "cuda:0")
        seconds = load_into_engine(engine, receiver.stream(1), version=1)
    else:
        from safetensors.torch import load_file

        weights = load_file(sender["weights_file"], device="cuda:0")
        seconds = load_into_engine(engine, iter(weights.items()), version=1)
    (work / "synced.pkl").write_bytes(pickle.dumps({"seconds": seconds, "samples": _samples(engine, model, seed=1)}))


def phase_train(model: str, work: Path, backend: str, two_gpus: bool) -> None:
    import torch

    samples = pickle.loads((work / "rollout.pkl").read_bytes())
    if backend == "torch":
        from vime_engine.train.torch_backend import TorchTrainBackend

        trainer = TorchTrainBackend(_cfg(model, "torch"), device="cuda:0")
        start = time.perf_counter()
        metrics = trainer.train_rollout(samples)
        (work / "torch.json").write_text(json.dumps({**metrics, "step_s": time.perf_counter() - start}))
        return
    from vime_engine.train.megatron_backend import MegatronTrainBackend

    trainer = MegatronTrainBackend(_cfg(model, "megatron"), device="cuda")
    start = time.perf_counter()
    metrics = trainer.train_rollout(samples)
    step_s = time.perf_counter() - start
    weights = dict(trainer.named_weights())
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    nparams = sum(t.numel() for t in weights.values())
    if two_gpus:
        from vime_engine.weight_sync.endpoints import BroadcastSender

        sender = BroadcastSender("nccl", "cuda:0", BUCKET_BYTES)
        specs = [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights.items()]
        (work / "sender.json").write_text(json.dumps({"address": sender.address.__dict__, "specs": specs}))
        torch.cuda.synchronize()
        start = time.perf_counter()
        sender.send(weights.items(), version=1)
        torch.cuda.synchronize()
        send_s = time.perf_counter() - start
    else:
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in weights.items()}, work / "weights.safetensors")
        (work / "sender.json").write_text(json.dumps({"weights_file": str(work / "weights.safetensors")}))
        send_s = None
    synced = pickle.loads(_wait(work / "synced.pkl").read_bytes())
    new = synced["samples"]
    ours = trainer.log_probs(new).float().cpu()
    vllm = torch.tensor([x for s in new for x in s.rollout_log_probs])
    (work / "megatron.json").write_text(json.dumps({
        **metrics, "step_s": step_s, "weight_bytes": nbytes, "weight_params": nparams, "send_s": send_s,
        "load_s": synced["seconds"],
        "post_sync_logprob_abs_diff_mean": (ours - vllm).abs().mean().item(),
    }))


def _wait(path: Path, timeout: float = 600.0) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.5)
    time.sleep(0.5)  # the writer finishes the file before the reader opens it
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="HF model dir (default: the built-in tiny Qwen3)")
    parser.add_argument("--phase", choices=["rollout", "torch", "megatron"])
    parser.add_argument("--work")
    parser.add_argument("--two-gpus", action="store_true", help="internal: the parent saw two GPUs")
    args = parser.parse_args()
    if args.phase:
        two_gpus = args.two_gpus
        work = Path(args.work)
        if args.phase == "rollout":
            phase_rollout(args.model, work, two_gpus)
        else:
            phase_train(args.model, work, args.phase, two_gpus)
        return
    import torch

    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    two_gpus = torch.cuda.device_count() >= 2
    work = Path(tempfile.mkdtemp(prefix="vimeflow-gpu-check-"))
    model = args.model
    if model is None:
        from vime_engine.models.builtin import materialize_builtin_model

        model = str(materialize_builtin_model("tiny-qwen3", work / "tiny-qwen3"))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}

    def run(phase: str, gpu: str = "0") -> subprocess.Popen:
        argv = [sys.executable, __file__, "--phase", phase, "--work", str(work), "--model", model]
        return subprocess.Popen(argv + (["--two-gpus"] if two_gpus else []), env={**env, "CUDA_VISIBLE_DEVICES": gpu})

    rollout = run("rollout")
    _wait(work / "rollout.ready", timeout=900)
    if run("torch").wait() != 0:
        raise SystemExit("torch phase failed")
    megatron = run("megatron", gpu="1" if two_gpus else "0")
    codes = megatron.wait(), rollout.wait()
    if codes != (0, 0):
        raise SystemExit(f"megatron / rollout phases exited {codes}")
    t, m = json.loads((work / "torch.json").read_text()), json.loads((work / "megatron.json").read_text())
    engine = json.loads((work / "engine.json").read_text())
    seconds = m["send_s"] if m["send_s"] is not None else m["load_s"]
    checks = _checks(t, m, engine, seconds)
    print(json.dumps({
        "gpus": torch.cuda.device_count(), "model": model, "dtype": "bfloat16",
        "torch/train/train_rollout_logprob_abs_diff": t["train/train_rollout_logprob_abs_diff"],
        "megatron/train/train_rollout_logprob_abs_diff": m["train/train_rollout_logprob_abs_diff"],
        "torch_step_s": t["step_s"], "megatron_step_s": m["step_s"],
        "weight_sync": "nccl broadcast" if two_gpus else "in-process reload (one GPU: NCCL needs two)",
        "weight_sync_s": seconds, "weight_sync_GBps": m["weight_bytes"] / seconds / 1e9,
        "weight_params": m["weight_params"], "vllm_load_s": m["load_s"],
        "post_sync_logprob_abs_diff_mean": m["post_sync_logprob_abs_diff_mean"], "engine": engine, "checks": checks,
    }))
    failed = [c["name"] for c in checks if c["ok"] is False]
    if failed:
        raise SystemExit(f"failed checks: {'; '.join(failed)}")


def _checks(t: dict, m: dict, engine: dict, sync_seconds: float) -> list[dict]:
    """Each check's value, limit and verdict (ok None: does not apply to this model)."""
    checks = [
        {"name": f"{backend} bf16 |train - rollout| log-prob <= {LOGPROB_DIFF_LIMIT}", "value": diff,
         "ok": diff <= LOGPROB_DIFF_LIMIT}
        for backend, diff in (("torch", t["train/train_rollout_logprob_abs_diff"]),
                              ("megatron", m["train/train_rollout_logprob_abs_diff"]))
    ]
    small = m["weight_params"] <= SYNC_LIMIT_MAX_PARAMS
    checks.append({"name": f"weight sync <= {SYNC_SECONDS_LIMIT} s (models up to 1B parameters)",
                   "value": sync_seconds, "ok": sync_seconds <= SYNC_SECONDS_LIMIT if small else None})
    wanted = {"enforce_eager": False, "enable_prefix_caching": True, "enable_chunked_prefill": True}
    graphs = (not engine["enforce_eager"] and not engine["cudagraph_mode"].endswith("NONE")
              and engine["prefix_caching"] and engine["chunked_prefill"])
    chosen = {k: engine["kwargs"][k] for k in wanted}
    checks.append({"name": "CUDA engine: CUDA graphs, prefix caching and chunked prefill", "value": engine,
                   "ok": chosen == wanted and graphs})
    return checks


if __name__ == "__main__":
    main()
