"""Trainer group: bring-up time, seconds per `train_rollout` and per full-weights gather (what a weight sync
reads) with 1 and 2 data-parallel ranks, DDP (`--train-backend torch`) and FSDP2 (`fsdp`), on gloo.

The same synthetic rollout (8 prompts × 8 samples, prompts 16–48 and responses 8–64 tokens, tiny Qwen3) is
trained by a trainer group of one rank and of two, side by side in one run; each row is the median of
`--repeat` rollouts after one warm-up. On a 2-core machine two ranks share the two cores with nothing else, so
the ratio shows the cost of the all-reduce and the split work, not a scaling figure for real devices. One rank
is the same run on either backend, so it runs once.

    .venv/bin/python bench/trainer_group.py
    .venv/bin/python bench/trainer_group.py --ranks 1 2 --repeat 5 --model smollm2-135m-instruct
    .venv/bin/python bench/trainer_group.py --model smollm2-135m-instruct --weights-only   # no training
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def synthetic_rollout(group, vocab: int, prompts: int, n: int):
    from vime_engine.sample import Sample

    rng = random.Random(0)
    samples = []
    for g in range(prompts):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randrange(16, 48))]
        for _ in range(n):
            response = [rng.randrange(10, vocab) for _ in range(rng.randrange(8, 64))]
            samples.append(Sample(g, "", "", prompt, response, loss_mask=[1] * len(response),
                                  reward=float(rng.random() > 0.5)))
    log_probs = group.log_probs(samples)  # the rollout's own log-probs: on-policy, as after a weight sync
    offset = 0
    for s in samples:
        s.rollout_log_probs = log_probs[offset:offset + s.response_length].tolist()
        offset += s.response_length
    return samples


def median_seconds(call, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import ray

    from vime_engine.config import build_config
    from vime_engine.models.builtin import materialize_builtin_model
    from vime_engine.runtime.cluster import ray_cluster
    from vime_engine.devices.accelerator import CPU
    from vime_engine.runtime.trainer_group import TrainerGroup

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--backends", nargs="+", default=["torch", "fsdp"], choices=["torch", "fsdp"])
    parser.add_argument("--weights-only", action="store_true", help="time bring-up and the weights' gather only")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    args = parser.parse_args()

    model = materialize_builtin_model(args.model, args.cache / args.model)
    rows = {}
    with ray_cluster(num_cpus=max(4, max(args.ranks) + 1)):
        for backend, ranks in [(b, r) for b in args.backends for r in args.ranks
                               if r > 1 or b == args.backends[0]]:
            cfg = build_config([], **{
                "hf-checkpoint": str(model), "prompt-data": "unused", "rollout-batch-size": 8,
                "n-samples-per-prompt": 8, "global-batch-size": 32, "micro-batch-size": 4, "lr": 1e-5,
                "actor-num-gpus-per-node": ranks, "train-backend": backend,
            })
            start = time.perf_counter()
            group = TrainerGroup(cfg, CPU)
            ray.get([rank.__ray_ready__.remote() for rank in group.ranks])
            bring_up = time.perf_counter() - start
            trained = ""
            if not args.weights_only:
                vocab = ray.get(group.leader.__ray_call__.remote(lambda self: self.backend.model.config.vocab_size))
                samples = synthetic_rollout(group, vocab, 8, 8)
                group.train(samples)  # warm-up
                rows[backend, ranks] = median_seconds(lambda: group.train(samples), args.repeat)
                first = rows[args.backends[0], args.ranks[0]]
                trained = (f"  train_rollout {rows[backend, ranks]:7.3f} s "
                           f"({rows[backend, ranks] / first:.2f}x of the first row)")
            gathered = median_seconds(group.weights, args.repeat)
            print(f"{args.model:24s} {backend:5s} ranks {ranks}  bring-up {bring_up:6.1f} s{trained}  "
                  f"weights gathered {gathered:6.3f} s", flush=True)
            group.shutdown()


if __name__ == "__main__":
    main()
