"""vimeflow against TRL's `GRPOTrainer` on the same work: model weights, prompts, batch, sampling, reward.

Each case runs vimeflow's real driver loop (Ray actors, vLLM, torch trainer; bench/step_time.py's configuration)
and TRL 1.16's `GRPOTrainer` (in its own venv, `.venv-trl`, made by scripts/ensure-venv-trl: TRL is a peer we
measure, not a dependency) for `--num-rollout` rollouts, and prints the per-rollout median excluding the first
(warm-up), split into generation / training / weight sync, and the ratio vimeflow / TRL.

Same work on both sides: the built-in model's weights (bench/step_time.py materialises them), the built-in
arithmetic prompts through the model's chat template, n samples per prompt at temperature 1 up to the response
cap, the digit-share reward, one optimizer step per rollout over all its samples (no reference model, no KL),
fp32 on CPU. TRL generates with `transformers` `generate`; its split is taken by timing its generation-and-scoring
method inside each step (training = step - that; it has no weight sync: one model does both).

    .venv/bin/python bench/peer_trl.py                      # all cases
    .venv/bin/python bench/peer_trl.py --cases tiny --num-rollout 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"

# name: (bench/step_time.py config, prompts per rollout, samples per prompt, response cap)
CASES = {
    "smollm2-64": ("smollm2", 4, 4, 64),
    "smollm2-512": ("smollm2", 4, 4, 512),
    "tiny": ("tiny", 8, 8, 32),
}
GOALS = {"smollm2-64": 0.5, "smollm2-512": 0.3, "tiny": 0.8}  # issue 29's raised goals
LR = 1e-5


def run_vimeflow(name: str, num_rollout: int, cache: Path) -> list[dict[str, float]]:
    sys.path.insert(0, str(REPO / "bench"))
    from step_time import engine_config

    from vime_engine.runtime.cluster import ray_cluster
    from vime_engine.runtime.driver import train

    config, prompts, n, cap = CASES[name]
    cfg = engine_config(config, cache, **{
        "num-rollout": num_rollout, "rollout-batch-size": prompts, "n-samples-per-prompt": n,
        "rollout-max-response-len": cap, "global-batch-size": prompts * n, "lr": LR,
        "micro-batch-size": None,  # vimeflow's default (micro-batches by token budget), not step_time.py's choice
        "output-dir": str(cache / f"peer-{name}"),
    })
    with ray_cluster(num_cpus=4):
        history = train(cfg).history
    return [{"generation": r["perf/rollout_time"], "training": r["perf/train_time"],
             "sync": r["perf/update_weights_time"]} for r in history]


def run_trl(name: str, num_rollout: int, cache: Path) -> list[dict[str, float]]:
    """TRL's rollouts in its own venv (this file, `--trl-worker`), on the files vimeflow's run materialised."""
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run scripts/ensure-venv-trl first")
    config, *_ = CASES[name]
    sys.path.insert(0, str(REPO / "bench"))
    from step_time import CONFIGS

    model_dir = cache / CONFIGS[config][0]
    out = subprocess.run(
        [str(TRL_PYTHON), __file__, "--trl-worker", name, "--num-rollout", str(num_rollout), "--cache", str(cache),
         "--model-dir", str(model_dir)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""},
    )
    if out.returncode != 0:
        raise RuntimeError(f"TRL run of {name} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def trl_worker(name: str, num_rollout: int, cache: Path, model_dir: Path) -> None:
    """Runs inside .venv-trl: GRPOTrainer for `num_rollout` steps; prints each step's split as JSON."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import importlib.util

    # The same reward as vimeflow's run: its module is pure Python (the package's __init__ needs math-verify).
    spec = importlib.util.spec_from_file_location("digit_share", REPO / "vime_engine/rewards/digit_share.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    digit_share = module.digit_share

    _, prompts, n, cap = CASES[name]
    rows = [json.loads(line) for line in (cache / "data" / "arithmetic.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}]}
                                 for r in rows[: prompts * num_rollout]])

    def reward(completions, **_):
        return [digit_share(c[-1]["content"] if isinstance(c, list) else c, "") for c in completions]

    args = GRPOConfig(
        output_dir=str(cache / f"trl-{name}"), per_device_train_batch_size=prompts * n, num_generations=n,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, max_completion_length=cap,
        temperature=1.0, top_p=1.0, beta=0.0, learning_rate=LR, max_steps=num_rollout, logging_steps=1,
        report_to="none", use_cpu=True, bf16=False, fp16=False, save_strategy="no", seed=0, shuffle_dataset=False,
        loss_type="grpo", lr_scheduler_type="constant", dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    steps: list[dict[str, float]] = []
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        result = generate(*a, **kw)
        steps[-1]["generation"] += time.perf_counter() - start
        return result

    trainer._generate_and_score_completions = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            steps.append({"generation": 0.0, "training": 0.0, "sync": 0.0, "_start": time.perf_counter()})

        def on_step_end(self, *_, **__):
            step = steps[-1]
            step["training"] = time.perf_counter() - step.pop("_start") - step["generation"]

    trainer.add_callback(StepTimer())
    trainer.train()
    print(json.dumps(steps))


def _median(history: list[dict[str, float]]) -> dict[str, float]:
    steady = history[1:] if len(history) > 1 else history
    parts = {part: statistics.median(r[part] for r in steady) for part in ("generation", "training", "sync")}
    parts["total"] = statistics.median(sum(r[p] for p in ("generation", "training", "sync")) for r in steady)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--num-rollout", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    parser.add_argument("--trl-worker", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker, args.num_rollout, args.cache, args.model_dir)
        return

    print("| case | side | total s | generation s | training s | sync s | vimeflow / TRL | goal |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        ours = _median(run_vimeflow(name, args.num_rollout, args.cache))
        theirs = _median(run_trl(name, args.num_rollout, args.cache))
        ratio = ours["total"] / theirs["total"]
        for side, m in (("vimeflow", ours), ("TRL", theirs)):
            cells = " | ".join(f"{m[p]:.2f}" for p in ("total", "generation", "training", "sync"))
            tail = f"{ratio:.2f}x | <= {GOALS[name]}x" if side == "vimeflow" else " | "
            print(f"| {name} | {side} | {cells} | {tail} |", flush=True)


if __name__ == "__main__":
    main()
