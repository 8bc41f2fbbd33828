"""Weight-sync speed: seconds and GB/s for each path, tiny Qwen3 and SmolLM2-135M, fp32.

Paths (the real actors of `runtime.workers`, on a private local Ray cluster):
- in-process: each colocated rank's actor walks the trainer's tensors into its vLLM engine (`reload_weights`);
- object store: trainer → Ray object store → rollout actor → vLLM;
- broadcast: bucketed gloo broadcast trainer → rollout actor, streamed into vLLM.
Bytes are the state dict vLLM receives (including `lm_head.weight` even when tied). Seconds are the driver's
wall time of one `sync_weights` call (the whole path, not only the engine's reload); the best of `--repeat`
after one warm-up sync is kept.

    .venv/bin/python bench/weight_sync.py
    .venv/bin/python bench/weight_sync.py --models tiny-qwen3 --repeat 5 --bucket-mb 16
    .venv/bin/python bench/weight_sync.py --models smollm2-135m-instruct --trainer-ranks 1 2

With `--trainer-ranks 1 2` every path runs from a trainer group of one and of two data-parallel ranks, printed with
the ratio to one rank: disaggregated, rank 0 sends (the others take part in the gather); in process (colocated),
each rank loads its own engine.

Goal: >= 1 GB/s in-process.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_bytes(model_path: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    state = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    if "lm_head.weight" not in state:
        total += model.get_output_embeddings().weight.numel() * 4
    return total


def measure(cfg, path_name: str, repeat: int) -> float:
    import ray

    from vime_engine.config import with_overrides
    from vime_engine.devices.accelerator import CPU
    from vime_engine.runtime.workers import Workers

    kind = "broadcast" if path_name == "broadcast" else "object_store"
    with Workers(with_overrides(cfg, weight_sync=kind), CPU) as workers:
        workers.sync_weights(0)  # warm-up: forms the broadcast group, touches every page once
        best = float("inf")
        for version in range(1, repeat + 1):
            start = time.perf_counter()
            workers.sync_weights(version)
            best = min(best, time.perf_counter() - start)
        return best


def main() -> None:
    from vime_engine.config import build_config
    from vime_engine.data.synthetic import materialize_builtin_dataset
    from vime_engine.models.builtin import materialize_builtin_model
    from vime_engine.runtime.cluster import ray_cluster

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-qwen3", "smollm2-135m-instruct"])
    parser.add_argument("--paths", nargs="+", default=["in-process", "object-store", "broadcast"])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--trainer-ranks", nargs="+", type=int, default=[1])
    args = parser.parse_args()

    data = materialize_builtin_dataset("arithmetic", args.cache / "data")
    with ray_cluster(num_cpus=max(4, max(args.trainer_ranks) + 1)):
        for name in args.models:
            path = materialize_builtin_model(name, args.cache / name)
            nbytes = model_bytes(path)
            rows = {}
            for path_name in args.paths:
                for ranks in args.trainer_ranks:
                    cfg = build_config([], **{
                        "hf-checkpoint": str(path), "prompt-data": str(data), "input-key": "question",
                        "label-key": "answer", "vllm-kv-cache-gb": 0.5, "colocate": path_name == "in-process",
                        "output-dir": str(args.cache / "run"), "actor-num-gpus-per-node": ranks,
                    })
                    row = path_name if ranks == 1 else f"{path_name}-dp{ranks}"
                    rows[row] = measure(cfg, "broadcast" if path_name == "broadcast" else path_name, args.repeat)
                    seconds = rows[row]
                    print(f"{name:24s} {row:18s} {nbytes / 1e6:8.1f} MB  {seconds:7.3f} s  "
                          f"{nbytes / seconds / 1e9:6.2f} GB/s", flush=True)
                    if ranks > 1:
                        print(f"{name:24s} {row} / one rank time: {seconds / rows[path_name]:.2f}x")
            if "in-process" in rows:
                for other in rows:
                    if not other.startswith("in-process"):
                        print(f"{name:24s} {other} / in-process time: {rows[other] / rows['in-process']:.2f}x")


if __name__ == "__main__":
    main()
