"""The demo's wall time (`vimeflow run` on the embedded default) and its phases, from a fresh storage root, model
cache and Prefect home each time, so staging is measured as on a fresh clone (the environment excepted).

Phases come from the run's own log (Prefect's task lines, the engine's) and from the rollouts' metrics: Prefect's
start, staging, each chunk (its start-up, then per rollout the generation, training and weight sync and what else
the wall holds: evaluation, checkpoints), the evaluate task, publish. With `--baseline REF` the demo of git
revision REF (exported to a temporary directory, run with this environment) runs first and the ratios
of this tree's phases to its phases are printed; the two runs' metrics are compared rollout by rollout.

    .venv/bin/python bench/demo_time.py [--baseline REF] [--revision REF] [--keep DIR]

`--revision REF` runs that revision's demo instead of the working tree (also exported, so that editing the tree
while the demo runs cannot change what it runs).

The machine is shared: note its load (printed before and after each run) beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASK_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) \| \w+ +\| (?:Task|Flow) run '([^']+)' - (.*)$")


def _clock(stamp: str) -> float:
    t = datetime.strptime(stamp, "%H:%M:%S.%f")
    return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6


def _load() -> str:
    return "load %s" % " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_demo(source: Path, keep: Path | None) -> dict:
    """One `vimeflow run --verbose` of the tree at `source` in a fresh directory; its wall, phases and metrics."""
    work = Path(tempfile.mkdtemp(prefix="demo-time-", dir=keep))
    env = {**os.environ, "PYTHONPATH": str(source), "VIMEFLOW_CACHE": str(work / "cache"),
           "PREFECT_HOME": str(work / "prefect")}
    print(f"{source}: {_load()}", flush=True)
    t0 = time.time()
    log = work / "run.log"
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--verbose"], cwd=work, env=env,
                            stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    print(f"  exit {rc} after {wall:.0f} s; {_load()}", flush=True)
    start = _clock(datetime.fromtimestamp(t0).strftime("%H:%M:%S.%f"))
    events: list[tuple[float, str, str]] = []
    for line in log.read_text(errors="replace").splitlines():
        if m := TASK_LINE.match(line):
            # the log's clock has no date: a run that passes midnight goes on counting from its start
            events.append(((_clock(m[1]) - start) % 86400, re.sub(r"-[0-9a-f]{3}$", "", m[2]), m[3]))
    finished = {name: at for at, name, what in events if what.startswith("Finished in state")}
    began = next((at for at, _, what in events if what.startswith("Beginning flow run")), None)
    metrics = [json.loads(x) for p in sorted((work / "cache" / "work").glob("*/output/metrics.jsonl"))
               for x in p.read_text().splitlines()]
    result = {"wall": wall, "rc": rc, "flow_began": began, "finished": finished, "metrics": metrics, "dir": work}
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


def phases(run: dict) -> dict[str, float]:
    """Seconds of each phase: each task from the previous task's end (the flow's start for the first)."""
    out = {"prefect start": run["flow_began"] or 0.0}
    previous = out["prefect start"]
    for name in ["stage_model", *sorted((n for n in run["finished"] if n.startswith("train_chunk")),
                                        key=lambda n: int(n.rsplit("-", 1)[1])), "evaluate", "publish"]:
        if name in run["finished"]:
            out[name] = run["finished"][name] - previous
            previous = run["finished"][name]
    out["exit"] = run["wall"] - previous
    return out


def rollout_split(run: dict) -> dict[str, float]:
    """The rollouts' generation, training and weight-sync seconds, summed over the run."""
    rows = [m for m in run["metrics"] if "perf/rollout_time" in m]
    return {k: sum(m[f"perf/{k}"] for m in rows) for k in ("rollout_time", "train_time", "update_weights_time")}


def learning(run: dict) -> dict[str, float]:
    rows = [m for m in run["metrics"] if "rollout/raw_reward" in m]
    evals = [m for m in run["metrics"] if "eval/held-out" in m]
    return {"reward first": rows[0]["rollout/raw_reward"] if rows else float("nan"),
            "reward last": rows[-1]["rollout/raw_reward"] if rows else float("nan"),
            "held-out before": evals[0]["eval/held-out"] if evals else float("nan"),
            "held-out after": evals[-1]["eval/held-out"] if evals else float("nan"),
            "aime after": evals[-1].get("eval/aime", float("nan")) if evals else float("nan")}


def same_samples(a: dict, b: dict) -> str:
    """Whether the two runs' learning metrics agree rollout by rollout (rewards, losses, evaluations)."""
    keys = lambda m: {k: v for k, v in m.items()  # noqa: E731
                      if k.startswith(("rollout/raw_reward", "rollout/response_len", "train/loss", "eval/"))}
    left = [keys(m) for m in a["metrics"]]
    right = [keys(m) for m in b["metrics"]]
    return "identical" if left == right else f"differ ({sum(x != y for x, y in zip(left, right))} of {len(left)} rows)"


def show(label: str, run: dict, baseline: dict | None) -> None:
    base = phases(baseline) if baseline else {}
    print(f"\n{label}: {run['wall']:.0f} s ({int(run['wall'] // 60)}:{run['wall'] % 60:04.1f})"
          + (f", {run['wall'] / baseline['wall']:.2f}x the baseline" if baseline else ""))
    for name, seconds in phases(run).items():
        ratio = f"  {seconds / base[name]:.2f}x" if base.get(name) else ""
        print(f"  {name:<22} {seconds:7.1f} s{ratio}")
    split = rollout_split(run)
    print("  rollouts: generation {rollout_time:.1f} s, training {train_time:.1f} s, sync {update_weights_time:.1f} s"
          .format(**split))
    print("  " + ", ".join(f"{k} {v:.3f}" for k, v in learning(run).items()))


def run_revision(ref: str, keep: Path | None) -> dict:
    """The demo of git revision `ref`, exported to a temporary directory and run with this environment."""
    with tempfile.TemporaryDirectory(prefix="demo-tree-") as tree:
        archive = subprocess.run(["git", "archive", ref], cwd=REPO, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        return run_demo(Path(tree), keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="git revision whose demo runs first, for ratios")
    parser.add_argument("--revision", help="git revision to run instead of the working tree")
    parser.add_argument("--keep", type=Path, help="keep the runs' directories under DIR")
    args = parser.parse_args()
    baseline = run_revision(args.baseline, args.keep) if args.baseline else None
    current = run_revision(args.revision, args.keep) if args.revision else run_demo(REPO, args.keep)
    if baseline:
        show(f"baseline {args.baseline}", baseline, None)
    show(args.revision or "this tree", current, baseline)
    if baseline:
        print(f"\nlearning metrics, rollout by rollout: {same_samples(baseline, current)}")


if __name__ == "__main__":
    main()
