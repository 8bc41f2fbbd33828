"""Soak: a long run of the tiny model through the real driver loop, watching what it holds as it goes.

N rollouts of the tiny built-in model (bench/step_time.py's "tiny" config, shrunk to a quick step) run through
`runtime.driver.train` with a checkpoint every `--save-interval` rollouts and `--keep-last`. Every
`--sample-every` rollouts it samples:

    rss / pss    resident memory of the whole process tree (this driver, gcs_server, raylet, the Ray workers
                 and actors), summed, and the resident memory of each kind of process (where a leak lives)
    fds          open file descriptors over the tree
    store        Ray object-store bytes in use and objects held
    disk         bytes under the run directory, and in the checkpoint directories kept (the history file beside
                 them grows with the run, as the metrics log does), with the checkpoints kept
    lp_diff      train/train_rollout_logprob_abs_diff: trainer and vLLM log-probs of the same tokens

and checks the goals: memory growth from the second fifth of the run to the last under 0.5% (the first fifth
is warm-up: allocator pools, vLLM caches, Ray's worker pool); checkpoints bounded by --keep-last (never more
kept, and no more bytes in the last fifth than in the second); no new high-water mark of open fds or the
object store in the last fifth; log-prob agreement flat. Samples go to soak.csv and soak.json, a plot to
soak.png, all under --output-dir; the exit status is 1 when a goal is missed.

    nice -n 10 .venv/bin/python bench/soak.py                       # 1,500 rollouts
    nice -n 10 .venv/bin/python bench/soak.py --num-rollout 200 --output-dir /tmp/vf_soak_short
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

MEMORY_GROWTH_GOAL = 0.005  # second fifth → last fifth
LOGPROB_METRIC = "train/train_rollout_logprob_abs_diff"
LOGPROB_FLAT = 1e-5  # fp32 on CPU: trainer and vLLM agree to ~1e-7 (configs/nightly-baseline.yaml)
MIB = 2**20


@dataclass
class Sample:
    rollout_id: int
    elapsed_s: float
    rss_mib: float
    pss_mib: float
    fds: int
    processes: int
    store_mib: float
    store_objects: int
    disk_mib: float
    ckpt_mib: float
    ckpts: int
    lp_diff: float
    rss_by_kind: dict[str, float] = field(default_factory=dict)


def process_kind(proc) -> str:
    """A name for what a process of the tree is: the driver, a Ray daemon, or the actor a Ray worker holds."""
    if proc.pid == os.getpid():
        return "driver"
    try:
        argv = proc.cmdline()
    except Exception:  # noqa: BLE001 - gone or inaccessible: count it under its name
        return proc.name()
    title = argv[0] if argv else proc.name()
    if title.startswith("ray::"):  # Ray names a worker's process after the actor it holds: ray::RolloutActor
        return title.split(".")[0].split()[0]
    scripts = [Path(a).name for a in argv if a.endswith(".py")]  # a Python daemon: log_monitor.py, agents
    return scripts[0] if scripts else Path(title).name


def tree_memory() -> tuple[float, float, int, int, dict[str, float]]:
    """(rss MiB, pss MiB, open fds, process count, rss MiB by kind) over this process and its descendants.

    RSS counts pages shared between processes (torch libraries, the object store's shared memory) once per
    process that maps them; PSS splits them, so it is the one that adds up to what the tree really holds."""
    import psutil

    me = psutil.Process()
    rss = pss = 0.0
    fds = count = 0
    by_kind: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
            n_fds = proc.num_fds()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        kind = process_kind(proc)
        rss, pss, fds, count = rss + info.rss, pss + info.pss, fds + n_fds, count + 1
        by_kind[kind] = by_kind.get(kind, 0.0) + info.rss / MIB
    return rss / MIB, pss / MIB, fds, count, by_kind


class ObjectStore:
    """Object-store use as `ray memory --stats-only` reports it, read from the local raylet over one channel."""

    def __init__(self):
        import ray
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

        node = ray._private.worker.global_worker.node
        channel = init_grpc_channel(f"{node.node_ip_address}:{node.node_manager_port}")
        self.stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        self.request = node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False)

    def usage(self) -> tuple[float, int]:
        stats = self.stub.FormatGlobalMemoryInfo(self.request, timeout=30).store_stats
        return stats.object_store_bytes_used / MIB, stats.num_local_objects


def disk_mib(root: Path) -> float:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / MIB if root.exists() else 0.0


def checkpoints_mib(root: Path) -> float:
    return sum(disk_mib(p) for p in root.glob("rollout_*") if p.is_dir()) if root.exists() else 0.0


def checkpoint_count(root: Path) -> int:
    return sum(1 for p in root.glob("rollout_*") if p.is_dir()) if root.exists() else 0


def fifth(samples: list[Sample], k: int, num_rollout: int) -> list[Sample]:
    """The samples taken in the k-th fifth (0-based) of the run's rollouts."""
    lo, hi = k * num_rollout / 5, (k + 1) * num_rollout / 5
    return [s for s in samples if lo <= s.rollout_id < hi]


def goals(samples: list[Sample], num_rollout: int, keep_last: int) -> list[tuple[str, bool, str]]:
    """(goal, met, figures) for each goal of the soak."""
    second, last = fifth(samples, 1, num_rollout), fifth(samples, 4, num_rollout)
    if not second or not last:
        return [("enough samples", False, "each fifth of the run needs a sample: lower --sample-every")]
    mean = lambda rows, key: statistics.fmean(getattr(s, key) for s in rows)  # noqa: E731
    out = []
    for key in ("rss_mib", "pss_mib"):
        a, b = mean(second, key), mean(last, key)
        growth = (b - a) / a
        per_rollout = (b - a) * 1024 / (3 * num_rollout / 5)  # the two fifths' midpoints are 3/5 of the run apart
        out.append((f"{key[:3]} growth 2nd→last fifth < {MEMORY_GROWTH_GOAL:.1%}", growth < MEMORY_GROWTH_GOAL,
                    f"{a:.1f} → {b:.1f} MiB ({growth:+.3%}, {per_rollout:+.2f} KiB a rollout)"))
    d2, d5 = max(s.ckpt_mib for s in second), max(s.ckpt_mib for s in last)
    most = max(s.ckpts for s in samples)
    out.append((f"checkpoints bounded by --keep-last {keep_last}", most <= keep_last and d5 <= d2 * 1.01,
                f"at most {most} kept; max {d2:.2f} MiB (2nd fifth) vs {d5:.2f} MiB (last); whole run dir "
                f"{samples[-1].disk_mib:.2f} MiB at the end (the metrics log grows with the run)"))
    # fds and the object store move with what is in flight when a sample is taken: bounded means the last fifth
    # sets no new high-water mark (beyond 5%: the same objects in flight differ in size by a few bytes).
    earlier = [s for s in samples if s.rollout_id < 4 * num_rollout / 5]
    f4, f5 = max(s.fds for s in earlier), max(s.fds for s in last)
    out.append(("open fds bounded", f5 <= f4, f"max {f4} (first 4 fifths) vs {f5} (last)"))
    o4, o5 = max(s.store_mib for s in earlier), max(s.store_mib for s in last)
    out.append(("object store bounded", o5 <= o4 * 1.05, f"max {o4:.1f} MiB (first 4 fifths) vs {o5:.1f} MiB (last)"))
    lp = [s.lp_diff for s in samples[1:]]
    out.append((f"log-prob agreement flat (< {LOGPROB_FLAT:g})", max(lp) < LOGPROB_FLAT,
                f"first {samples[0].lp_diff:.2e}, max {max(lp):.2e}, last {samples[-1].lp_diff:.2e}"))
    return out


def write_samples(samples: list[Sample], out: Path) -> None:
    rows = [asdict(s) for s in samples]
    (out / "soak.json").write_text(json.dumps(rows, indent=1))
    kinds = sorted({k for s in samples for k in s.rss_by_kind})
    with (out / "soak.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        plain = [k for k in rows[0] if k != "rss_by_kind"]
        writer.writerow(plain + [f"rss_mib[{k}]" for k in kinds])
        for s, row in zip(samples, rows):
            writer.writerow([row[k] for k in plain] + [round(s.rss_by_kind.get(k, 0.0), 2) for k in kinds])


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({k for s in samples for k in s.rss_by_kind})
    x = [s.rollout_id for s in samples]
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    panels = [
        ("process tree memory (MiB)", {"rss": [s.rss_mib for s in samples], "pss": [s.pss_mib for s in samples]}),
        ("rss by process (MiB, minus first sample)",
         {k: [s.rss_by_kind.get(k, 0.0) - samples[0].rss_by_kind.get(k, 0.0) for s in samples] for k in kinds}),
        ("open file descriptors", {"fds": [s.fds for s in samples]}),
        ("object store (MiB)", {"used": [s.store_mib for s in samples]}),
        ("on disk (MiB)", {"run dir": [s.disk_mib for s in samples], "checkpoints": [s.ckpt_mib for s in samples]}),
        ("trainer vs vLLM log-prob |diff|", {"lp_diff": [s.lp_diff for s in samples]}),
    ]
    for ax, (title, series) in zip(axes.flat, panels):
        for label, ys in series.items():
            ax.plot(x, ys, label=label)
        ax.set_title(title)
        ax.legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("rollout")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(samples: list[Sample], num_rollout: int) -> None:
    print(f"{'rollout':>7} {'min':>6} {'rss MiB':>9} {'pss MiB':>9} {'fds':>5} {'procs':>5} {'store MiB':>9} "
          f"{'objs':>5} {'disk MiB':>8} {'ckpt MiB':>8} {'lp_diff':>9}")
    step = max(1, len(samples) // 20)
    for s in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        print(f"{s.rollout_id:7d} {s.elapsed_s / 60:6.1f} {s.rss_mib:9.1f} {s.pss_mib:9.1f} {s.fds:5d} "
              f"{s.processes:5d} {s.store_mib:9.2f} {s.store_objects:5d} {s.disk_mib:8.2f} {s.ckpt_mib:8.2f} "
              f"{s.lp_diff:9.2e}")
    second, last = fifth(samples, 1, num_rollout), fifth(samples, 4, num_rollout)
    if second and last:
        print("\nrss by process, mean MiB over the 2nd fifth → the last fifth:")
        for kind in sorted(samples[-1].rss_by_kind):
            a = statistics.fmean(s.rss_by_kind.get(kind, 0.0) for s in second)
            b = statistics.fmean(s.rss_by_kind.get(kind, 0.0) for s in last)
            print(f"  {kind:28s} {a:9.1f} → {b:9.1f}  ({b - a:+.1f})")


def main() -> int:
    from step_time import engine_config
    from vime_engine.runtime.cluster import keep_local_ray_on_loopback

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-rollout", type=int, default=1500)
    parser.add_argument("--save-interval", type=int, default=10, help="a checkpoint every this many rollouts")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--sample-every", type=int, default=10, help="rollouts between two samples")
    parser.add_argument("--output-dir", type=Path, default=Path("/tmp/vf_soak"),
                        help="the run (checkpoints, metrics) and the soak's samples; emptied first")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"), help="built-in model and data")
    args = parser.parse_args()
    if args.num_rollout < 5 * args.sample_every:
        parser.error(f"--num-rollout {args.num_rollout} is too short to compare fifths of the run "
                     f"with a sample every {args.sample_every}: give at least {5 * args.sample_every}")

    keep_local_ray_on_loopback(None)
    from vime_engine.runtime.driver import train

    shutil.rmtree(args.output_dir, ignore_errors=True)
    run_dir = args.output_dir / "run"
    ckpt_root = run_dir / "ckpt"
    cfg = engine_config("tiny", args.cache, **{
        "num-rollout": args.num_rollout, "save": str(ckpt_root), "save-interval": args.save_interval,
        "keep-last": args.keep_last, "output-dir": str(run_dir / "out"),
        "rollout-batch-size": 4, "n-samples-per-prompt": 4, "rollout-max-response-len": 8,
        "global-batch-size": 16, "micro-batch-size": 16,
    })
    samples: list[Sample] = []
    started = time.perf_counter()
    store: ObjectStore | None = None

    def on_rollout(rollout_id: int, metrics: dict) -> None:
        nonlocal store
        if rollout_id % args.sample_every and rollout_id != args.num_rollout - 1:
            return
        store = store or ObjectStore()
        rss, pss, fds, count, by_kind = tree_memory()
        store_mib, objects = store.usage()
        samples.append(Sample(rollout_id, time.perf_counter() - started, rss, pss, fds, count, store_mib, objects,
                              disk_mib(run_dir), checkpoints_mib(ckpt_root), checkpoint_count(ckpt_root),
                              float(metrics[LOGPROB_METRIC]), by_kind))
        if len(samples) % 10 == 1:
            s = samples[-1]
            print(f"[soak] rollout {rollout_id}: rss {s.rss_mib:.1f} MiB, pss {s.pss_mib:.1f} MiB, fds {s.fds}, "
                  f"store {s.store_mib:.1f} MiB, disk {s.disk_mib:.2f} MiB, {s.elapsed_s / 60:.1f} min", flush=True)
        if len(samples) % 20 == 0:
            write_samples(samples, args.output_dir)  # a run stopped early still leaves its samples

    train(cfg, on_rollout=on_rollout)
    write_samples(samples, args.output_dir)
    plot(samples, args.output_dir / "soak.png")  # after the run: matplotlib's ~50 MiB would read as growth
    print_table(samples, args.num_rollout)
    results = goals(samples, args.num_rollout, args.keep_last)
    print(f"\n{args.num_rollout} rollouts in {(time.perf_counter() - started) / 60:.1f} min; "
          f"samples, plot: {args.output_dir}/soak.{{csv,json,png}}")
    for goal, met, figures in results:
        print(f"  [{'ok' if met else 'MISSED'}] {goal}: {figures}")
    return 0 if all(met for _, met, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
