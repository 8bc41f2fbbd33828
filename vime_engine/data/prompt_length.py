"""Prompt lengths in tokens as the rollout engine sees them, and `--rollout-max-prompt-len`.

A prompt's length is that of its rendered text (the chat template applied under `--apply-chat-template`)
tokenized without special tokens, as the rollout worker tokenizes it. As in slime, `--rollout-max-prompt-len N`
drops the prompts longer than N tokens when a dataset (training or eval) is loaded, and says how many.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vime_engine.config import EngineConfig
from vime_engine.data.chat import render_prompt
from vime_engine.data.datasets import DatasetError, NumberedRecord, read_prompt_rows
from vime_engine.data.records import PromptRecord

log = logging.getLogger(__name__)
FLAG = "--rollout-max-prompt-len"


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def prompt_lengths(path: str, rows: list[NumberedRecord], tokenizer: Any, apply_chat_template: bool) -> list[int]:
    """The token count of each row's rendered prompt; a prompt that cannot be rendered is a DatasetError
    naming its row."""
    texts = []
    for row, record in rows:
        try:
            texts.append(render_prompt(record, tokenizer, apply_chat_template))
        except ValueError as exc:
            raise DatasetError(f"{path}, row {row}: {exc}") from None
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def short_enough(path: str, rows: list[NumberedRecord], lengths: list[int], limit: int | None) -> list[int]:
    """Indices of the rows within `limit` tokens (all when None); refuses a dataset with none left."""
    kept = [i for i, n in enumerate(lengths) if limit is None or n <= limit]
    if not kept:
        raise DatasetError(
            f"{path}: all {len(rows)} prompts are longer than {FLAG} {limit} tokens (the shortest has "
            f"{min(lengths)}); raise {FLAG}"
        )
    return kept


def load_prompts(
    cfg: EngineConfig, path: str, input_key: str, label_key: str, metadata_key: str | None = None
) -> list[PromptRecord]:
    """The records of the dataset at `path` that the run uses: all of them, or with `--rollout-max-prompt-len`
    those within it (the number dropped is logged)."""
    rows = read_prompt_rows(path, input_key, label_key, metadata_key)
    limit = cfg.data.rollout_max_prompt_len
    if limit is None:
        return [r.record for r in rows]
    lengths = prompt_lengths(path, rows, load_tokenizer(cfg.model.hf_checkpoint), cfg.data.apply_chat_template)
    kept = short_enough(path, rows, lengths, limit)
    if len(kept) < len(rows):
        log.warning("%s: dropped %d of %d prompts longer than %s %d tokens", path, len(rows) - len(kept), len(rows),
                    FLAG, limit)
    return [rows[i].record for i in kept]
