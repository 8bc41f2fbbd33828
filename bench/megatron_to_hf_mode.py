"""What `--megatron-to-hf-mode bridge` costs against raw where weights cross: the HF-named export of a Megatron model
(the weight sync's stream and --save-hf) and the load of an HF directory into it (the initial weights).

One process, one rank (the Megatron lane's Python 3.12 venv: Megatron-Bridge is there): the built-in tiny Qwen3 and
Qwen3-MoE built once, then raw and bridge timed in turns, `--repeat` rounds after one warm-up, the median of each
with the bridge's ratio to raw. Megatron-Bridge's import (once a process) is printed apart.

    PYTHONPATH=$PWD .venv-megatron/bin/python bench/megatron_to_hf_mode.py
    PYTHONPATH=$PWD .venv-megatron/bin/python bench/megatron_to_hf_mode.py --repeat 9 --models tiny-qwen3-moe
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _seconds(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["tiny-qwen3", "tiny-qwen3-moe"])
    args = parser.parse_args()

    import torch

    from vime_engine.devices.accelerator import CPU, prepare_accelerator

    prepare_accelerator(CPU)
    from vime_engine.models.builtin import materialize_builtin_model
    from vime_engine.train import megatron_model as mm
    from vime_engine.train.megatron_bridge import auto_bridge_class

    mm.init_distributed(CPU, mm.ParallelLayout(), seed=0)
    print(f"Megatron-Bridge import: {_seconds(auto_bridge_class):.2f} s")
    with tempfile.TemporaryDirectory(prefix="bench-megatron-to-hf-") as tmp:
        for name in args.models:
            hf_dir = materialize_builtin_model(name, Path(tmp) / name)
            arch = mm.HFArchitecture.from_pretrained(hf_dir)
            model = mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU)
            modes = {mode: mm.hf_mapping(mode, arch, hf_dir) for mode in ("raw", "bridge")}
            actions = {
                "export": lambda m: dict(mm.hf_weight_stream(arch, model, with_lm_head=True, mapping=m)),
                "load": lambda m: mm.load_weights_from(model, hf_dir, arch, m),
            }
            for what, action in actions.items():
                times: dict[str, list[float]] = {mode: [] for mode in modes}
                for round_ in range(args.repeat + 1):
                    for mode, mapping in modes.items():
                        elapsed = _seconds(lambda: action(mapping))
                        if round_:  # the first round warms up
                            times[mode].append(elapsed)
                raw, bridge = (statistics.median(times[m]) for m in ("raw", "bridge"))
                print(f"{name:15s} {what:6s} raw {raw * 1e3:8.1f} ms   bridge {bridge * 1e3:8.1f} ms "
                      f"({bridge / raw:.2f}x)")


if __name__ == "__main__":
    main()
