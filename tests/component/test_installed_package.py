"""The installed package works like the checkout: the wheel, installed non-editable into a fresh venv and used
from a directory outside the repository (as in the Docker images, which drop tests/), finds its shipped
configurations, the pipeline's default parameters and the tiny pipeline's reward."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from flows.configs import config_file
from vime_engine.config import load_yaml

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "vime_engine", "tasks", "flows")

# Runs in the installed venv, outside the repository; prints what it resolved as JSON.
RESOLVE = """
import importlib.util, json
import flows, tasks, vime_engine
from flows.configs import config_file
from flows.nightly_regression import nightly_regression
from flows.params import PipelineParams, load_params
from tasks.regression import load_baseline
from vime_engine.rewards import get_reward_fn

defaults = PipelineParams()
tiny = load_params(config_file("pipeline-tiny.yaml"))
reward = get_reward_fn(tiny.engine.flags.get("rm-type", "math"), tiny.engine.flags["custom-rm-path"])
print(json.dumps({
    "files": [flows.__file__, tasks.__file__, vime_engine.__file__, str(config_file("demo-engine.yaml")),
              str(config_file("train-demo.yaml"))],
    "tests_importable": importlib.util.find_spec("tests") is not None,
    "defaults": defaults.model_dump(),
    "tiny_reward": [reward("12ab", ""), reward("", "")],
    "baseline_metrics": [b.metric for b in load_baseline(config_file("nightly-baseline.yaml")).bands],
}))
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory) -> Path:
    """A fresh venv holding the vimeflow wheel (no editable link to the checkout); the heavy dependencies come
    from the project venv through a .pth file instead of being installed again."""
    tmp = tmp_path_factory.mktemp("installed")
    src = tmp / "src"  # a copy, so the build's build/ folder does not race with the checkout's
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist"), str(src)], check=True, env=_clean_env())
    [wheel] = (tmp / "dist").glob("vimeflow-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # A plain path line: the project venv's own .pth files (its editable vimeflow among them) are not processed.
    (Path(site) / "project-venv-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, env=_clean_env())
    return python


def test_the_wheel_runs_from_outside_the_repository_with_its_shipped_configs(installed_python, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    done = subprocess.run([installed_python, "-c", RESOLVE], cwd=outside, env=_clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    venv = installed_python.parent.parent
    for file in seen["files"]:  # the installed copies, not the checkout
        assert Path(file).is_relative_to(venv) and not Path(file).is_relative_to(REPO), file
    assert not seen["tests_importable"]

    demo = load_yaml(REPO / "flows" / "configs" / "demo-engine.yaml")
    defaults = seen["defaults"]
    assert defaults["model"]["source"] == demo["hf-checkpoint"]
    assert defaults["data"]["source"] == demo["prompt-data"]
    assert defaults["training"]["num_rollouts"] == demo["num-rollout"]
    for flag in ("rollout-batch-size", "rollout-max-response-len", "lr", "rm-type", "micro-batch-size"):
        assert defaults["engine"]["flags"][flag] == demo[flag], flag
    pairs = demo["eval-prompt-data"]
    assert [(d["name"], d["source"]) for d in defaults["evaluation"]["datasets"]] == list(zip(pairs[::2], pairs[1::2]))

    assert seen["tiny_reward"] == [0.5, 0.0]  # vime_engine.rewards.digit_share, shipped with the engine
    assert seen["baseline_metrics"] == [b["metric"] for b in load_yaml(config_file("nightly-baseline.yaml"))["bands"]]


def test_a_missing_shipped_config_is_an_error_naming_it():
    with pytest.raises(FileNotFoundError, match="no-such-config.yaml"):
        config_file("no-such-config.yaml")


@pytest.mark.slow
def test_the_installed_vimeflow_trains_the_tiny_model_with_the_shipped_reward(installed_python, tmp_path):
    flags = ["--hf-checkpoint", "builtin://tiny-qwen3", "--prompt-data", "builtin://arithmetic",
             "--input-key", "question", "--label-key", "answer", "--apply-chat-template",
             "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
             "--custom-rm-path", "vime_engine.rewards.digit_share:digit_share", "--vllm-kv-cache-gb", "0.25",
             "--output-dir", str(tmp_path / "run"), "--num-rollout", "1"]
    done = subprocess.run([installed_python.parent / "vimeflow", "train", *flags], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    [record] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout_id"] == 0 and 0.0 <= record["rollout/raw_reward"] <= 1.0


def test_the_installed_vimeflow_converts_on_cpu_and_back_exactly(installed_python, tmp_path):
    """megatron-core on a CPU-only machine through the product's own preparation, with nothing from tests/."""
    from vime_engine.models.builtin import materialize_builtin_model

    hf = materialize_builtin_model("tiny-qwen3", tmp_path / "hf")
    vimeflow = installed_python.parent / "vimeflow"
    for source, dest, direction in [("hf", "torch_dist", "hf_to_megatron"), ("torch_dist", "back", "megatron_to_hf")]:
        done = subprocess.run([vimeflow, "convert", source, dest, "--direction", direction], cwd=tmp_path,
                              env=_clean_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
