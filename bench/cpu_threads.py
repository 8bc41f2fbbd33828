"""Torch threads of a CPU actor (VIMEFLOW_CPU_THREADS), measured on whole `vimeflow train` runs: the default share
of the cores against one thread, on a machine the run has to itself and on one where another process keeps a core
busy (as a second test worker, another run or a build would).

Each OpenMP region of a kernel (a matmul, vLLM's attention) waits for all of its threads, so when one thread loses
its core the whole layer waits for it to be scheduled again. Each variant is a fresh run of `--num-rollout` rollouts
(colocated, the CPU default); the table gives the medians of its generation and training seconds per rollout,
the first rollout left out (warm-up), and the ratio of each variant's step to the default's in the same condition.
The variants run in turns, `--repeat` times, so drift of a noisy machine spreads over all of them.

    .venv/bin/python bench/cpu_threads.py [--model tiny-qwen3|smollm2-135m-instruct] [--repeat 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

THREADS = {"default share": None, "1 thread": "1"}


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """Another process spinning on one core for the duration (none when `on` is false)."""
    if not on:
        yield
        return
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        yield
    finally:
        spinner.kill()
        spinner.join()


def run(config: Path, out: Path, threads: str | None) -> tuple[float, float]:
    """(median generation seconds, median training seconds) per rollout of one run, its first rollout left out."""
    env = {k: v for k, v in os.environ.items() if k != "VIMEFLOW_CPU_THREADS"}
    if threads is not None:
        env["VIMEFLOW_CPU_THREADS"] = threads
    subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", str(config), "--output-dir", str(out)],
                   cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return (statistics.median(r["perf/rollout_time"] for r in rows),
            statistics.median(r["perf/train_time"] for r in rows))


def main() -> None:
    import yaml

    from vime_engine.data.synthetic import materialize_builtin_dataset
    from vime_engine.models.builtin import materialize_builtin_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--num-rollout", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vimeflow-threads-") as tmp:
        tmp = Path(tmp)
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump({
            "hf-checkpoint": str(materialize_builtin_model(args.model, tmp / args.model)),
            "prompt-data": str(materialize_builtin_dataset("arithmetic", tmp / "data")),
            "input-key": "question", "label-key": "answer", "apply-chat-template": True, "rm-type": "gsm8k",
            "num-rollout": args.num_rollout, "rollout-batch-size": 8, "n-samples-per-prompt": 4,
            "rollout-max-response-len": 32, "rollout-temperature": 0.7, "micro-batch-size": 8,
            "vllm-kv-cache-gb": 0.5,
        }))
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for i in range(args.repeat):
            for condition in ("machine to itself", "one core busy"):
                for name, threads in THREADS.items():
                    with busy_core(condition == "one core busy"):
                        gen, train = run(config, tmp / f"out-{i}-{len(results)}", threads)
                    results.setdefault((condition, name), []).append((gen, train))
                    print(f"repeat {i} | {condition} | {name}: generation {gen:.2f} s, training {train:.2f} s",
                          flush=True)
    print(f"\nmedians of {args.repeat} runs, {args.model}, 8 prompts x 4 samples x 32 tokens "
          f"(cores: {os.cpu_count()}, load before: {os.getloadavg()[0]:.1f}):")
    print("| condition | threads | generation | training | step vs default share |")
    print("|---|---|---|---|---|")
    for (condition, name), runs in results.items():
        gen, train = (statistics.median(x) for x in zip(*runs))
        base = [statistics.median(x) for x in zip(*results[(condition, "default share")])]
        print(f"| {condition} | {name} | {gen:.2f} s | {train:.2f} s | {(gen + train) / sum(base):.2f}x |")


if __name__ == "__main__":
    main()
