"""Whether a built-in reward can grade against a label: checked for every row before a run starts, so that a
label the reward cannot read stops the run at once, naming its row, instead of failing mid-run (gsm8k) or
grading every response wrong (dapo, math)."""

from __future__ import annotations

from vime_engine.rewards.boxed import last_boxed_content
from vime_engine.rewards.dapo import normalise_answer
from vime_engine.rewards.gsm8k import final_number


def label_problem(rm_type: str, label: str) -> str | None:
    """Why `--rm-type rm_type` cannot grade responses against `label`, or None when it can (and for reward
    types it does not know: custom and remote rewards read labels their own way)."""
    if rm_type == "gsm8k" and final_number(label) is None:
        return "holds no number, and --rm-type gsm8k compares the response's final number with the label's"
    if rm_type == "dapo" and not normalise_answer(label):
        return "is empty once normalised, so --rm-type dapo could never match an answer against it"
    if rm_type in ("math", "deepscaler"):
        gold = last_boxed_content(label)
        if not (label if gold is None else gold).strip():
            return f"is empty, so --rm-type {rm_type} could never match a \\boxed{{}} answer against it"
    return None
