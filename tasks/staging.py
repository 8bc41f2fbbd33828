"""Stage models and datasets into the run's storage root, and fetch staged assets back down.

Plain functions (the pipeline wraps them in Prefect tasks). Sources:

- ``hf://ORG/NAME[@REV]`` or ``hf://models/ORG/NAME[@REV]`` (models), ``hf://datasets/ORG/NAME[@REV]``
  (datasets); ``?include=PAT[,PAT...]`` restricts the files (``allow_patterns``). ``HF_ENDPOINT`` and
  ``HF_TOKEN`` are read at call time.
- ``file:///path`` or ``/path``: a directory, or a single file (staged as a one-file tree);
- ``s3://…`` / ``obs://…``: a committed tree (its manifest is verified) or, without a manifest, every
  object under the prefix;
- ``builtin://NAME``: the engine's built-in models (``vime_engine.models.builtin``) and synthetic datasets
  (``vime_engine.data.synthetic``).

Layout and idempotence: an asset lands at ``{root}/{models|datasets}/{slug}/{revision}``, where revision is
the HF commit sha (plus a hash of non-default patterns), the source manifest's hash, or the hash of the
content itself. The destination is therefore content-addressed: when its manifest already exists, nothing
is downloaded or uploaded again.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from vime_engine.checkpoint.manifest import FileEntry
from tasks.storage import (
    NotFoundError, PermanentStorageError, Storage, StorageError, TransientStorageError, join_key, open_storage,
)
from tasks.storage.errors import classify

# Weights in safetensors, configs, tokenizers, templates; not .bin/.pt/.h5/.onnx duplicates of the weights.
DEFAULT_MODEL_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py")


@dataclass(frozen=True)
class StagedAsset:
    kind: str  # "model" | "dataset"
    uri: str  # the committed prefix
    manifest_hash: str
    source: str
    revision: str
    files: dict[str, FileEntry]
    uploaded: bool  # False when the asset was already staged and nothing was transferred


@dataclass(frozen=True)
class SourceSpec:
    scheme: str  # hf | file | s3 | obs | builtin
    location: str  # repo id, path, URI or builtin name
    revision: str | None
    patterns: tuple[str, ...] | None
    repo_type: str | None = None  # "model" | "dataset" for hf


def parse_source(source: str, kind: str) -> SourceSpec:
    """Split a source string into its parts; raises ValueError for unknown schemes or malformed URIs."""
    if source.startswith("/"):
        return SourceSpec("file", source, None, None)
    u = urlsplit(source)
    query = parse_qs(u.query)
    patterns = tuple(p for v in query.get("include", []) for p in v.split(",") if p) or None
    if u.scheme == "hf":
        path = (u.netloc + u.path).strip("/")
        repo_type = kind
        if path.startswith(("datasets/", "models/")):
            prefix, path = path.split("/", 1)
            repo_type = prefix[:-1]
        repo_id, _, rev = path.partition("@")
        if repo_id.count("/") != 1:
            raise ValueError(f"expected hf://[datasets/]ORG/NAME[@REVISION], got {source!r}")
        return SourceSpec("hf", repo_id, rev or None, patterns, repo_type)
    if u.scheme == "file":
        return SourceSpec("file", u.path, None, None)
    if u.scheme in ("s3", "obs"):
        return SourceSpec(u.scheme, f"{u.scheme}://{u.netloc}{u.path}", None, None)
    if u.scheme == "builtin":
        return SourceSpec("builtin", (u.netloc + u.path).strip("/"), None, None)
    raise ValueError(f"unsupported source {source!r}: use hf://, file://, s3://, obs:// or builtin://")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "asset"


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def content_revision(files: dict[str, FileEntry]) -> str:
    """A tree's identity from its contents only: hash of sorted (path, size, sha256)."""
    return _short("".join(f"{k}\0{e.size}\0{e.sha256}\n" for k, e in sorted(files.items())))


