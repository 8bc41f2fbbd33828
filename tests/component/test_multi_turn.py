"""Multi-turn samples through the real engine: a vime-style custom generate function (two model turns with an
environment reply between them, tests/support/two_turn_agent.py) on vLLM with the tiny model, trained by the torch
trainer with token-budget packing. The trainer's log-probs cover whole sequences, tool replies included, and are
compared with vLLM's on the model's tokens only: a tool token's placeholder log-prob (0) against its real one
(about -6 for the tiny model) would push the gap far above 1e-5."""

from __future__ import annotations

from pathlib import Path

from vime_engine.config import build_config
from vime_engine.runtime.driver import train

REPO = Path(__file__).resolve().parents[2]


def test_multi_turn_samples_pack_train_and_agree_with_the_rollout_on_the_models_tokens(
        tiny_model, arithmetic_data, tmp_path, cluster):
    cfg = build_config([], **{
        "hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data), "input-key": "question",
        "label-key": "answer", "apply-chat-template": True, "rollout-shuffle": True, "num-rollout": 2,
        "rollout-batch-size": 2, "n-samples-per-prompt": 4, "rollout-max-response-len": 8, "global-batch-size": 8,
        "lr": 1e-2, "vllm-kv-cache-gb": 0.25, "colocate": True,
        "use-dynamic-batch-size": True, "max-tokens-per-gpu": 400,
        "custom-rm-path": str(REPO / "tests/support/tiny_task.py") + ":digit_share",
        "custom-generate-function-path": str(REPO / "tests/support/two_turn_agent.py") + ":generate",
        "rollout-max-turns": 2, "output-dir": str(tmp_path / "out"),
    })
    result = train(cfg)
    assert result.rollouts_done == [0, 1]
    for row in result.history:
        assert row["rollout/model_turns/mean"] == 2
        assert row["rollout/model_tokens/mean"] <= 16 < row["rollout/response_len/mean"]  # tool replies in between
        assert row["train/train_rollout_logprob_abs_diff"] <= 1e-5, row
        assert row["train/grad_norm"] > 0
