"""Time to resume: from process start to the first resumed rollout, split into its parts.

For each config (bench/step_time.py's CONFIGS) a run of one rollout saves a checkpoint. Then a fresh process
does what `runtime.driver.train` does before its first resumed rollout, timing each part:

    start    interpreter start and imports (torch, Ray, the engine)
    cluster  the private Ray cluster
    workers  trainer and vLLM engine up (model load, KV cache), both actors ready
    load     the checkpoint: manifest, driver state, trainer state with every sha256 checked in the read
    push     the loaded weights into the vLLM engine

    .venv/bin/python bench/resume_time.py [--configs tiny smollm2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

PARTS = ("start", "cluster", "workers", "load", "push")


def resume(name: str, cache: Path, spawned_at: float) -> dict[str, float]:
    """In the fresh process: the steps train() takes before its first resumed rollout, each timed."""
    marks = {"spawned": spawned_at}
    import ray

    from step_time import engine_config
    from vime_engine.runtime.cluster import ray_cluster
    from vime_engine.devices.accelerator import resolve_accelerator
    from vime_engine.runtime.run_state import RunContext
    from vime_engine.runtime.workers import Workers

    cfg = engine_config(name, cache, **{"num-rollout": 2, "save": str(cache / f"ckpt-{name}"),
                                        "output-dir": str(cache / f"out-{name}")})
    marks["start"] = time.time()
    with ray_cluster(num_cpus=4):
        marks["cluster"] = time.time()
        with Workers(cfg, resolve_accelerator(cfg.placement.device)) as workers:
            ray.get([actor.__ray_ready__.remote() for actor in workers.actors()])
            marks["workers"] = time.time()
            ctx = RunContext.open(cfg, workers)
            assert ctx.state.next_rollout_id == 1, "the prepared checkpoint was not found"
            marks["load"] = time.time()
            workers.sync_weights(ctx.state.weight_version)
            marks["push"] = time.time()
            ctx.close()
    order = ["spawned", *PARTS]
    return {part: marks[part] - marks[prev] for prev, part in zip(order, order[1:])}


def prepare(name: str, cache: Path) -> None:
    """One rollout with a checkpoint, in this process."""
    from step_time import engine_config
    from vime_engine.runtime.driver import train

    shutil.rmtree(cache / f"ckpt-{name}", ignore_errors=True)
    train(engine_config(name, cache, **{"num-rollout": 1, "save": str(cache / f"ckpt-{name}"),
                                        "output-dir": str(cache / f"out-{name}")}))


def _in_fresh_process(*args: str) -> str:
    return subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepare, args.cache)
        return
    if args.resume:
        print(json.dumps(resume(args.resume, args.cache, args.spawned_at)))
        return
    for name in args.configs:
        _in_fresh_process("--prepare", name, "--cache", str(args.cache))
        out = _in_fresh_process("--resume", name, "--cache", str(args.cache), "--spawned-at", str(time.time()))
        times = json.loads(out.strip().splitlines()[-1])
        split = "  ".join(f"{part} {times[part]:.2f} s" for part in PARTS)
        print(f"{name:8s} resume {sum(times.values()):6.2f} s = {split}", flush=True)


if __name__ == "__main__":
    main()
