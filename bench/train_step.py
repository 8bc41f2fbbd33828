"""The trainer's time for one rollout (`train_rollout`), this tree against a baseline commit, side by side.

Builds a fixed rollout of synthetic samples (prompt and response lengths like the demo's) and times the torch
backend's `train_rollout` on it, each case in a fresh process so neither tree's import state leaks into the
other. The baseline tree is `git archive` of `--base` unpacked under the cache (the checkout is not touched).
Per case: the median of the rollouts after the first (warm-up), and the ratio this tree / baseline. Both the
wall time and the process's CPU time are taken, torch on one thread: on a shared machine (load far above the
core count) the CPU time is the figure that compares; the wall time says how loaded the machine was.

    .venv/bin/python bench/train_step.py --base HEAD~3
    .venv/bin/python bench/train_step.py --base HEAD --cases smollm2-64 --flags micro-batch-size=4
    .venv/bin/python bench/train_step.py --base HEAD --cases demo --base-flags micro-batch-size=8 --flags
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name: (built-in model, samples, prompt tokens, most response tokens, share of responses at that cap)
# SmolLM2's prompts are the built-in arithmetic problems in its chat template (44 tokens); its responses nearly all
# reach a 64-token cap, and a quarter of them a 512-token one.
CASES = {
    "tiny": ("tiny-qwen3", 64, 24, 32, 0.25),
    "smollm2-64": ("smollm2-135m-instruct", 16, 44, 64, 1.0),
    "smollm2-512": ("smollm2-135m-instruct", 16, 44, 512, 0.25),
    "demo": ("smollm2-135m-instruct", 32, 44, 32, 0.25),  # the default run's rollout (configs/demo-engine.yaml)
}


def samples(name: str, vocab: int):
    """Groups of 4 responses to one prompt (GRPO's n samples): the case's share at the cap, the rest of random
    shorter lengths."""
    from vime_engine.sample import Sample

    _, count, prompt_len, cap, capped = CASES[name]
    rng = random.Random(0)
    out = []
    for i in range(count):
        length = cap if rng.random() < capped else rng.randrange(max(cap // 8, 4), max(cap // 2, 8))
        if i % 4 == 0:
            prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        response = [rng.randrange(10, vocab) for _ in range(length)]
        out.append(Sample(i // 4, "", "", prompt, response, rollout_log_probs=[-1.0] * length,
                          loss_mask=[1] * length, reward=float(rng.random() < 0.5)))
    return out


def run_case(name: str, rollouts: int, flags: dict[str, str], cache: Path) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each `train_rollout` of case `name` in this process's tree."""
    import torch

    torch.set_num_threads(1)
    from vime_engine.config import build_config
    from vime_engine.models.builtin import materialize_builtin_model
    from vime_engine.train.torch_backend import TorchTrainBackend

    model = CASES[name][0]
    model_dir = materialize_builtin_model(model, cache / model)
    _, count, *_ = CASES[name]
    cfg = build_config([], **{"hf-checkpoint": str(model_dir), "prompt-data": "unused",
                              "rollout-batch-size": count // 4, "n-samples-per-prompt": 4, "lr": 1e-6, **flags})
    torch.manual_seed(0)
    backend = TorchTrainBackend(cfg)
    batch = samples(name, backend.model.config.vocab_size)
    times = []
    for _ in range(rollouts):
        wall, cpu = time.perf_counter(), time.process_time()
        backend.train_rollout(batch)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def _child(tree: Path, name: str, rollouts: int, flags: dict[str, str], cache: Path) -> list[list[float]]:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2]);"
            "from train_step import run_case; from pathlib import Path;"
            "print(json.dumps(run_case(sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]), Path(sys.argv[6]))))")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code, str(tree), str(REPO / "bench"), name, str(rollouts),
                          json.dumps(flags), str(cache)], env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{name} in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _medians(times: list[list[float]]) -> tuple[float, float]:
    steady = times[1:] if len(times) > 1 else times
    return statistics.median(t[0] for t in steady), statistics.median(t[1] for t in steady)


def _baseline_tree(rev: str, cache: Path) -> Path:
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    tree = cache / f"tree-{sha[:12]}"
    if not (tree / "vime_engine").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _flags(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = True if value == "" else (int(value) if value.isdigit() else value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision of the baseline")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--flags", nargs="*", default=[], help="flag=value for both trees, e.g. micro-batch-size=4")
    parser.add_argument("--base-flags", nargs="*", default=None, help="flags for the baseline only (default: --flags)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    args = parser.parse_args()

    base = _baseline_tree(args.base, args.cache)
    flags = _flags(args.flags)
    base_flags = flags if args.base_flags is None else _flags(args.base_flags)
    for name in args.cases:
        before = _child(base, name, args.rollouts, base_flags, args.cache)
        after = _child(REPO, name, args.rollouts, flags, args.cache)
        (bw, bc), (aw, ac) = (_medians(t) for t in (before, after))
        print(f"{name:12s} train_rollout CPU s: base {args.base} {bc:7.2f}  this tree {ac:7.2f}  ratio {ac / bc:.2f}x"
              f"  | wall s: {bw:7.2f} vs {aw:7.2f}  (base {base_flags or 'defaults'}, this {flags or 'defaults'})",
              flush=True)


if __name__ == "__main__":
    main()
