"""Flat values (`rollout-batch-size: 16`, `megatron.tensor-model-parallel-size: 2`) into an EngineConfig; every
problem is a ConfigError naming the flag, an unknown one with the nearest known flag."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ValidationError

from vime_engine.config.engine_config import EngineConfig
from vime_engine.config.errors import ConfigError, flag_name
from vime_engine.config.megatron_flags import MEGATRON_FLAGS, typed_megatron_value
from vime_engine.config.sections import FIELD_SECTION, SECTIONS
from vime_engine.config.vime_only_flags import VIME_ONLY_FLAGS, check_vime_only


def from_flat(values: dict[str, Any]) -> EngineConfig:
    """Build from flat names (`rollout_batch_size` / `rollout-batch-size`); Megatron flags go to `megatron`."""
    nested: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    megatron: dict[str, Any] = {}
    unknown = []
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_")
        if key.startswith("megatron."):
            name = key.removeprefix("megatron.").replace("_", "-")
            megatron[name] = typed_megatron_value(name, value)
        elif key in FIELD_SECTION:
            nested[FIELD_SECTION[key]][key] = value
        elif key.replace("_", "-") in MEGATRON_FLAGS:
            megatron[key.replace("_", "-")] = typed_megatron_value(key.replace("_", "-"), value)
        elif key.replace("_", "-") in VIME_ONLY_FLAGS:
            check_vime_only(key.replace("_", "-"), value)  # refused, or at the value the engine runs anyway
        else:
            unknown.append(raw_key)
    if unknown:
        raise ConfigError(unknown_flags_message([flag_name(k) for k in unknown]))
    try:
        return EngineConfig(**{s: v for s, v in nested.items() if v or s in ("model", "data")}, megatron=megatron)
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc)) from None


def _validation_message(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if err["type"] == "missing":
            missing = [loc[-1]] if len(loc) > 1 else [
                n for n, f in SECTIONS[loc[0]].model_fields.items() if f.is_required()
            ]
            lines.append(f"missing required {' and '.join(flag_name(n) for n in missing)}")
            continue
        flag = flag_name(loc[-1]) if len(loc) > 1 else "config"
        if err["type"] == "value_error":
            lines.append(str(err.get("ctx", {}).get("error", err["msg"])))
        else:
            lines.append(f"{flag} {err.get('input')!r}: {err['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def unknown_flags_message(flags: list[str]) -> str:
    """`unknown flag --x (did you mean --y?)` for each flag; the command-line parser reports with it too."""
    known = [flag_name(n) for n in FIELD_SECTION] + [f"--{f}" for f in MEGATRON_FLAGS]
    parts = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1)
        parts.append(f"unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
    return "; ".join(parts)


def with_overrides(cfg: EngineConfig, **flat_values: Any) -> EngineConfig:
    """A copy of `cfg` with some flat fields replaced (validated)."""
    return from_flat({**cfg.flat(), **flat_values})
