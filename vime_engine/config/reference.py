"""The flag reference `vimeflow train --help` prints: every EngineConfig field and Megatron pass-through flag, by
section, with its type, default and one line of help, read from the schema (never a list kept by hand)."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic.fields import FieldInfo

from vime_engine.config.megatron_flags import MEGATRON_FLAGS
from vime_engine.config.sections import SECTIONS

_TYPE_WORDS = {int: "INT", float: "FLOAT", str: "TEXT"}
MEGATRON_HELP = ("Megatron-Core's own flags, passed through to the Megatron backend as `args.<name>` too; "
                 "the model-architecture ones are checked against config.json and never change the model")


@dataclass(frozen=True)
class FlagDoc:
    flag: str  # --rollout-batch-size
    kind: str  # INT, FLOAT, TEXT, a|b|c, or "" for a switch
    default: str  # as a user would type it; "" when the flag is required or unset by default
    help: str


def kind_of(annotation: Any) -> str:
    """The value a flag takes, in a word: INT, a|b|c for choices, TEXT ... for a list, "" for a bare switch."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if bool in args:  # a switch that may also be "auto"
            return "true|false|" + "|".join(a for lit in args if lit is not bool for a in typing.get_args(lit))
        if len(args) > 1:  # a number or "auto"
            return "|".join(_TYPE_WORDS.get(a) or "|".join(typing.get_args(a)) for a in args)
        return kind_of(args[0])
    if typing.get_origin(annotation) is Literal:
        return "|".join(str(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return _TYPE_WORDS.get(args[0], "TEXT") + " ..."
    if annotation is bool:
        return ""
    return _TYPE_WORDS.get(annotation, "TEXT")


def _default(info: FieldInfo) -> str:
    if info.is_required() or info.default is None:
        return ""
    if isinstance(info.default, bool):
        return "true" if info.default else "false"
    return str(info.default)


def section_docs() -> dict[str, list[FlagDoc]]:
    """Every flag by section, in declaration order; Megatron's pass-through flags last, under "megatron"."""
    docs = {
        section: [FlagDoc("--" + name.replace("_", "-"), kind_of(info.annotation), _default(info),
                          info.description or "")
                  for name, info in model.model_fields.items()]
        for section, model in SECTIONS.items()
    }
    docs["megatron"] = [FlagDoc("--" + name, "" if kind is bool else _TYPE_WORDS[kind], "", "")
                        for name, kind in MEGATRON_FLAGS.items()]
    return docs


def render_reference() -> str:
    """The reference as plain text: a heading per section, a line per flag (flag, value, default, help)."""
    out = []
    for section, docs in section_docs().items():
        out.append(f"{section}:" if section != "megatron" else f"megatron ({MEGATRON_HELP}):")
        for doc in docs:
            left = f"  {doc.flag}" + (f" {doc.kind}" if doc.kind else "")
            right = "; ".join(part for part in (f"default {doc.default}" if doc.default else "", doc.help) if part)
            out.append(f"{left:<46} {right}".rstrip() if len(left) < 46 else f"{left}\n{'':<46} {right}".rstrip())
        out.append("")
    return "\n".join(out).rstrip() + "\n"
