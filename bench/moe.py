"""The tiny Qwen3-MoE's training step and weight sync: torch backend vs Megatron at EP=1 vs Megatron at EP=2.

All in this one run, on a private local Ray cluster:
- train: the three trainer groups (1, 1 and 2 ranks) alive side by side, each timed on the same synthetic rollout
  (8 prompts × 8 samples, prompts 16–48 and responses 8–64 tokens) in turns, round after round, so that load from
  elsewhere falls on all rows alike; the median of `--repeat` rounds after one warm-up;
- sync: each row's trainer group beside one vLLM engine (disaggregated, the weights through Ray's object store, as a
  Megatron run places them), the best of `--repeat` syncs after one warm-up: the trainer's HF-named weights (at EP=2
  the experts gathered from both ranks) into the engine, its MoE layers repacked.
Each figure with its ratio to the first row.

    .venv/bin/python bench/moe.py
    .venv/bin/python bench/moe.py --repeat 7 --rows torch megatron-ep2

On a 2-core machine two ranks share the two cores: EP=2 shows what the all_to_all and the experts' gather cost or
save against one process doing all the work, not the speed-up of experts on devices of their own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer_group import synthetic_rollout  # noqa: E402

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
    from vime_engine.runtime.trainer_group import TrainerGroup
    from vime_engine.runtime.workers import Workers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    args = parser.parse_args()

    model = materialize_builtin_model("tiny-qwen3-moe", args.cache / "tiny-qwen3-moe")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]

    def config(row: str):
        return build_config([], **{
            "hf-checkpoint": str(model), "prompt-data": "unused", "rollout-batch-size": 8, "n-samples-per-prompt": 8,
            "global-batch-size": 32, "micro-batch-size": 4, "lr": 1e-5, "colocate": False,
            "weight-sync": "object_store", "vllm-kv-cache-gb": 0.25, **ROWS[row],
        })

    with ray_cluster(num_cpus=6):
        groups = {row: TrainerGroup(config(row), CPU) for row in args.rows}
        samples = synthetic_rollout(groups[args.rows[0]], vocab, 8, 8)
        times: dict[str, list[float]] = {row: [] for row in args.rows}
        for round_ in range(args.repeat + 1):  # round 0 warms up
            for row, group in groups.items():
                start = time.perf_counter()
                group.train(samples)
                if round_:
                    times[row].append(time.perf_counter() - start)
        for group in groups.values():
            group.shutdown()
        syncs = {}
        for row in args.rows:
            with Workers(config(row), CPU) as workers:
                workers.sync_weights(0)  # warm-up
                best = float("inf")
                for version in range(1, args.repeat + 1):
                    start = time.perf_counter()
                    workers.sync_weights(version)
                    best = min(best, time.perf_counter() - start)
                syncs[row] = best
    first = args.rows[0]
    for row in args.rows:
        train = statistics.median(times[row])
        base = statistics.median(times[first])
        print(f"tiny-qwen3-moe {row:13s} train_rollout {train:7.3f} s ({train / base:.2f}x)  "
              f"weight sync {syncs[row]:6.3f} s ({syncs[row] / syncs[first]:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
