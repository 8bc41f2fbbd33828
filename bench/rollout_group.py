"""The rollout group: M=1 vs M=2 vLLM engines, in one script on one private Ray cluster.

For each M (`--engines`), the real `Workers` (one trainer rank, M engine actors of `--rollout-num-gpus-per-engine`
1) on the built-in model: after a warm-up rollout, the best of `--repeat` of
- rollout: one `generate` of `--prompts` prompts × `--n` samples over the group, in generated tokens per second;
- sync: one `sync_weights` (the object store: one put, loaded by every engine), in seconds.
Then, with `--use-fault-tolerance` on M engines, the recovery of a dead engine: its process is SIGKILLed, the next
rollout sees the death at once (its call fails), starts a new actor in the bundle and loads the current weights
into it; printed are the rollout's wall time against an undisturbed one and the group's own recovery time (from
the death seen to the new engine loaded, `perf/engine_recovery_time`).

    .venv/bin/python bench/rollout_group.py
    .venv/bin/python bench/rollout_group.py --model smollm2-135m-instruct --prompts 16 --n 4 --max-tokens 64

On a machine with fewer cores than engines + the trainer, M=2 shares the same cores: the ratio then shows the
group's overhead, not its speed-up; the figure that matters there is the one on real devices.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rollout_throughput import QUESTIONS  # noqa: E402  (the same prompts as the single-engine bench)


def config(model: Path, args, engines: int, fault_tolerance: bool):
    from vime_engine.config import build_config

    flags = ["--use-fault-tolerance"] if fault_tolerance else []
    return build_config(flags, **{
        "hf-checkpoint": str(model), "prompt-data": "unused", "apply-chat-template": True,
        "rollout-batch-size": args.prompts, "n-samples-per-prompt": args.n,
        "rollout-max-response-len": args.max_tokens, "vllm-kv-cache-gb": 0.5, "rollout-num-gpus": engines,
        "colocate": False,  # M engines of their own, also for M=1
        "output-dir": str(args.cache / "rollout-group-out"),
    })


def timed_rollouts(workers, records, plan, repeat: int) -> tuple[float, float]:
    """(best tokens/s of a rollout, best seconds of a sync), after one untimed round of each."""
    workers.sync_weights(0)
    workers.generate(records, 0, 0, plan).result()
    best_rate, best_sync = 0.0, float("inf")
    for version in range(1, repeat + 1):
        t0 = time.perf_counter()
        samples = workers.generate(records, version, 0, plan).result()
        rate = sum(s.response_length for s in samples) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        workers.sync_weights(version)
        best_rate, best_sync = max(best_rate, rate), min(best_sync, time.perf_counter() - t0)
    return best_rate, best_sync


def recovery(workers, records, plan) -> tuple[float, float, float]:
    """(seconds of an undisturbed rollout, of one whose engine 0 was SIGKILLed first, the group's recovery)."""
    import ray

    workers.sync_weights(0)
    workers.generate(records, 0, 0, plan).result()
    t0 = time.perf_counter()
    workers.generate(records, 1, 0, plan).result()
    undisturbed = time.perf_counter() - t0
    pid = ray.get(workers.rollout.engines[0].__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    t0 = time.perf_counter()
    workers.generate(records, 2, 0, plan).result()
    disturbed = time.perf_counter() - t0
    return undisturbed, disturbed, workers.rollout.recovery_metrics()["perf/engine_recovery_time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--engines", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    args = parser.parse_args()

    from vime_engine.runtime.cluster import keep_local_ray_on_loopback, ray_cluster

    keep_local_ray_on_loopback(None)
    from vime_engine.data.records import PromptRecord
    from vime_engine.models.builtin import materialize_builtin_model
    from vime_engine.rollout.worker import train_plan
    from vime_engine.devices.accelerator import CPU
    from vime_engine.runtime.workers import Workers

    model = materialize_builtin_model(args.model, args.cache / args.model)
    records = [PromptRecord([{"role": "user", "content": q}], "") for q in (QUESTIONS * 8)[:args.prompts]]
    rows = {}
    with ray_cluster(num_cpus=max(args.engines) + 1):
        for engines in args.engines:
            cfg = config(model, args, engines, fault_tolerance=False)
            with Workers(cfg, CPU) as workers:
                rows[engines] = timed_rollouts(workers, records, train_plan(cfg), args.repeat)
            print(f"M={engines}: rollout {rows[engines][0]:.0f} tokens/s, sync {rows[engines][1]:.3f} s", flush=True)
        base = rows[args.engines[0]]
        for engines, (rate, sync) in rows.items():
            print(f"M={engines} vs M={args.engines[0]}: rollout x{rate / base[0]:.2f}, sync x{sync / base[1]:.2f}")
        cfg = config(model, args, max(args.engines), fault_tolerance=True)
        with Workers(cfg, CPU) as workers:
            undisturbed, disturbed, recovered = recovery(workers, records, train_plan(cfg))
        print(f"dead engine (M={max(args.engines)}): rollout {disturbed:.1f} s against {undisturbed:.1f} s "
              f"undisturbed; recovery (death seen -> new engine loaded) {recovered:.1f} s")


if __name__ == "__main__":
    main()
