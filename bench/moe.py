"""The tiny Qwen3-MoE's training step and weight sync: torch backend vs Megatron at EP=1 vs Megatron at EP=2.

Each row is a real trainer group beside one vLLM engine on a private local Ray cluster (disaggregated, the weights
through Ray's object store, as a Megatron run places them), all in this one run: seconds per `train_rollout` of the
same synthetic rollout (8 prompts × 8 samples, prompts 16–48 and responses 8–64 tokens; the median of `--repeat`
after one warm-up) and seconds per weight sync into vLLM (the best of `--repeat` after one warm-up: the trainer's
HF-named weights, the experts gathered from both expert-parallel ranks at EP=2, through the object store into the
engine, its MoE layers repacked), each with its ratio to the torch row.

    .venv/bin/python bench/moe.py
    .venv/bin/python bench/moe.py --repeat 5 --rows torch megatron-ep2

On a 2-core machine two ranks share the two cores with the engine's idle process: EP=2 shows what the all_to_all
and the experts' gather cost, not a speed-up, which needs the experts on devices of their own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer_group import median_seconds, synthetic_rollout  # noqa: E402

ROWS = {
    "torch": {"train-backend": "torch"},
    "megatron-ep1": {"train-backend": "megatron"},
    "megatron-ep2": {"train-backend": "megatron", "expert-model-parallel-size": 2, "actor-num-gpus-per-node": 2},
}


def main() -> None:
    from vime_engine.config import build_config
    from vime_engine.devices.accelerator import CPU
    from vime_engine.models.builtin import materialize_builtin_model
    from vime_engine.runtime.cluster import ray_cluster
    from vime_engine.runtime.workers import Workers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    args = parser.parse_args()

    model = materialize_builtin_model("tiny-qwen3-moe", args.cache / "tiny-qwen3-moe")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    results: dict[str, tuple[float, float]] = {}
    with ray_cluster(num_cpus=4):
        for row in args.rows:
            cfg = build_config([], **{
                "hf-checkpoint": str(model), "prompt-data": "unused", "rollout-batch-size": 8,
                "n-samples-per-prompt": 8, "global-batch-size": 32, "micro-batch-size": 4, "lr": 1e-5,
                "colocate": False, "weight-sync": "object_store", "vllm-kv-cache-gb": 0.25, **ROWS[row],
            })
            with Workers(cfg, CPU) as workers:
                samples = synthetic_rollout(workers.trainer, vocab, 8, 8)
                workers.train(samples)  # warm-up
                train = median_seconds(lambda: workers.train(samples), args.repeat)
                workers.sync_weights(0)  # warm-up
                best = float("inf")
                for version in range(1, args.repeat + 1):
                    start = time.perf_counter()
                    workers.sync_weights(version)
                    best = min(best, time.perf_counter() - start)
            results[row] = train, best
            base_train, base_sync = results[args.rows[0]]
            print(f"tiny-qwen3-moe {row:13s} train_rollout {train:7.3f} s ({train / base_train:.2f}x)  "
                  f"weight sync {best:6.3f} s ({best / base_sync:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
