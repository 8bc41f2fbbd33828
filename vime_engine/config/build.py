"""One EngineConfig from defaults, a YAML file and command-line flags, each layer over the one before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vime_engine.config.engine_config import EngineConfig
from vime_engine.config.flags import parse_flags
from vime_engine.config.flat_values import from_flat
from vime_engine.config.yaml_file import load_yaml


def build_config(argv: list[str] | None = None, yaml_path: str | Path | None = None, **defaults: Any) -> EngineConfig:
    """defaults < YAML file < command-line flags."""
    values: dict[str, Any] = dict(defaults)
    if yaml_path is not None:
        values.update(load_yaml(yaml_path))
    values.update(parse_flags(argv or []))
    return from_flat(values)
