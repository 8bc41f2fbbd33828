"""nightly-regression: the pipeline on a small pinned configuration, gated on a stored baseline.

Runs rl-pipeline as a subflow (fresh storage per run unless `storage_root` is given), compares its final
reward, train/rollout log-prob gap, eval score and step time (as a ratio to a reference workload timed in
the engine processes that trained, see tasks/regression.py) against tolerance bands, publishes the
comparison as a markdown artifact, and fails the run when a metric leaves its band.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact

from flows.configs import config_file as shipped_config
from flows.params import load_params
from flows.rl_pipeline import rl_pipeline
from tasks.regression import compare, load_baseline, render_diff


class RegressionDetected(AssertionError):
    """A metric left its tolerance band."""


@flow(name="nightly-regression", log_prints=True)
def nightly_regression(
    config_file: str | None = None,
    baseline_file: str | None = None,
    storage_root: str | None = None,
) -> dict[str, float | None]:
    """Run the pinned configuration (default: the shipped pipeline-tiny.yaml) and gate it on the baseline's bands
    (default: the shipped nightly-baseline.yaml)."""
    params = load_params(config_file or shipped_config("pipeline-tiny.yaml"))
    root = storage_root or (Path.cwd() / "vimeflow-nightly" / str(runtime.flow_run.id)).resolve().as_uri()
    params.storage = params.storage.model_copy(update={"root": root})
    outcome = rl_pipeline(**params.as_flow_kwargs())
    observed = {**outcome.summary, **outcome.gates}
    results = compare(observed, load_baseline(baseline_file or shipped_config("nightly-baseline.yaml")))
    diff = render_diff(results)
    create_markdown_artifact(f"# Nightly regression\n\nreport: {outcome.report_uri}\n\n{diff}\n",
                             key="nightly-regression", description="metrics against the baseline")
    get_run_logger().info("\n%s", diff)
    if not all(r.passed for r in results):
        raise RegressionDetected(diff)
    return observed


if __name__ == "__main__":
    nightly_regression()
