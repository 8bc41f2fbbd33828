"""The prompt record: what a dataset row becomes before rollout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict


class ChatMessage(TypedDict):
    role: str
    content: str


Prompt = str | list[ChatMessage]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer.

    `prompt` is either plain text or a chat conversation (`[{"role", "content"}, ...]`, rendered
    with the tokenizer's chat template under `--apply-chat-template`); `label` is the reference
    answer handed to the reward function; `metadata` is the row's free-form extra data.
    """

    prompt: Prompt
    label: str
    metadata: dict[str, Any] = field(default_factory=dict)
