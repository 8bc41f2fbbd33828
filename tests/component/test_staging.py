"""Staging models and datasets from the (local) HF Hub, local paths, object stores and built-ins, into s3://,
obs:// and file:// roots; fetching them back verified."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from vime_engine.checkpoint.manifest import MANIFEST_NAME
from vime_engine.config import ConfigError
from tasks.staging import fetch, parse_source, stage_dataset, stage_model
from tasks.storage import NotFoundError, PermanentStorageError, open_storage
from tests.support.prefect_server import task_attempts

RNG = random.Random(3)
MODEL_V1 = {
    "config.json": b'{"model_type": "qwen3", "hidden_size": 128}',
    "model.safetensors": RNG.randbytes(300_000),
    "tokenizer.json": b'{"version": "1.0"}',
    "pytorch_model.bin": RNG.randbytes(1000),  # a duplicate of the weights: not staged by default
    "README.md": b"# tiny",
}
MODEL_V2 = {**MODEL_V1, "config.json": b'{"model_type": "qwen3", "hidden_size": 256}'}
DATASET = {
    "data/train-00000.parquet": RNG.randbytes(5000),
    "data/test-00000.parquet": RNG.randbytes(3000),
    "README.md": b"# math",
    "extra/notes.txt": b"unused",
}


def files_of(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


@pytest.fixture
def s3_root(fault_proxy, make_bucket, monkeypatch):
    """An s3:// root reached through the proxy, so tests can count what goes over the wire."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    return f"s3://{make_bucket()}/run-1"


@pytest.fixture
def hf_model(hf_hub):
    repo = f"org/tiny-{RNG.randrange(10**9)}"
    old = hf_hub.add_revision("model", repo, MODEL_V1, tags=("v1",))
    new = hf_hub.add_revision("model", repo, MODEL_V2)
    return repo, old, new


def test_hf_model_is_staged_at_its_commit_and_restaged_for_free(hf_endpoint, hf_hub, hf_model, s3_root,
                                                                fault_proxy, tmp_path):
    repo, _, head = hf_model
    asset = stage_model(f"hf://{repo}", s3_root)
    assert asset.revision == head and asset.uploaded
    assert asset.uri == f"{s3_root}/models/{repo.replace('/', '--')}/{head}"
    assert set(asset.files) == {"config.json", "model.safetensors", "tokenizer.json"}

    local = fetch(asset.uri, tmp_path / "model")
    got = files_of(local)
    assert json.loads(got.pop(MANIFEST_NAME))["meta"] == {"kind": "model", "source": f"hf://{repo}",
                                                          "revision": head}
    assert got == {k: MODEL_V2[k] for k in asset.files}

    fault_proxy.reset()
    hub_requests = len(hf_hub.requests)
    again = stage_model(f"hf://{repo}", s3_root)
    assert not again.uploaded and again.manifest_hash == asset.manifest_hash and again.uri == asset.uri
    assert fault_proxy.count(lambda e: e.method in ("PUT", "POST")) == 0
    assert [p for _, p in hf_hub.requests[hub_requests:] if "/resolve/" in p] == []  # nothing downloaded


def test_hf_model_revisions_by_tag_and_sha(hf_endpoint, hf_model, tmp_path):
    repo, old, head = hf_model
    root = (tmp_path / "store").as_uri()
    by_tag = stage_model(f"hf://{repo}@v1", root)
    by_sha = stage_model(f"hf://models/{repo}@{old}", root)
    assert by_tag.revision == by_sha.revision == old
    assert by_sha.uri == by_tag.uri and not by_sha.uploaded
    assert files_of(fetch(by_tag.uri, tmp_path / "v1"))["config.json"] == MODEL_V1["config.json"]
    with pytest.raises(NotFoundError) as err:
        stage_model(f"hf://{repo}@no-such-branch", root)
    assert err.value.code == "RevisionNotFound" and repo in str(err.value)
    with pytest.raises(NotFoundError, match="RepoNotFound"):
        stage_model("hf://org/does-not-exist", root)


def test_hf_dataset_with_include_patterns_into_obs(hf_endpoint, hf_hub, fault_proxy, make_bucket, monkeypatch,
                                                   tmp_path):
    monkeypatch.setenv("OBS_ENDPOINT", fault_proxy.url)
    sha = hf_hub.add_revision("dataset", "org/math-17k", DATASET)
    root = f"obs://{make_bucket()}/run-1"
    full = stage_dataset("hf://datasets/org/math-17k", root)
    assert set(full.files) == set(DATASET) and full.revision == sha
    only = stage_dataset("hf://datasets/org/math-17k?include=data/train-*", root)
    assert set(only.files) == {"data/train-00000.parquet"} and only.uri != full.uri
    assert files_of(fetch(only.uri, tmp_path / "ds"))["data/train-00000.parquet"] == DATASET[
        "data/train-00000.parquet"]
    with pytest.raises(NotFoundError, match="no files match"):
        stage_dataset("hf://datasets/org/math-17k?include=*.csv", root)


