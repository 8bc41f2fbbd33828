"""Orchestration overhead of rl-pipeline, and the time from re-running a killed pipeline to its first resumed rollout.

    python bench/orchestration_overhead.py [--config configs/pipeline-tiny.yaml]

Starts its own `prefect server` (free port, temporary PREFECT_HOME), then:
1. runs the pipeline once in a fresh storage root; overhead = flow wall time − Σ engine time (measured inside
   each engine process: train chunks and the evaluation), printed as a share of the training time (Σ chunk
   engine time);
2. runs it again in another root, SIGKILLs the flow process once chunk 2 has committed an in-chunk
   checkpoint, re-runs it, and prints the seconds from starting the re-run to the first new rollout record.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _flow(params_file: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.rl_pipeline", str(params_file)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _params(config: Path, root: Path, run_name: str, dest: Path) -> Path:
    import yaml

    params = yaml.safe_load(config.read_text())
    params["storage"] = {"root": root.as_uri(), "run_name": run_name}
    dest.write_text(yaml.safe_dump(params))
    return dest


def overhead(config: Path, tmp: Path, env: dict) -> dict:
    from tasks.engine_job.layout import make_layout
    from tasks.engine_job.messages import JobReport, decode

    root = tmp / "overhead"
    params = _params(config, root, "overhead", tmp / "overhead.yaml")
    t0 = time.perf_counter()
    proc = _flow(params, env)
    assert proc.wait() == 0, "pipeline failed"
    wall = time.perf_counter() - t0
    layout = make_layout(root.as_uri(), "overhead")
    jobs = sorted((Path(layout.work_dir) / "jobs").glob("chunk-*/result.json"))
    evals = list((Path(layout.work_dir) / "evaluation").glob("rollout_*/job/result.json"))
    train = sum(decode(JobReport, p.read_bytes(), str(p)).engine_seconds for p in jobs)
    evaluation = sum(decode(JobReport, p.read_bytes(), str(p)).engine_seconds for p in evals)
    over = wall - train - evaluation
    return {"pipeline_wall_s": wall, "train_engine_s": train, "eval_engine_s": evaluation,
            "orchestration_s": over, "orchestration_share_of_training": over / train}


def resume_latency(config: Path, tmp: Path, env: dict) -> dict:
    from tasks.engine_job.layout import make_layout

    root = tmp / "resume"
    params = _params(config, root, "resume", tmp / "resume.yaml")
    layout = make_layout(root.as_uri(), "resume")
    ckpts = Path(layout.work_dir) / "checkpoints"
    proc = _flow(params, env)
    while not (ckpts / "rollout_0000002" / "manifest.json").is_file():
        if proc.poll() is not None:
            raise RuntimeError("the pipeline ended before chunk 2 started")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    newest = max(int(p.name.split("_")[1]) for p in ckpts.glob("rollout_*") if (p / "manifest.json").is_file())
    metrics = Path(layout.work_dir) / "output" / "metrics.jsonl"
    t0 = time.perf_counter()
    rerun = _flow(params, env)
    first = None
    while first is None:
        if metrics.is_file():
            for line in metrics.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("rollout_id", -1) > newest and "rollout/raw_reward" in record:
                    first = time.perf_counter() - t0
        if rerun.poll() is not None and first is None:
            raise RuntimeError("the re-run ended without a new rollout")
        time.sleep(0.05)
    rerun.wait()
    return {"resumed_after_checkpoint": newest, "rerun_to_first_resumed_rollout_s": first}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "pipeline-tiny.yaml")
    args = parser.parse_args()
    from flows.deploy import start_server
    from tests.support.prefect_server import free_port

    with tempfile.TemporaryDirectory(prefix="vimeflow-bench-") as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "VIMEFLOW_CACHE": str(tmp / "cache"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        server = start_server("127.0.0.1", port, env)
        env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        os.environ["VIMEFLOW_CACHE"] = env["VIMEFLOW_CACHE"]
        try:
            result = {"config": str(args.config), **overhead(args.config, tmp, env),
                      **resume_latency(args.config, tmp, env)}
        finally:
            server.terminate()
            server.wait(timeout=30)
    for key, value in result.items():
        print(f"{key:<36} {value:.3f}" if isinstance(value, float) else f"{key:<36} {value}")


if __name__ == "__main__":
    main()
