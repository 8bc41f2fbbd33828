"""vime-style plugin files that talk to the router themselves (vime_engine/agents/search_generate.py and
sandbox_tool_generate.py: `vime.*` imports, `args.vllm_router_ip`) train unchanged in server mode: one `vllm
serve` engine behind a vllm-router, a retrieval server started here, the tiny model.

The search agent's passages are observation tokens between its two turns. Their rollout log-probs are
placeholders (0) where the model's real ones are about -6, so had they loss mask 1 they would enter the loss and
the train/rollout log-prob gap, measured over the loss-masked tokens, would be far above 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vime_engine.agents.retrieval_server import start_retrieval_server
from vime_engine.config import build_config
from vime_engine.runtime.driver import train

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [("What is the capital of France?", "Paris"), ("How high is Mount Everest?", "8849"),
             ("When did Python first appear?", "1991"), ("At what temperature does water boil?", "100")]


@pytest.fixture(scope="module")
def retrieval():
    server = start_retrieval_server()
    yield server
    server.close()


def test_vime_style_agents_train_unchanged_behind_the_router(tiny_model, tmp_path, cluster, retrieval):
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a, "metadata": {
        "search_url": retrieval.url, "question": q}}) + "\n" for q, a in QUESTIONS))
    cfg = build_config([], **{
        "hf-checkpoint": str(tiny_model), "prompt-data": str(data), "input-key": "question", "label-key": "answer",
        "metadata-key": "metadata", "apply-chat-template": True, "num-rollout": 2, "rollout-batch-size": 2,
        "n-samples-per-prompt": 2, "rollout-max-response-len": 8, "global-batch-size": 4, "lr": 1e-2,
        "vllm-kv-cache-gb": 0.25, "rollout-mode": "server",
        "custom-rm-path": str(REPO / "tests/support/tiny_task.py") + ":digit_share",
        "custom-generate-function-path": str(REPO / "tests/support/vime_agents.py") + ":generate",
        "output-dir": str(tmp_path / "out"),
    })
    result = train(cfg)
    assert result.rollouts_done == [0, 1]
    for row in result.history:
        assert row["train/train_rollout_logprob_abs_diff"] <= 1e-5, row  # the passages take no part in the loss
        # a rollout's groups: one searched (two model turns), one in the sandbox agent (one turn: the tiny model
        # writes no code)
        assert row["rollout/model_turns/mean"] == 1.5, row
        assert row["rollout/model_tokens/mean"] < row["rollout/response_len/mean"]  # the passages in between
        assert 0.0 <= row["rollout/raw_reward"] <= 1.0
        assert row["train/grad_norm"] > 0
