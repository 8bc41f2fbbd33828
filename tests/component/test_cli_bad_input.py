"""Bad input through the real CLI: one readable message on stderr, a non-zero exit, no traceback unless --verbose,
and nothing started or written (the table of cases is tests/unit/test_bad_input.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _vimeflow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) for i in range(2)]
    path.write_bytes(("\n".join(rows) + "\n").encode() + b'{"prompt": "caf\xe9", "label": "1"}\n')
    return path


CASES = [
    # (id, extra CLI arguments, config file text or None, what stderr must name)
    ("non-utf8-row", ["--output-dir", "{tmp}/out"], None, ["data.jsonl, row 3", "not UTF-8", "convert the file"]),
    ("duplicate-yaml-key", ["--output-dir", "{tmp}/out"], "num-rollout: 1\nnum-rollout: 2\n",
     ["c.yaml, line 2", "duplicate key 'num-rollout'"]),
    ("kl-coef-with-grpo", ["--kl-coef", "0.1", "--output-dir", "{tmp}/out"], None,
     ["--kl-coef 0.1", "--use-kl-loss --kl-loss-coef 0.1"]),
    ("unknown-builtin-model", ["--hf-checkpoint", "builtin://no-such-model", "--output-dir", "{tmp}/out"], None,
     ["--hf-checkpoint builtin://no-such-model", "no such built-in model", "builtin://tiny-qwen3"]),
    # the command writes its engine log under --output-dir before the engine's preflight runs
    ("output-dir-under-a-file", ["--output-dir", "{tmp}/data.jsonl/out"], None,
     ["--output-dir", "data.jsonl is a file, so no directory can be made under it",
      "give a directory for the run's logs and metrics"]),
]


@pytest.mark.parametrize(("extra", "config", "named"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_train_refuses_bad_input_with_one_message_before_any_worker_starts(tmp_path, tiny_model, data, extra,
                                                                            config, named):
    args = ["train", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(data),
            *(a.format(tmp=tmp_path) for a in extra)]
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        args += ["--config", str(tmp_path / "c.yaml")]
    run = _vimeflow(*args)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout
    assert sum(line.startswith("error:") for line in run.stderr.splitlines()) == 1, run.stderr
    message = run.stderr[run.stderr.index("error:"):]  # the one message, the last thing printed
    for part in named:
        assert part in message, message
    assert not (tmp_path / "out").exists()  # nothing written: the run stopped before its workers and metrics


def test_verbose_adds_the_traceback(tmp_path, tiny_model, data):
    run = _vimeflow("train", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(data), "--verbose")
    assert run.returncode == 2
    assert "Traceback" in run.stderr and "preflight" in run.stderr
    assert run.stderr.rstrip().splitlines()[-1].startswith("error:")


@pytest.mark.parametrize(("text", "named"), [
    ("training:\n\tnum_rollouts: 2\n", ["pipeline.yaml, line 2", "never tabs"]),
    # refused with the parameters, before Prefect starts (a staging task raised ValueError: exit 1)
    ("model:\n  source: builtin://no-such-model\n",
     ["pipeline.yaml: model.source 'builtin://no-such-model': no such built-in model", "builtin://tiny-qwen3"]),
], ids=["tab", "unknown-builtin-model"])
def test_run_refuses_bad_parameters_with_one_message(tmp_path, text, named):
    (tmp_path / "pipeline.yaml").write_text(text)
    run = _vimeflow("run", "--config", str(tmp_path / "pipeline.yaml"))
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "validation error" not in run.stderr
    assert sum(line.startswith("error:") for line in run.stderr.splitlines()) == 1, run.stderr
    for part in named:
        assert part in run.stderr, run.stderr


@pytest.mark.parametrize("case", ["missing-bucket", "refused-secret"])
def test_run_refuses_an_unusable_storage_root_before_prefect_starts(case, tmp_path, moto_endpoint, moto_with_iam,
                                                                    storage_env):
    """A 403 or a missing bucket printed Prefect's lines for every stage's failed task, then the flow's, before its
    one good line: the root is checked before Prefect starts."""
    import boto3

    env = {**os.environ, "S3_ADDRESSING_STYLE": "path"}
    if case == "missing-bucket":
        env["AWS_ENDPOINT_URL"], root = moto_endpoint, "s3://vf-no-such-bucket/runs"
        named = ["check s3://vf-no-such-bucket/runs failed (status=404 code=NoSuchBucket)",
                 "the bucket does not exist: create it or fix the storage root"]
    else:  # a real key id with the wrong secret: moto checks the signature as S3 does
        iam = moto_with_iam
        boto3.client("s3", endpoint_url=iam.url, region_name="us-east-1", aws_access_key_id=iam.access_key,
                     aws_secret_access_key=iam.secret_key).create_bucket(Bucket="vf-refused")
        env.update(AWS_ENDPOINT_URL=iam.url, AWS_ACCESS_KEY_ID=iam.access_key, AWS_SECRET_ACCESS_KEY="not-the-secret")
        root = "s3://vf-refused/runs"
        named = ["check s3://vf-refused/runs failed (status=403",
                 "check the access key, its secret and the bucket policy"]
    (tmp_path / "pipeline.yaml").write_text(f"storage:\n  root: {root}\n")
    run = _vimeflow("run", "--config", str(tmp_path / "pipeline.yaml"), env=env)
    assert run.returncode == 2, run.stderr
    assert run.stdout == "" and run.stderr.startswith("error: ") and len(run.stderr.splitlines()) == 1, run.stderr
    for part in named:
        assert part in run.stderr, run.stderr
    assert "not-the-secret" not in run.stderr


def test_train_refuses_truncated_weights_before_ray_starts(tmp_path, tiny_model, data):
    model = tmp_path / "model"
    model.mkdir()
    for path in tiny_model.iterdir():
        if path.is_file():
            (model / path.name).write_bytes(path.read_bytes())
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[:len(weights) // 2])  # a download cut short
    run = _vimeflow("train", "--hf-checkpoint", str(model), "--prompt-data", str(data),
                    "--save", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "out"))
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "Ray" not in run.stderr and "ActorDiedError" not in run.stderr
    assert "model.safetensors: truncated or corrupt" in run.stderr and "download (or convert) the model" in run.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "out").exists()
