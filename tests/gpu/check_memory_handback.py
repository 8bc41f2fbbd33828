"""Prepared check for a lent GPU (a few minutes): `python tests/gpu/check_memory_handback.py [--model DIR]`.

The same venv as tests/gpu/check_cuda.py. One colocated rank in one process: a vLLM engine (sleep mode on) and
the torch backend on cuda:0, taking turns at the device's memory through vime_engine.runtime.memory_turns, for two
rollouts (generate, train, sync), once with the hand-back and once with both sides resident, each in a fresh
process. Prints one JSON line: the device's peak used memory (from `torch.cuda.mem_get_info`, sampled at every
phase, so vLLM's own allocator counts) in each mode, and the hand-over calls made; exits 1 unless the run with
hand-back peaks below the one without.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run_mode(model: str, hand_back: bool) -> None:
    import torch

    from tests.gpu.check_cuda import _cfg, _samples
    from vime_engine.rollout.worker import RolloutWorker
    from vime_engine.runtime.memory_turns import MemoryTurns, Resident, memory_turns
    from vime_engine.train.backend import build_train_backend

    cfg = _cfg(model, "torch")
    cfg = cfg.model_copy(update={"placement": cfg.placement.model_copy(update={"colocate": True})})
    backend = build_train_backend(cfg, "cuda")
    worker = RolloutWorker(cfg, None)
    turns = (memory_turns("cuda", worker.engine.llm, backend, "cuda") if hand_back
             else MemoryTurns(Resident(), Resident()))
    peak = 0

    def used() -> None:
        nonlocal peak
        free, total = torch.cuda.mem_get_info()
        peak = max(peak, total - free)

    for rollout in range(2):
        turns.for_generation()
        used()
        samples = _samples(worker.engine, model, seed=rollout)
        used()
        turns.for_training()
        used()
        backend.train_rollout(samples)
        used()
        turns.for_sync()
        worker.update_weights(backend.named_weights(), rollout + 1)
        used()
    print(json.dumps({"hand_back": hand_back, "peak_bytes": peak, "calls": turns.calls}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="an HF model directory (default: the built-in SmolLM2)")
    parser.add_argument("--mode", choices=["hand-back", "resident"])
    args = parser.parse_args()
    model = args.model
    if model is None:
        from vime_engine.assets import resolve_model

        model = resolve_model("builtin://smollm2-135m-instruct")
    if args.mode:
        run_mode(model, args.mode == "hand-back")
        return
    results = {}
    for mode in ("hand-back", "resident"):
        done = subprocess.run([sys.executable, __file__, "--model", model, "--mode", mode], capture_output=True,
                              text=True, cwd=ROOT)
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            sys.exit(1)
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    ok = results["hand-back"]["peak_bytes"] < results["resident"]["peak_bytes"]
    print(json.dumps({**results, "hand_back_peaks_lower": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