def stage_model(source: str, storage_root: str) -> StagedAsset:
    """Stage a model (HF repo, local dir, object-store prefix or built-in) under ``{root}/models/``."""
    return _stage(parse_source(source, "model"), source, storage_root, "model")


def stage_dataset(source: str, storage_root: str) -> StagedAsset:
    """Stage a dataset (HF dataset repo, local file/dir, object-store prefix or built-in) under ``{root}/datasets/``."""
    return _stage(parse_source(source, "dataset"), source, storage_root, "dataset")


def fetch(uri: str, local_dir: str | Path) -> Path:
    """Bring a staged asset or checkpoint (any committed prefix) down to ``local_dir``, sha256-verified."""
    local_dir = Path(local_dir)
    open_storage(uri).fetch_tree("", local_dir)
    return local_dir


def _stage(spec: SourceSpec, source: str, storage_root: str, kind: str) -> StagedAsset:
    root = open_storage(storage_root)
    area = f"{kind}s"
    with tempfile.TemporaryDirectory(prefix=f"vimeflow-stage-{kind}-") as tmp:
        work = Path(tmp)
        digests = None  # known up front only for local sources (hashed once for the revision)
        if spec.scheme == "hf":
            revision = _hf_resolve(spec)
            if spec.patterns is not None or kind == "model":
                patterns = spec.patterns or DEFAULT_MODEL_PATTERNS
                rev_dir = revision if spec.patterns is None else f"{revision}-{_short(','.join(patterns))[:8]}"
            else:
                patterns, rev_dir = None, revision
            dest = join_key(area, _slug(spec.location.replace("/", "--")), rev_dir)
            if (done := _already_staged(root, dest, kind, source, revision)) is not None:
                return done
            local = _hf_download(spec, revision, patterns, work)
        elif spec.scheme in ("s3", "obs"):
            src = open_storage(spec.location)
            revision = _remote_revision(src)
            dest = join_key(area, _slug(spec.location.rstrip("/").rsplit("/", 1)[-1]), revision)
            if (done := _already_staged(root, dest, kind, source, revision)) is not None:
                return done
            local = work / "tree"
            if src.exists("manifest.json"):
                src.fetch_tree("", local)
                (local / "manifest.json").unlink()
            else:
                src.get_tree("", local)
        else:
            local, name = _materialize_local(spec, kind, work)
            digests = root.digest_tree(local)
            revision = content_revision({k: d.entry for k, d in digests.items()})
            dest = join_key(area, _slug(name), revision)
            if (done := _already_staged(root, dest, kind, source, revision)) is not None:
                return done
        meta = {"kind": kind, "source": source, "revision": revision}
        manifest = root.commit_tree(local, dest, meta=meta, digests=digests)
        return StagedAsset(kind, root.uri(dest), manifest.hash, source, revision, manifest.files, True)


def _already_staged(root: Storage, dest: str, kind: str, source: str, revision: str) -> StagedAsset | None:
    try:
        manifest, raw = root.read_manifest(dest)
    except NotFoundError:
        return None
    return StagedAsset(kind, root.uri(dest), hashlib.sha256(raw).hexdigest(), source, revision, manifest.files,
                       False)


def _materialize_local(spec: SourceSpec, kind: str, work: Path) -> tuple[Path, str]:
    """A local directory holding the source's files, and the asset's name."""
    if spec.scheme == "file":
        path = Path(spec.location)
        if path.is_dir():
            return path, path.name
        if path.is_file():
            tree = work / "tree"
            tree.mkdir()
            shutil.copy2(path, tree / path.name)
            return tree, path.stem
        raise NotFoundError("stage", path.as_uri() if path.is_absolute() else str(path), code="NoSuchFile",
                            message="no such file or directory on this machine")
    from vime_engine.assets import BUILTIN, check_builtin

    check_builtin(BUILTIN + spec.location, kind)  # a ConfigError (exit 2) listing the built-in names
    if kind == "model":
        from vime_engine.assets import resolve_model
        # From the machine's cache: converting SmolLM2's GGUF takes ~20 s, once per machine instead of per stage.
        return Path(resolve_model(f"builtin://{spec.location}")), spec.location
    from vime_engine.data.synthetic import materialize_builtin_dataset
    tree = work / "tree"
    materialize_builtin_dataset(spec.location, tree)
    return tree, spec.location


