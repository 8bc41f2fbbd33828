"""The Megatron lane (Python 3.12, .venv-megatron; see scripts/ensure-venv-megatron).

Under the main lane's Python 3.11 this folder collects nothing (its Megatron-in-the-loop test is the Megatron
case of tests/component/test_resume.py, on megatron-core 0.16). Under 3.12 megatron-core 0.19 (and
megatron-bridge, which `--megatron-to-hf-mode bridge` uses and the tests compare with our mapping) must import; a missing package fails the run
instead of skipping.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 12):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from vime_engine.models.builtin import materialize_builtin_model

    return materialize_builtin_model("tiny-qwen3", tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    from vime_engine.models.builtin import materialize_builtin_model

    return materialize_builtin_model("tiny-qwen3-moe", tmp_path_factory.mktemp("models") / "tiny-qwen3-moe")


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory) -> Path:
    from vime_engine.models.builtin import materialize_builtin_model

    return materialize_builtin_model("tiny-deepseek-v3", tmp_path_factory.mktemp("models") / "tiny-deepseek-v3")


@pytest.fixture(scope="session")
def tiny_deepseek_v3_mtp(tmp_path_factory) -> Path:
    from vime_engine.models.builtin import materialize_builtin_model

    return materialize_builtin_model("tiny-deepseek-v3-mtp", tmp_path_factory.mktemp("models") / "tiny-deepseek-v3-mtp")
