"""Every flag acts: each EngineConfig field (and Megatron pass-through flag) is read by code outside the config
package (vime_engine/config/, its rules in checks.py included), or is refused when set, or only feeds a derived value
that is read. A field nobody reads is a flag that tells a user their setting took effect when it did not.

Reads are found in the source of vime_engine/, tasks/ and flows/ (the config package excluded):
`<section>.<field>` (`cfg.train.lr`), `<alias>.<field>` where `<alias> = <something>.<section>` (`t = cfg.train;
t.lr`, `e, r = cfg.eval, cfg.rollout`), the field's name quoted (flat dicts, `flags.get("…")`), and for Megatron flags
the quoted flag name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vime_engine.config import MEGATRON_FLAGS, SECTIONS, ConfigError, build_config

REPO = Path(__file__).resolve().parents[2]
REQUIRED = {"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"}

# Fields read only through a derived value of EngineConfig, which is then read outside the config package.
DERIVED = {"num_steps_per_rollout": "global_batch_size", "global_batch_size": "global_batch_size",
           "eps_clip_high": "eps_clip_high", "rollout_num_gpus": "rollout_engines"}
# Fields that cannot act yet and are refused when set (flag value that must raise ConfigError, and why).
REFUSED: dict[str, tuple[list[str], str]] = {}

# vime's whole-rollout functions drive vime's own HTTP rollout servers, which this engine does not run.
REFUSED.update({
    "rollout_function_path": (["--rollout-function-path", "mine.py:generate_rollout"], "needs vime's servers"),
    "eval_function_path": (["--eval-function-path", "mine.py:generate_rollout"], "needs vime's servers"),
})


def _source() -> str:
    files = [p for d in ("vime_engine", "tasks", "flows") for p in (REPO / d).rglob("*.py")]
    config = REPO / "vime_engine" / "config"
    return "\n".join(p.read_text() for p in files if config not in p.parents)


SOURCE = _source()


def _aliases(section: str) -> set[str]:
    """Names bound to a section: `t = cfg.train`, `e, r = cfg.eval, cfg.rollout`."""
    names = {section}
    for lhs, rhs in re.findall(r"^\s*(\w+(?:, \w+)*) = ([\w.]+(?:, [\w.]+)*)\s*$", SOURCE, re.M):
        names |= {name for name, expr in zip(lhs.split(", "), rhs.split(", ")) if expr.endswith(f".{section}")}
    return names


def _read(section: str, field: str) -> bool:
    aliases = _aliases(section)
    attribute = any(re.search(rf"\b{alias}\.{field}\b", SOURCE) for alias in aliases)
    return attribute or f'"{field}"' in SOURCE


FIELDS = [(section, field) for section, model in SECTIONS.items() for field in model.model_fields]


@pytest.mark.parametrize("section, field", FIELDS, ids=[f for _, f in FIELDS])
def test_every_engine_field_is_read_outside_config(section, field):
    if field in REFUSED:
        flags, why = REFUSED[field]
        with pytest.raises(ConfigError):
            build_config(flags, **REQUIRED)
        return
    if field in DERIVED:
        assert re.search(rf"\.{DERIVED[field]}\b", SOURCE), f"--{field} feeds {DERIVED[field]}, which nobody reads"
        return
    flag = field.replace("_", "-")
    assert _read(section, field), f"--{flag} is parsed but no code outside vime_engine/config/ reads it"


@pytest.mark.parametrize("flag", sorted(MEGATRON_FLAGS))
def test_every_megatron_flag_reaches_the_megatron_backend(flag):
    assert f'"{flag}"' in SOURCE, f"--{flag} is accepted but neither the config's checks nor the backend read it"
