"""Where a run lives (storage prefix, local work directory) and the engine job every stage shares.

Local paths are stable per (storage root, run name): a re-run on the same machine finds the in-chunk
checkpoints of an interrupted attempt, and the engine sees the same --hf-checkpoint / --prompt-data paths it
saved into its checkpoints (it refuses to resume under different values of fields that change the math).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.staging import fetch
from tasks.storage import open_storage
from vime_engine.assets import cache_dir

log = logging.getLogger(__name__)
RUN_ID_FILE = "run-id"

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def run_prefix(run_name: str) -> str:
    """Where a run's objects live under the storage root."""
    return f"runs/{run_name}"


@dataclass(frozen=True)
class RunLayout:
    storage_root: str
    run_name: str
    work_dir: str

    @property
    def run_prefix(self) -> str:
        return run_prefix(self.run_name)

    @property
    def artifact_key(self) -> str:
        """Prefect artifact keys allow lowercase letters, digits and dashes only."""
        return "".join(c if c.isalnum() else "-" for c in self.run_name.lower()).strip("-")


def make_layout(storage_root: str, run_name: str) -> RunLayout:
    root_tag = hashlib.sha256(storage_root.encode()).hexdigest()[:8]
    return RunLayout(storage_root, run_name, str(cache_dir() / "work" / f"{root_tag}-{run_name}"))


def bind_work_dir(layout: RunLayout) -> None:
    """Make the local work directory belong to the run that the storage prefix holds now.

    The work directory caches the run's storage prefix and keeps in-chunk checkpoints not uploaded yet. If
    the prefix was removed to start over, the work directory of the earlier run would make chunks look
    finished; an id kept on both sides tells a re-run of the same run from a new run under the same name.
    """
    storage = open_storage(layout.storage_root).child(layout.run_prefix)
    if storage.exists(RUN_ID_FILE):
        run_id = storage.get_bytes(RUN_ID_FILE).decode()
    else:
        run_id = uuid.uuid4().hex
        storage.put_bytes(RUN_ID_FILE, run_id.encode())
    work_dir = Path(layout.work_dir)
    marker = work_dir / RUN_ID_FILE
    if marker.is_file() and marker.read_text() == run_id:
        return
    if work_dir.exists():
        log.warning("%s belongs to an earlier run whose storage prefix %s is gone: starting it afresh",
                    work_dir, storage.uri())
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True)
    marker.write_text(run_id)


@dataclass(frozen=True)
class DatasetRef:
    name: str  # "train" or the eval set's name
    uri: str
    manifest_hash: str
    file: str | None  # inside the staged tree; None = its only data file


@dataclass(frozen=True)
class EngineJob:
    """The engine configuration of a run with its assets still in the storage root."""

    flags: dict[str, Any]  # vime flags the pipeline does not manage
    num_rollouts: int
    model_uri: str
    model_manifest_hash: str
    train_data: DatasetRef
    eval_data: list[DatasetRef] = field(default_factory=list)
    ray_address: str | None = None
    # train-backend megatron: the model converted to torch_dist, the trainer's initial weights (--ref-load);
    # --hf-checkpoint stays the HF model, which vLLM, the tokenizer and the HF export read.
    torch_dist_uri: str | None = None
    torch_dist_manifest_hash: str | None = None

    @property
    def identity_hash(self) -> str:
        """EngineConfig.math_hash with local paths replaced by the staged content's manifest hashes."""
        from vime_engine.config import from_flat

        values = {**self.flags, "num-rollout": self.num_rollouts,
                  "hf-checkpoint": f"sha256:{self.model_manifest_hash}",
                  "prompt-data": f"sha256:{self.train_data.manifest_hash}", "save": "<save>"}
        return from_flat(values).math_hash()

    @property
    def evaluation_hash(self) -> str:
        """The eval sets' contents and the eval settings: a chunk's results carry its evaluations, which the
        math hash leaves out (they do not change the weights)."""
        settings = {k: v for k, v in self.flags.items()
                    if k.replace("_", "-").startswith(("eval-", "n-samples-per-eval-prompt"))}
        sets = [(ref.name, ref.manifest_hash, ref.file) for ref in self.eval_data]
        return hashlib.sha256(json.dumps([settings, sets], sort_keys=True, default=str).encode()).hexdigest()


def _data_file(tree: Path, wanted: str | None) -> Path:
    if wanted is not None:
        path = tree / wanted
        if not path.is_file():
            raise FileNotFoundError(f"{wanted} is not in the staged dataset at {tree}")
        return path
    files = sorted(p for p in tree.rglob("*") if p.suffix in DATA_SUFFIXES and p.name != "manifest.json")
    if len(files) != 1:
        raise ValueError(f"the staged dataset holds {len(files)} data files ({[f.name for f in files]}): "
                         "name one with `file`")
    return files[0]


def localize(job: EngineJob, layout: RunLayout) -> dict[str, Any]:
    """Fetch (sha256-verified, skipping what is already there) the model and data; the full engine flags."""
    work = Path(layout.work_dir)
    assets = work / "assets"
    model_dir = fetch(job.model_uri, assets / f"model-{job.model_manifest_hash[:16]}")

    def local(ref: DatasetRef) -> str:
        tree = fetch(ref.uri, assets / f"data-{ref.manifest_hash[:16]}")
        return str(_data_file(tree, ref.file))

    flags: dict[str, Any] = {
        **job.flags,
        "hf-checkpoint": str(model_dir),
        "prompt-data": local(job.train_data),
        "num-rollout": job.num_rollouts,
        "save": str(work / "checkpoints"),
        "output-dir": str(work / "output"),
    }
    if job.torch_dist_uri is not None:
        if job.flags.get("ref-load") is not None:
            raise ValueError(f"engine flag ref-load {job.flags['ref-load']!r}: with train-backend megatron the "
                             "pipeline sets --ref-load to the converted model; remove the flag")
        flags["ref-load"] = str(fetch(job.torch_dist_uri, assets / f"torch_dist-{job.torch_dist_manifest_hash[:16]}"))
    if job.eval_data:
        flags["eval-prompt-data"] = [v for ref in job.eval_data for v in (ref.name, local(ref))]
    if job.ray_address:
        flags["ray-address"] = job.ray_address
    return flags
