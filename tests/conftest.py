"""Fixtures shared across the suite: the built-in tiny model and datasets, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from vime_engine.data.synthetic import materialize_builtin_dataset
from vime_engine.models.builtin import materialize_builtin_model


@pytest.fixture(scope="session")
def assets_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def tiny_model(assets_dir) -> Path:
    return materialize_builtin_model("tiny-qwen3", assets_dir / "tiny-qwen3")


@pytest.fixture(scope="session")
def arithmetic_data(assets_dir) -> Path:
    return materialize_builtin_dataset("arithmetic", assets_dir / "datasets")


@pytest.fixture(scope="session")
def aime_data(assets_dir) -> Path:
    return materialize_builtin_dataset("aime-synthetic", assets_dir / "datasets")
