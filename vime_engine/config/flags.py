"""vime-style command-line flags (`--rollout-batch-size 16 --use-kl-loss`) into flat values."""

from __future__ import annotations

from typing import Any, Literal

from vime_engine.config.errors import ConfigError
from vime_engine.config.flat_values import unknown_flags_message
from vime_engine.config.megatron_flags import MEGATRON_FLAGS
from vime_engine.config.sections import FIELD_SECTION, SECTIONS
from vime_engine.config.switches import FALSE_WORDS, TRUE_WORDS
from vime_engine.config.vime_only_flags import VIME_ONLY_FLAGS


def parse_flags(argv: list[str]) -> dict[str, Any]:
    """vime-style flags → flat values. Booleans are bare switches (`--use-kl-loss`); lists take several values."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: flags look like --rollout-batch-size 16")
        name, _, inline = token[2:].partition("=")
        kind = _flag_kind(name)
        if kind is None:
            raise ConfigError(unknown_flags_message([token.split("=")[0]]))
        i += 1
        if kind is bool and not inline:
            # A bare switch is true; a switch that also takes auto reads a following word (`--x false`).
            words = TRUE_WORDS + FALSE_WORDS + ("auto",)
            takes_word = _takes_auto(name) and i < len(argv) and argv[i].lower() in words
            values[name] = argv[i] if takes_word else True
            i += int(takes_word)
            continue
        args = [inline] if inline else []
        while not args or (kind is list and i < len(argv) and not argv[i].startswith("--")):
            if i >= len(argv) or argv[i].startswith("--"):
                if args:
                    break
                raise ConfigError(f"--{name} needs a value")
            args.append(argv[i])
            i += 1
        values[name] = args if kind is list else _coerce_scalar(args[0])
    return values


def _flag_kind(name: str) -> type | None:
    if name in MEGATRON_FLAGS:
        return MEGATRON_FLAGS[name]
    if name in VIME_ONLY_FLAGS:  # refused or confirmed by from_flat
        return VIME_ONLY_FLAGS[name].kind
    key = name.replace("-", "_")
    section = FIELD_SECTION.get(key)
    if section is None:
        return None
    annotation = SECTIONS[section].model_fields[key].annotation
    if annotation is bool or _takes_auto(name):
        return bool
    if "list[" in str(annotation):  # list[str] | None
        return list
    return str


def _takes_auto(name: str) -> bool:
    """A switch that may also be "auto" (the device decides), e.g. --vllm-enforce-eager."""
    key = name.replace("-", "_")
    section = FIELD_SECTION.get(key)
    return section is not None and SECTIONS[section].model_fields[key].annotation == bool | Literal["auto"]


def _coerce_scalar(text: str) -> Any:
    # pydantic converts "16" → 16 for int fields; "none" spelled out means unset.
    return None if text.lower() == "none" else text
