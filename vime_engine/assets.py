"""`builtin://NAME` references to the models and datasets that ship with the engine, made local on demand."""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN = "builtin://"


def cache_dir() -> Path:
    return Path(os.environ.get("VIMEFLOW_CACHE", Path.home() / ".cache" / "vimeflow"))


def resolve_model(ref: str) -> str:
    """A local HF directory for `ref`: built-in models are materialized under the cache once."""
    if not ref.startswith(BUILTIN):
        return ref
    from vime_engine.models.builtin import materialize_builtin_model

    name = ref.removeprefix(BUILTIN)
    return str(materialize_builtin_model(name, cache_dir() / "models" / name))


def resolve_dataset(ref: str) -> str:
    """A local dataset file for `ref`: built-in datasets are written under the cache once."""
    if not ref.startswith(BUILTIN):
        return ref
    from vime_engine.data.synthetic import materialize_builtin_dataset

    return str(materialize_builtin_dataset(ref.removeprefix(BUILTIN), cache_dir() / "datasets"))


def resolve_config_assets(values: dict) -> dict:
    """The same flat config values with every builtin:// model and dataset reference made local."""
    out = dict(values)
    for key in ("hf_checkpoint", "hf-checkpoint", "ref_load", "ref-load"):
        if isinstance(out.get(key), str):
            out[key] = resolve_model(out[key])
    for key in ("prompt_data", "prompt-data"):
        if isinstance(out.get(key), str):
            out[key] = resolve_dataset(out[key])
    for key in ("eval_prompt_data", "eval-prompt-data"):
        if isinstance(out.get(key), list):
            out[key] = [resolve_dataset(v) if i % 2 else v for i, v in enumerate(out[key])]
    return out
