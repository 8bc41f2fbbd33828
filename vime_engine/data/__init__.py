"""Prompt data: records, dataset files, chat rendering, the resumable data source, built-in sets."""

from vime_engine.data.chat import render_prompt
from vime_engine.data.datasets import SUPPORTED_EXTENSIONS, DatasetError, load_prompt_dataset
from vime_engine.data.records import ChatMessage, PromptRecord
from vime_engine.data.source import DataSource
from vime_engine.data.synthetic import BUILTIN_DATASETS, materialize_builtin_dataset

__all__ = [
    "BUILTIN_DATASETS",
    "SUPPORTED_EXTENSIONS",
    "ChatMessage",
    "DataSource",
    "DatasetError",
    "PromptRecord",
    "load_prompt_dataset",
    "materialize_builtin_dataset",
    "render_prompt",
]