def _remote_revision(src: Storage) -> str:
    """The source manifest's hash when committed; else a hash of the listing (key, size, ETag)."""
    try:
        return _short(src.read_manifest("")[0].hash)
    except NotFoundError:
        objs = src.list("")
        if not objs:
            raise NotFoundError("stage", src.uri(), message="no objects under this prefix") from None
        return _short("".join(f"{o.key}\0{o.size}\0{o.etag}\n" for o in objs))


def _hf_api():
    from huggingface_hub import HfApi
    return HfApi(endpoint=os.environ.get("HF_ENDPOINT"), token=os.environ.get("HF_TOKEN"))


def _hf_uri(spec: SourceSpec, revision: str | None) -> str:
    return f"hf://{spec.repo_type}s/{spec.location}@{revision or 'main'}"


def _hub_error(op: str, uri: str, exc: Exception) -> StorageError:
    """A huggingface_hub failure as the storage error that decides retry: 4xx final, 5xx and transport retried."""
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, HTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
        RepositoryNotFoundError, RevisionNotFoundError,
    )
    if isinstance(exc, RevisionNotFoundError):
        return NotFoundError(op, uri, status=404, code="RevisionNotFound",
                             message="no branch, tag or commit of that name in the repository")
    if isinstance(exc, GatedRepoError):
        return PermanentStorageError(op, uri, status=exc.response.status_code, code="GatedRepo",
                                     message="a gated repository: accept its conditions on the Hub and set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError):
        return NotFoundError(op, uri, status=404, code="RepoNotFound",
                             message="repository not found (or private and HF_TOKEN missing)")
    if isinstance(exc, OfflineModeIsEnabled):
        return PermanentStorageError(op, uri, code="HubOffline", message="HF_HUB_OFFLINE is set")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        return classify(op, uri, status=status, code=None, message=exc.server_message or "")
    if isinstance(exc, (HTTPError, LocalEntryNotFoundError)):  # the Hub unreachable (after the client's retries)
        return TransientStorageError(op, uri, code=type(exc).__name__, message=str(exc).splitlines()[0])
    raise exc


def _hf_resolve(spec: SourceSpec) -> str:
    """Branch/tag/sha -> commit sha (one API call; no download)."""
    uri = _hf_uri(spec, spec.revision)
    try:
        info = _hf_api().repo_info(spec.location, repo_type=spec.repo_type, revision=spec.revision)
    except Exception as exc:  # noqa: BLE001  (_hub_error re-raises what is not the Hub's)
        raise _hub_error("resolve", uri, exc) from None
    if not info.sha:
        raise PermanentStorageError("resolve", uri, message="the Hub returned no commit sha")
    return info.sha


def _hf_download(spec: SourceSpec, revision: str, patterns, work: Path) -> Path:
    from huggingface_hub import snapshot_download
    uri = _hf_uri(spec, revision)
    try:
        snapshot = snapshot_download(spec.location, repo_type=spec.repo_type, revision=revision,
                                     allow_patterns=list(patterns) if patterns else None,
                                     cache_dir=work / "hf-cache", endpoint=os.environ.get("HF_ENDPOINT"),
                                     token=os.environ.get("HF_TOKEN"))
    except Exception as exc:  # noqa: BLE001
        raise _hub_error("download", uri, exc) from None
    if not any(Path(snapshot).rglob("*")):
        raise NotFoundError("stage", uri, message=f"no files match {list(patterns or [])}")
    return Path(snapshot)
