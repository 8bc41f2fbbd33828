"""The train/rollout log-prob gap of the tiny MoE with and without replaying the rollout's routing (R3,
--use-rollout-routing-replay), where the two sides' arithmetic or weights differ.

vLLM on CPU cannot return the experts it routed each token to, so the rollout side here is a forward of the engine's
weights (the trainer's own code, routing recorded by vime_engine.train.routing_replay): it samples each response
(HF `generate`, temperature 1) and reports every sampled token's log-prob and every token's experts. The trainer
then computes the same tokens' log-probs in fp32 at its weights, routing freely or replaying the rollout's record.
Cases:
  bf16-engine  the rollout side in bf16, the trainer in fp32, the same weights (an accelerator run's bf16 engine)
  stale-step   both fp32, the trainer one optimizer step ahead of the rollout's weights (partial / async rollout)
(Both fp32 at the same weights, the gap is 0 either way: the trainer's forward against itself.)
Prints, per case, the mean |trainer - rollout| log-prob over the response tokens routing freely and replaying, their
ratio, and the share of token × MoE-layer routing decisions on which the trainer's own choice equals the rollout's.

    .venv/bin/python bench/routing_replay_gap.py [--prompts 8] [--samples 4] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3, help="the stale case's optimizer step")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("VIMEFLOW_CACHE", str(REPO / ".cache" / "vimeflow"))

    import torch

    from vime_engine.assets import resolve_dataset, resolve_model
    from vime_engine.config import build_config
    from vime_engine.data.datasets import read_prompt_rows
    from vime_engine.sample import Sample
    from vime_engine.train.routing_replay import RoutingPass, same_experts
    from vime_engine.train.torch_backend import TorchTrainBackend

    torch.manual_seed(0)
    model = resolve_model("builtin://tiny-qwen3-moe")
    rows = read_prompt_rows(resolve_dataset("builtin://arithmetic"), "question", "answer", None, "--")[:args.prompts]
    base = {"hf-checkpoint": model, "prompt-data": "unused", "rollout-batch-size": args.prompts,
            "n-samples-per-prompt": args.samples, "lr": args.lr}

    def backend(**flags) -> TorchTrainBackend:
        return TorchTrainBackend(build_config([], **base, **flags))

    def rollout(engine: TorchTrainBackend) -> list[Sample]:
        """Sampled responses with the engine's log-probs and routing, as an R3 engine returns them."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        samples = []
        for group, row in enumerate(rows):
            prompt = tokenizer(row.record.prompt, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                out = engine.model.generate(torch.tensor([prompt] * args.samples), do_sample=True, temperature=1.0,
                                            top_k=0, max_new_tokens=args.max_new_tokens, min_new_tokens=2,
                                            pad_token_id=tokenizer.pad_token_id or 0)
            samples += [Sample(group, "", "", prompt, seq[len(prompt):].tolist(), reward=float(j % 2))
                        for j, seq in enumerate(out)]  # rewards that differ within each group: a gradient
        recording = RoutingPass()
        with torch.no_grad():
            log_probs = engine._forward(engine.model, [[s] for s in samples], with_entropy=False,
                                        routing=recording)[0].float()
        for s, lp, record in zip(samples, torch.split(log_probs, [s.response_length for s in samples]),
                                 recording.records()):
            s.rollout_log_probs, s.loss_mask, s.rollout_routed_experts = lp.tolist(), [1] * len(lp), record.numpy()
        return samples

    def gaps(trainer: TorchTrainBackend, samples: list[Sample]) -> tuple[float, float, float]:
        rows_ = [[s] for s in samples]
        rollout_lp = torch.tensor([x for s in samples for x in s.rollout_log_probs])
        with torch.no_grad():
            free = RoutingPass()
            free_lp = trainer._forward(trainer.model, rows_, with_entropy=False, routing=free)[0]
            replayed = trainer._forward(trainer.model, rows_, with_entropy=False, routing=RoutingPass(
                [torch.as_tensor(s.rollout_routed_experts) for s in samples]))[0]
        agree = torch.cat([same_experts(mine[:, layer], torch.as_tensor(s.rollout_routed_experts)[:, layer])
                           for s, mine in zip(samples, free.records()) for layer in moe_layers(trainer)])
        return ((free_lp - rollout_lp).abs().mean().item(), (replayed - rollout_lp).abs().mean().item(),
                agree.float().mean().item())

    def moe_layers(trainer: TorchTrainBackend) -> list[int]:
        from vime_engine.train.routing_replay import moe_routers

        return sorted(moe_routers(trainer.model).values())

    start = time.perf_counter()
    fp32 = backend()
    cases = {}
    samples = rollout(backend(dtype="bfloat16"))
    cases["bf16-engine"] = gaps(fp32, samples)
    samples = rollout(fp32)
    stepped = backend()
    stepped.train_rollout(rollout(stepped))  # one optimizer step on a rollout of its own
    cases["stale-step"] = gaps(stepped, samples)

    tokens = sum(s.response_length for s in samples)
    print(f"tiny-qwen3-moe, {args.prompts} prompts x {args.samples} samples, {tokens} response tokens "
          f"(stale-step: lr {args.lr}), {time.perf_counter() - start:.0f} s")
    print(f"{'case':<12} {'gap free':>10} {'gap replay':>11} {'replay/free':>12} {'routing agrees':>15}")
    for name, (free, replayed, agree) in cases.items():
        print(f"{name:<12} {free:>10.3e} {replayed:>11.3e} {replayed / free:>12.3f} {agree:>15.3f}")


if __name__ == "__main__":
    main()
