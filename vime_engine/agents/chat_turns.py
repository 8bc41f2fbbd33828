"""A tool's reply as tokens, rendered through the model's own chat template.

The reply follows a model turn that ended with the EOS token, so its text is whatever the template writes after
an assistant message's EOS (ChatML: a newline), then the tool message, then the generation prompt that opens the
model's next turn. Both parts come from rendering the template itself, not from a hard-coded format.
"""

from __future__ import annotations

from typing import Any

_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def tool_reply_text(tokenizer: Any, content: str, role: str = "tool") -> str:
    """The text between the end of an assistant turn (its EOS) and the start of the next assistant turn."""
    before = tokenizer.apply_chat_template(_PROBE, tokenize=False)
    after = tokenizer.apply_chat_template(_PROBE + [{"role": role, "content": content}], tokenize=False,
                                          add_generation_prompt=True)
    eos = tokenizer.eos_token
    if not after.startswith(before) or eos not in before:
        raise ValueError(f"the chat template does not render a {role} message after an assistant turn ending in "
                         f"{eos!r}; the tool reply cannot be placed in the conversation")
    return before[before.rindex(eos) + len(eos):] + after[len(before):]


def tool_reply_tokens(tokenizer: Any, content: str, role: str = "tool") -> list[int]:
    return tokenizer(tool_reply_text(tokenizer, content, role), add_special_tokens=False)["input_ids"]
