"""Prepared check of the trainer half on a lent GPU, for machines without a CUDA vLLM (a few minutes):
`python tests/gpu/check_trainers.py [--device cuda]`.

tests/gpu/check_cuda.py needs vLLM's CUDA wheel, which the device tool cannot carry (its working tree is capped at
64 MiB); this check runs everything of the trainers that needs no engine, on the real CUDA kernels. Needs torch,
transformers, megatron-core 0.19.2 (no Transformer Engine: Megatron's local layers), pydantic and this checkout on
the path. Each phase runs in its own process (Megatron owns torch.distributed's default group):
  rollout   the tiny Qwen3 and tiny Qwen3-MoE generate a GRPO rollout with transformers (bf16, sampled, the
            generation's own log-probs as the rollout's, the share of digits as the reward), and a SmolLM2-135M-shaped model (random weights: the
            figures need its shapes, not its knowledge) gets a fixed 32 x 256-token rollout;
  torch     the torch backend: fp32 log-probs of the tiny models, a bf16 step on each rollout, and the colocated
            hand-back of its memory (runtime.memory_turns.HostOffload) on the SmolLM2-shaped model;
  megatron  the Megatron backend: fp32 log-probs against the torch backend's, a bf16 step on each rollout, routing
            replay (R2) on the tiny MoE, and the HF weight stream's throughput.
Prints one JSON line of figures and checks; exits 1 when a check fails:
  - fp32: Megatron's log-probs within tests/support/tolerance.py's bound of the torch backend's, dense and MoE
    (the bound the CPU suite uses, now on CUDA's kernels);
  - bf16 |train - rollout| log-prob difference <= 0.01 for each backend and tiny model (the rollout's log-probs
    come from transformers' KV-cached generation here, not from vLLM);
  - the hand-back frees >= 90% of the trainer's device memory and restores its weights and Adam state bit for bit;
  - routing replay: train/routing_replay_match reported and in (0, 1].
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
LOGPROB_DIFF_LIMIT = 0.01
FREED_SHARE_MIN = 0.9
SMOL_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def _cfg(model: Path, backend: str, dtype: str, device: str, **overrides):
    from vime_engine.config import from_flat

    values = {"hf_checkpoint": str(model), "prompt_data": "unused.jsonl", "dtype": dtype, "train_backend": backend,
              "rollout_batch_size": 8, "n_samples_per_prompt": 4, "global_batch_size": 32, "micro_batch_size": 8,
              "rollout_max_response_len": 256, "lr": 1e-6, "num_rollout": 1, "device": device, "seed": 7}
    return from_flat({**values, **overrides})


def _timed(fn):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _build_smol(dest: Path, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vime_engine.models.builtin import _tiny_tokenizer

    tokenizer = _tiny_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**SMOL_SHAPE, "num_hidden_layers": layers}, dtype="float32"))
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest


def _generated_rollout(model: Path, device: str, seed: int):
    """8 prompts x 4 samples of up to 48 tokens from transformers' bf16 generation on `device`, the sampled tokens'
    log-probs (temperature 1, no top-k / top-p) as the rollout's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vime_engine.sample import Sample

    tok = AutoTokenizer.from_pretrained(model)
    llm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device).eval()
    samples = []
    for g in range(8):
        text = tok.apply_chat_template([{"role": "user", "content": f"What is {g} + {g + 3}?"}],
                                       add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        torch.manual_seed(seed + g)
        out = llm.generate(torch.tensor([prompt] * 4, device=device), do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=48, output_logits=True, return_dict_in_generate=True,
                           pad_token_id=tok.pad_token_id)
        logits = torch.stack(out.logits, dim=1).float()  # [4, steps, vocab]
        generated = out.sequences[:, len(prompt):]
        lps = torch.log_softmax(logits, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        for j in range(4):
            tokens = generated[j].tolist()
            length = next((i + 1 for i, t in enumerate(tokens) if t == tok.eos_token_id), len(tokens))
            text = tok.decode(tokens[:length], skip_special_tokens=True)
            samples.append(Sample(
                group_index=g, prompt="", label="", prompt_tokens=prompt, response_tokens=tokens[:length],
                response=text, rollout_log_probs=lps[j, :length].tolist(), loss_mask=[1] * length,
                reward=sum(c.isdigit() for c in text) / max(len(text), 1), status="completed"))
    return samples


def _fixed_rollout(vocab_size: int, prompt_len: int = 64, response_len: int = 192):
    import random

    from vime_engine.sample import Sample

    rng = random.Random(0)
    samples = []
    for g in range(8):
        prompt = [rng.randrange(3, vocab_size) for _ in range(prompt_len)]
        for j in range(4):
            response = [rng.randrange(3, vocab_size) for _ in range(response_len)]
            samples.append(Sample(group_index=g, prompt="", label="", prompt_tokens=prompt, response_tokens=response,
                                  rollout_log_probs=[-10.0] * response_len, loss_mask=[1] * response_len,
                                  reward=float((g + j) % 2), status="completed"))
    return samples


def phase_rollout(work: Path, device: str, smol_layers: int) -> None:
    from vime_engine.models.builtin import materialize_builtin_model

    models = {"dense": materialize_builtin_model("tiny-qwen3", work / "tiny-qwen3"),
              "moe": materialize_builtin_model("tiny-qwen3-moe", work / "tiny-qwen3-moe"),
              "smol": _build_smol(work / "smol-shaped", smol_layers)}
    rollouts = {name: _generated_rollout(models[name], device, seed=0) for name in ("dense", "moe")}
    rollouts["smol"] = _fixed_rollout(SMOL_SHAPE["vocab_size"])
    (work / "rollout.pkl").write_bytes(pickle.dumps({"models": models, "rollouts": rollouts}))


def phase_torch(work: Path, device: str) -> None:
    import torch

    from vime_engine.runtime.memory_turns import HostOffload
    from vime_engine.train.torch_backend import TorchTrainBackend

    data = pickle.loads((work / "rollout.pkl").read_bytes())
    out = {}
    for name in ("dense", "moe"):
        model, samples = data["models"][name], data["rollouts"][name]
        out[f"{name}/fp32_log_probs"] = TorchTrainBackend(_cfg(model, "torch", "float32", device),
                                                          device=device).log_probs(samples).float().cpu()
        metrics, step_s = _timed(lambda: TorchTrainBackend(_cfg(model, "torch", "bfloat16", device),
                                                           device=device).train_rollout(samples))
        out[f"{name}/bf16"] = {**metrics, "step_s": step_s}
    trainer = TorchTrainBackend(_cfg(data["models"]["smol"], "torch", "bfloat16", device), device=device)
    samples = data["rollouts"]["smol"]
    steps = [_timed(lambda: trainer.train_rollout(samples))[1] for _ in range(2)]
    out["smol/bf16_step_s"] = steps
    if device != "cpu":
        out["smol/hand_back"] = _hand_back(trainer, HostOffload(trainer.model, trainer.optimizer, device))
    (work / "torch.pkl").write_bytes(pickle.dumps(out))


def _hand_back(trainer, offload) -> dict:
    """The trainer's device memory released to host and taken back: bytes freed, seconds, and whether every weight
    and Adam state tensor came back bit for bit."""
    import torch

    def snapshot():
        state = {f"p{i}": p.detach().cpu().clone() for i, p in enumerate(trainer.model.parameters())}
        for i, s in enumerate(trainer.optimizer.state.values()):
            state.update({f"s{i}.{k}": v.detach().cpu().clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
        return state

    before = snapshot()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    _, release_s = _timed(offload.release)
    after_release = torch.cuda.memory_allocated()
    _, restore_s = _timed(offload.restore)
    after = snapshot()
    return {"held_bytes": held, "held_after_release_bytes": after_release,
            "freed_share": (held - after_release) / held, "release_s": release_s, "restore_s": restore_s,
            "bit_identical": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)}


def phase_megatron(work: Path, device: str) -> None:
    from tests.support.tolerance import fp32_tolerance, model_depth
    from vime_engine.train.megatron_backend import MegatronTrainBackend

    data = pickle.loads((work / "rollout.pkl").read_bytes())
    theirs = pickle.loads((work / "torch.pkl").read_bytes())
    out = {}
    for name in ("dense", "moe"):
        model, samples = data["models"][name], data["rollouts"][name]
        config = json.loads((model / "config.json").read_text())
        ours = MegatronTrainBackend(_cfg(model, "megatron", "float32", device), device=device).log_probs(samples)
        reference = theirs[f"{name}/fp32_log_probs"]
        bound = fp32_tolerance(reference, config["hidden_size"], model_depth(config["num_hidden_layers"]))
        gap = (ours.float().cpu() - reference).abs()
        out[f"{name}/fp32_vs_torch"] = {"max_abs": gap.max().item(), "max_share_of_bound": (gap / bound).max().item()}
        metrics, step_s = _timed(lambda: MegatronTrainBackend(_cfg(model, "megatron", "bfloat16", device),
                                                              device=device).train_rollout(samples))
        out[f"{name}/bf16"] = {**metrics, "step_s": step_s}
    moe, samples = data["models"]["moe"], data["rollouts"]["moe"]
    replaying = MegatronTrainBackend(_cfg(moe, "megatron", "bfloat16", device, use_routing_replay=True), device=device)
    out["moe/bf16_routing_replay"] = replaying.train_rollout(samples)
    trainer = MegatronTrainBackend(_cfg(data["models"]["smol"], "megatron", "bfloat16", device), device=device)
    samples = data["rollouts"]["smol"]
    out["smol/bf16_step_s"] = [_timed(lambda: trainer.train_rollout(samples))[1] for _ in range(2)]
    weights, stream_s = _timed(lambda: [(n, t.clone()) for n, t in trainer.named_weights()])
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    out["smol/weight_stream"] = {"bytes": nbytes, "seconds": stream_s, "GBps": nbytes / stream_s / 1e9}
    (work / "megatron.pkl").write_bytes(pickle.dumps(out))


def _checks(t: dict, m: dict) -> list[dict]:
    checks = []
    for name in ("dense", "moe"):
        share = m[f"{name}/fp32_vs_torch"]["max_share_of_bound"]
        checks.append({"name": f"{name}: fp32 Megatron log-probs within the fp32 bound of the torch backend's",
                       "value": share, "ok": share <= 1.0})
        for backend, result in (("torch", t), ("megatron", m)):
            diff = result[f"{name}/bf16"]["train/train_rollout_logprob_abs_diff"]
            checks.append({"name": f"{name}: {backend} bf16 |train - rollout| log-prob <= {LOGPROB_DIFF_LIMIT}",
                           "value": diff, "ok": diff <= LOGPROB_DIFF_LIMIT})
    match = m["moe/bf16_routing_replay"].get("train/routing_replay_match")
    checks.append({"name": "moe: Megatron routing replay reports its match share in (0, 1]", "value": match,
                   "ok": match is not None and 0 < match <= 1})
    if "smol/hand_back" in t:
        hb = t["smol/hand_back"]
        checks.append({"name": f"hand-back frees >= {FREED_SHARE_MIN:.0%} of the trainer's device memory",
                       "value": hb["freed_share"], "ok": hb["freed_share"] >= FREED_SHARE_MIN})
        checks.append({"name": "hand-back restores weights and Adam state bit for bit", "value": hb["bit_identical"],
                       "ok": hb["bit_identical"]})
    return checks


def _summary(t: dict, m: dict) -> dict:
    keys = ("train/train_rollout_logprob_abs_diff", "train/pg_loss", "train/grad_norm", "step_s")
    figures = {}
    for name in ("dense", "moe"):
        for backend, result in (("torch", t), ("megatron", m)):
            figures[f"{name}/{backend}/bf16"] = {k: result[f"{name}/bf16"].get(k) for k in keys}
        figures[f"{name}/megatron_fp32_vs_torch"] = m[f"{name}/fp32_vs_torch"]
    figures["moe/megatron/bf16_routing_replay"] = {
        k: v for k, v in m["moe/bf16_routing_replay"].items() if "routing" in k or "logprob" in k}
    figures["smol/torch/bf16_step_s"] = t["smol/bf16_step_s"]
    figures["smol/megatron/bf16_step_s"] = m["smol/bf16_step_s"]
    figures["smol/megatron/weight_stream"] = m["smol/weight_stream"]
    figures["smol/torch/hand_back"] = t.get("smol/hand_back")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", help="cuda (the check); cpu runs the same phases here")
    parser.add_argument("--smol-layers", type=int, default=SMOL_SHAPE["num_hidden_layers"],
                        help="layers of the SmolLM2-shaped model (fewer for a dry run on CPU)")
    parser.add_argument("--phase", choices=["rollout", "torch", "megatron"])
    parser.add_argument("--work")
    args = parser.parse_args()
    if args.phase:
        if args.phase == "rollout":
            phase_rollout(Path(args.work), args.device, args.smol_layers)
        else:
            {"torch": phase_torch, "megatron": phase_megatron}[args.phase](Path(args.work), args.device)
        return
    import torch

    if args.device == "cuda":
        assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    work = Path(tempfile.mkdtemp(prefix="vimeflow-trainer-check-"))
    seconds = {}
    for phase in ("rollout", "torch", "megatron"):
        start = time.perf_counter()
        argv = [sys.executable, __file__, "--phase", phase, "--work", str(work), "--device", args.device,
                "--smol-layers", str(args.smol_layers)]
        if subprocess.run(argv, cwd=ROOT).returncode != 0:
            raise SystemExit(f"{phase} phase failed")
        seconds[phase] = round(time.perf_counter() - start, 1)
    t, m = (pickle.loads((work / f"{p}.pkl").read_bytes()) for p in ("torch", "megatron"))
    checks = _checks(t, m)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(json.dumps({"device": device_name, "torch": torch.__version__, "phase_seconds": seconds,
                      "figures": _summary(t, m), "checks": checks}, default=str))
    failed = [c["name"] for c in checks if c["ok"] is False]
    if failed:
        raise SystemExit(f"failed checks: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