def test_local_file_and_directory_sources_are_content_addressed(s3_root, fault_proxy, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    first = stage_dataset(str(data), s3_root)
    assert set(first.files) == {"gsm8k.jsonl"} and "/datasets/gsm8k/" in first.uri
    assert stage_dataset(data.as_uri(), s3_root).uploaded is False
    data.write_text('{"question": "2+2?", "answer": "#### 4"}\n')
    changed = stage_dataset(str(data), s3_root)
    assert changed.uploaded and changed.revision != first.revision

    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    staged = stage_model(model_dir.as_uri(), s3_root)
    assert staged.uri.startswith(f"{s3_root}/models/my-model/") and set(staged.files) == {"config.json"}
    with pytest.raises(NotFoundError):
        stage_model(str(tmp_path / "missing"), s3_root)


def test_object_store_source_is_verified_and_restaged_across_backends(s3_root, fault_proxy, make_bucket,
                                                                      monkeypatch, tmp_path):
    monkeypatch.setenv("OBS_ENDPOINT", fault_proxy.url)
    src_dir = tmp_path / "ckpt"
    src_dir.mkdir()
    (src_dir / "model.safetensors").write_bytes(RNG.randbytes(20_000))
    src = open_storage(s3_root).child("exports/policy-7")
    committed = src.commit_tree(src_dir, "")
    obs_root = f"obs://{make_bucket()}/prod"
    asset = stage_model(src.uri(), obs_root)
    assert asset.files == committed.files and asset.uri.startswith(f"{obs_root}/models/policy-7/")
    assert not stage_model(src.uri(), obs_root).uploaded

    raw = open_storage(s3_root).child("raw-data")  # no manifest: every object under the prefix
    raw.put_bytes("part-0.jsonl", b'{"prompt": "x"}\n')
    assert set(stage_dataset(raw.uri(), obs_root).files) == {"part-0.jsonl"}


def test_builtin_dataset_and_model(tmp_path):
    root = (tmp_path / "store").as_uri()
    ds = stage_dataset("builtin://arithmetic", root)
    assert set(ds.files) == {"arithmetic.jsonl"} and ds.uploaded
    assert not stage_dataset("builtin://arithmetic", root).uploaded
    model = stage_model("builtin://tiny-qwen3", root)
    assert "config.json" in model.files and any(f.endswith(".safetensors") for f in model.files)
    assert stage_model("builtin://tiny-qwen3", root).revision == model.revision  # deterministic build
    local = fetch(model.uri, tmp_path / "m")
    assert (local / "config.json").is_file() and (local / MANIFEST_NAME).is_file()
    with pytest.raises(ConfigError, match="builtin://nope: no such built-in dataset; the built-in datasets are "
                                          "builtin://arithmetic"):  # exit 2, the input's fault
        stage_dataset("builtin://nope", root)


def test_source_parsing():
    s = parse_source("hf://datasets/BytedTsinghua-SIA/DAPO-Math-17k@v2?include=data/*.parquet,*.md", "dataset")
    assert (s.scheme, s.location, s.revision, s.patterns, s.repo_type) == (
        "hf", "BytedTsinghua-SIA/DAPO-Math-17k", "v2", ("data/*.parquet", "*.md"), "dataset")
    assert parse_source("hf://Qwen/Qwen3-0.6B", "model").repo_type == "model"
    with pytest.raises(ValueError):
        parse_source("hf://just-a-name", "model")
    with pytest.raises(ValueError):
        parse_source("ftp://x/y", "model")


def test_builtin_model_comes_from_the_machine_cache_and_an_older_builders_copy_is_rebuilt(tmp_path, monkeypatch):
    from vime_engine.models.builtin import BUILDER_VERSION

    monkeypatch.setenv("VIMEFLOW_CACHE", str(tmp_path / "cache"))
    first = stage_model("builtin://tiny-qwen3", (tmp_path / "root-a").as_uri())
    cached = tmp_path / "cache" / "models" / "tiny-qwen3"
    marker = cached / ".vimeflow-builtin.json"
    assert json.loads(marker.read_text())["builder_version"] == BUILDER_VERSION

    (cached / "config.json").write_text("{}")  # what an older builder might have left
    marker.write_text(json.dumps({"builtin": "tiny-qwen3"}))
    again = stage_model("builtin://tiny-qwen3", (tmp_path / "root-b").as_uri())
    assert again.revision == first.revision, "the stale copy was used instead of being rebuilt"


STAGING_FAILURES = {
    # case: (model source, storage root, error type, what the message must name)
    "missing hub revision": ("hf://{repo}@no-such-rev", "{file_root}", NotFoundError,
                             ["hf://models/{repo}@no-such-rev", "RevisionNotFound", "no branch, tag or commit"]),
    "missing file:// model": ("file://{tmp}/no-such-model", "{file_root}", NotFoundError,
                              ["file://{tmp}/no-such-model", "no such file or directory"]),
    "missing bucket": ("builtin://tiny-qwen3", "s3://vf-missing-{n}/run-1", PermanentStorageError,
                       ["s3://vf-missing-{n}/run-1", "NoSuchBucket", "the bucket does not exist"]),
}


def _run_pipeline(model_source: str, root: str):
    """rl-pipeline in process (under prefect_harness) on a model and a storage root; returns its final state."""
    from flows.params import EvaluationSettings, ModelSource, StorageTarget, TrainData
    from flows.rl_pipeline import rl_pipeline

    return rl_pipeline(model=ModelSource(source=model_source), data=TrainData(source="builtin://arithmetic"),
                       evaluation=EvaluationSettings(datasets=[]), storage=StorageTarget(root=root),
                       return_state=True)


@pytest.mark.parametrize("case", STAGING_FAILURES)
def test_a_permanent_staging_error_fails_the_pipeline_once_as_itself(case, prefect_harness, hf_endpoint, hf_hub,
                                                                      hf_model, storage_env, moto_endpoint,
                                                                      monkeypatch, tmp_path):
    """Not retried, and the flow's exception is the staging error naming the URI (not the AttributeError of a
    flow that went on with a failed task's None)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    source, root, error, names = STAGING_FAILURES[case]
    values = {"repo": hf_model[0], "tmp": tmp_path, "file_root": (tmp_path / "store").as_uri(),
              "n": RNG.randrange(10**9)}
    source, root, names = source.format(**values), root.format(**values), [n.format(**values) for n in names]
    hub_requests = len(hf_hub.requests)

    state = _run_pipeline(source, root)
    with pytest.raises(error) as failure:
        state.result()
    for name in names:
        assert name in str(failure.value)
    assert task_attempts(state.state_details.flow_run_id)["stage_model"] == 1
    if source.startswith("hf://"):  # one question to the Hub: its 404 is an answer, not a fault
        asked = [p for _, p in hf_hub.requests[hub_requests:] if "no-such-rev" in p]
        assert asked == [f"/api/models/{hf_model[0]}/revision/no-such-rev"]


@pytest.mark.parametrize("wrong", ["secret", "access key"])
def test_wrong_s3_credentials_fail_the_pipeline_once_with_a_403_naming_the_bucket(wrong, prefect_harness,
                                                                                  moto_with_iam, storage_env,
                                                                                  monkeypatch, caplog):
    """Against a server that checks SigV4 signatures (moto with IAM auth): a wrong secret for a real key, or a
    key it does not know, is a 403 that is not retried; nothing reaches the bucket; no credential is shown."""
    import boto3

    s3 = moto_with_iam
    bucket = f"vf-auth-{RNG.randrange(10**9)}"
    boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1", aws_access_key_id=s3.access_key,
                 aws_secret_access_key=s3.secret_key).create_bucket(Bucket=bucket)
    bad_key, bad_secret = (s3.access_key, "wrong-secret-Vq0x7") if wrong == "secret" else ("AKIAVFUNKNOWN0000000",
                                                                                            s3.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", bad_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bad_secret)

    state = _run_pipeline("builtin://tiny-qwen3", f"s3://{bucket}/run-1")
    with pytest.raises(PermanentStorageError) as failure:
        state.result()
    message = str(failure.value)
    code = "SignatureDoesNotMatch" if wrong == "secret" else "InvalidAccessKeyId"
    assert f"s3://{bucket}/run-1/" in message and f"status=403 code={code}" in message
    assert "check the access key, its secret and the bucket policy" in message
    assert task_attempts(state.state_details.flow_run_id)["stage_model"] == 1
    assert bad_secret not in message and bad_secret not in caplog.text
    listing = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1", aws_access_key_id=s3.access_key,
                           aws_secret_access_key=s3.secret_key).list_objects_v2(Bucket=bucket)
    assert listing["KeyCount"] == 0
