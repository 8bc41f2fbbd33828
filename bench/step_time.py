"""Where an RL step's time goes: rollout / train / weight sync, per rollout, for the tiny and SmolLM2 configs.

Runs the real driver loop (`runtime.driver.train`: Ray actors, vLLM, torch trainer) a few rollouts per config
and reads its perf/* metrics. The first rollout includes warm-up, so the summary averages rollouts 1.. when
there are at least two.

`--placements` runs the same work under several placements in one process and prints each one's wall seconds per
rollout (generate + train + sync; under --async-rollout generation overlaps training, so its share is the wait
left) against the first placement's.

    .venv/bin/python bench/step_time.py
    .venv/bin/python bench/step_time.py --configs smollm2 --num-rollout 4 \
        --placements disaggregated broadcast colocated async
    .venv/bin/python bench/step_time.py --configs smollm2 --num-rollout 4 \
        --placements colocated-tp2 colocated-2x1 disaggregated-2x1
    .venv/bin/python bench/step_time.py --configs smollm2 --num-rollout 4 \
        --placements disaggregated server disaggregated-2 server-2
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


# placement: the engine flags it sets
PLACEMENTS = {
    "disaggregated": {"colocate": False},
    "broadcast": {"weight-sync": "broadcast"},
    "colocated": {"colocate": True},
    "async": {"async-rollout": True},
    # Two trainer ranks: one engine tensor parallel across both ranks' processes, an engine beside each rank, or
    # two engines of their own (vime's colocated layout against its two alternatives).
    "colocated-tp2": {"colocate": True, "actor-num-gpus-per-node": 2, "rollout-num-gpus-per-engine": 2},
    "colocated-2x1": {"colocate": True, "actor-num-gpus-per-node": 2},
    "disaggregated-2x1": {"colocate": False, "actor-num-gpus-per-node": 2, "rollout-num-gpus": 2},
    # vime's rollout service: `vllm serve` engines behind vllm-router, against in-process engines of their own.
    "server": {"rollout-mode": "server"},
    "disaggregated-2": {"colocate": False, "rollout-num-gpus": 2},
    "server-2": {"rollout-mode": "server", "rollout-num-gpus": 2},
}


def steady_parts(history: list[dict]) -> dict[str, float]:
    """Mean seconds of each part over the rollouts after the first (warm-up), when there are at least two."""
    steady = history[1:] if len(history) > 1 else history
    return {part: statistics.fmean(r[key] for r in steady) for part, key in PARTS}


def main() -> None:
    from vime_engine.runtime.cluster import ray_cluster
    from vime_engine.runtime.driver import train

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    parser.add_argument("--num-rollout", type=int, default=3)
    parser.add_argument("--placements", nargs="+", default=["disaggregated"], choices=list(PLACEMENTS))
    args = parser.parse_args()

    with ray_cluster(num_cpus=4):
        for name in args.configs:
            _, prompts, n, max_len = CONFIGS[name]
            totals = {}
            for placement in args.placements:
                cfg = engine_config(name, args.cache, **{"num-rollout": args.num_rollout, **PLACEMENTS[placement],
                                                         "output-dir": str(args.cache / f"steps-{placement}")})
                history = train(cfg).history
                for row in history:
                    parts = "  ".join(f"{part} {row[key]:7.3f} s" for part, key in PARTS)
                    print(f"{name:8s} {placement:13s} rollout {row['rollout_id']}: {parts}", flush=True)
                means = steady_parts(history)
                totals[placement] = sum(means.values())
                split = "  ".join(f"{part} {s:.3f} s ({100 * s / totals[placement]:.0f}%)" for part, s in means.items())
                print(f"{name:8s} {placement:13s} mean step ({prompts}x{n} samples, <= {max_len} tokens): "
                      f"{totals[placement]:.3f} s = {split}", flush=True)
            base = args.placements[0]
            for placement, total in totals.items():
                print(f"{name:8s} {placement:13s} {total:.3f} s per rollout, {total / totals[base]:.2f}x {base}")


if __name__ == "__main__":
    main()
