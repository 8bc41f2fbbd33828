"""Where an RL step's time goes: rollout / train / weight sync, per rollout, for the tiny and SmolLM2 configs.

Runs the real driver loop (`runtime.driver.train`: Ray actors, vLLM, torch trainer) a few rollouts per config
and reads its perf/* metrics. The first rollout includes warm-up, so the summary averages rollouts 1.. when
there are at least two.

    .venv/bin/python bench/step_time.py
    .venv/bin/python bench/step_time.py --configs tiny --num-rollout 5 --colocate
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name: (built-in model, prompts per rollout, samples per prompt, max response tokens)
CONFIGS = {
    "tiny": ("tiny-qwen3", 8, 8, 32),
    "smollm2": ("smollm2-135m-instruct", 4, 4, 32),
}
PARTS = [("rollout", "perf/rollout_time"), ("train", "perf/train_time"), ("sync", "perf/update_weights_time")]


def engine_config(name: str, cache: Path, **overrides):
    """The bench configuration `name` (see CONFIGS) on built-in model and data, materialized under `cache`."""
    from vime_engine.config import build_config
    from vime_engine.data.synthetic import materialize_builtin_dataset
    from vime_engine.models.builtin import materialize_builtin_model

    model, prompts, n, max_len = CONFIGS[name]
    return build_config([], **{
        "hf-checkpoint": str(materialize_builtin_model(model, cache / model)),
        "prompt-data": str(materialize_builtin_dataset("arithmetic", cache / "data")),
        "input-key": "question", "label-key": "answer", "apply-chat-template": True,
        "rollout-batch-size": prompts, "n-samples-per-prompt": n,
        "rollout-max-response-len": max_len, "global-batch-size": prompts * n, "micro-batch-size": n,
        "lr": 1e-5, "vllm-kv-cache-gb": 0.5,
        "custom-rm-path": str(REPO / "tests/support/tiny_task.py") + ":digit_share",
        **overrides,
    })


def main() -> None:
    from vime_engine.runtime.cluster import ray_cluster
    from vime_engine.runtime.driver import train

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    parser.add_argument("--num-rollout", type=int, default=3)
    parser.add_argument("--colocate", action="store_true", help="one actor for trainer and engine")
    args = parser.parse_args()

    with ray_cluster(num_cpus=4):
        for name in args.configs:
            _, prompts, n, max_len = CONFIGS[name]
            cfg = engine_config(name, args.cache, **{"num-rollout": args.num_rollout, "colocate": args.colocate,
                                                     "output-dir": str(args.cache / "steps")})
            history = train(cfg).history
            for row in history:
                parts = "  ".join(f"{part} {row[key]:7.3f} s" for part, key in PARTS)
                print(f"{name:8s} rollout {row['rollout_id']}: {parts}  ({row['perf/tokens_per_sec']:.0f} tok/s)")
            steady = history[1:] if len(history) > 1 else history
            means = {part: statistics.fmean(r[key] for r in steady) for part, key in PARTS}
            total = sum(means.values())
            split = "  ".join(f"{part} {s:.3f} s ({100 * s / total:.0f}%)" for part, s in means.items())
            print(f"{name:8s} mean step ({'colocated' if args.colocate else 'disaggregated'}, {prompts}x{n} samples, "
                  f"<= {max_len} tokens): {total:.3f} s = {split}", flush=True)


if __name__ == "__main__":
    main()
