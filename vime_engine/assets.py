"""`builtin://NAME` references to the models and datasets that ship with the engine, made local on demand."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from vime_engine.config.errors import ConfigError, flag_name

BUILTIN = "builtin://"


def cache_dir() -> Path:
    return Path(os.environ.get("VIMEFLOW_CACHE", Path.home() / ".cache" / "vimeflow"))


class UnknownBuiltin(ConfigError):
    """A builtin:// reference to a name the engine does not ship."""


def _require_known(ref: str, known: Iterable[str], kind: str) -> str:
    """The name in `ref`, checked before anything is built: a typo lists the names there are."""
    name = ref.removeprefix(BUILTIN)
    if name not in known:
        raise UnknownBuiltin(f"{ref}: no such built-in {kind}; the built-in {kind}s are "
                             f"{', '.join(BUILTIN + k for k in known)}")
    return name


def check_builtin(ref: str, kind: str) -> None:
    """That `ref` (builtin://NAME) names a built-in `kind` ("model" or "dataset"), without building it; else
    UnknownBuiltin listing the names there are."""
    if kind == "model":
        from vime_engine.models.builtin import BUILTIN_MODELS as known
    else:
        from vime_engine.data.synthetic import BUILTIN_DATASETS as known
    _require_known(ref, known, kind)


def resolve_model(ref: str) -> str:
    """A local HF directory for `ref`: built-in models are materialized under the cache once."""
    if not ref.startswith(BUILTIN):
        return ref
    from vime_engine.models.builtin import BUILTIN_MODELS, materialize_builtin_model

    name = _require_known(ref, BUILTIN_MODELS, "model")
    return str(materialize_builtin_model(name, cache_dir() / "models" / name))


def resolve_dataset(ref: str) -> str:
    """A local dataset file for `ref`: built-in datasets are written under the cache once."""
    if not ref.startswith(BUILTIN):
        return ref
    from vime_engine.data.synthetic import BUILTIN_DATASETS, materialize_builtin_dataset

    name = _require_known(ref, BUILTIN_DATASETS, "dataset")
    return str(materialize_builtin_dataset(name, cache_dir() / "datasets"))


def resolve_config_assets(values: dict) -> dict:
    """The same flat config values with every builtin:// model and dataset reference made local; an unknown name
    is a ConfigError naming the flag and the names there are."""
    out = dict(values)
    try:
        for key in ("hf_checkpoint", "hf-checkpoint", "ref_load", "ref-load"):
            if isinstance(out.get(key), str):
                out[key] = resolve_model(out[key])
        for key in ("prompt_data", "prompt-data"):
            if isinstance(out.get(key), str):
                out[key] = resolve_dataset(out[key])
        for key in ("eval_prompt_data", "eval-prompt-data"):
            if isinstance(out.get(key), list):
                out[key] = [resolve_dataset(v) if i % 2 else v for i, v in enumerate(out[key])]
    except UnknownBuiltin as exc:
        raise ConfigError(f"{flag_name(key)} {exc}") from None
    return out
