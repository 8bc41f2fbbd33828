"""Turning a `PromptRecord`'s prompt into the text the rollout engine generates from."""

from __future__ import annotations

from typing import Any

from vime_engine.data.records import ChatMessage, PromptRecord

FLAG = "--apply-chat-template"


def render_prompt(record: PromptRecord, tokenizer: Any, apply_chat_template: bool) -> str:
    """The prompt text for `record`.

    With `apply_chat_template`, a plain string becomes one user message and the conversation is
    rendered by `tokenizer.apply_chat_template(..., tokenize=False, add_generation_prompt=True)`,
    so the text ends where the assistant's answer begins. Without it, strings are used verbatim
    and a message list is an error: there is no neutral way to flatten a conversation.
    """
    if not apply_chat_template:
        if not isinstance(record.prompt, str):
            raise ValueError(f"the prompt is a list of chat messages; pass {FLAG} to render it with the chat template")
        return record.prompt
    messages: list[ChatMessage] = (
        [{"role": "user", "content": record.prompt}] if isinstance(record.prompt, str) else record.prompt
    )
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{FLAG} is set but the tokenizer has no chat template; drop the flag or use a chat model's tokenizer")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
