"""The agents that talk to the router themselves train in server mode, in one run (one `vllm serve` engine behind a
vllm-router, a retrieval server started here, the tiny model): the vime-style plugin files
(vime_engine/agents/search_generate.py and sandbox_tool_generate.py: `vime.*` imports, `args.vllm_router_ip`),
unchanged, and the OpenAI-SDK agent (openai_search_agent.py: its chat completions through the router's
`/v1/chat/completions`, each episode one Sample).

The search agents' passages are observation tokens between their two turns. Their rollout log-probs are
placeholders (0) where the model's real ones are about -6, so had they loss mask 1 they would enter the loss and
the train/rollout log-prob gap, measured over the loss-masked tokens, would be far above 1e-5. The OpenAI agent's
second turn is generated after its first answer's own tokens, not that answer's text tokenized again; had it not
been, its tokens' log-probs would belong to another context than the one trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vime_engine.agents.retrieval_server import start_retrieval_server
from vime_engine.config import build_config
from vime_engine.runtime.driver import train
from vime_engine.runtime.workers import Workers
from vime_engine.train.objective import response_log_probs

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [("What is the capital of France?", "Paris"), ("How high is Mount Everest?", "8849"),
             ("When did Python first appear?", "1991"), ("At what temperature does water boil?", "100")]


@pytest.fixture(scope="module")
def retrieval():
    server = start_retrieval_server()
    yield server
    server.close()


def test_vime_style_and_openai_sdk_agents_train_behind_the_router(tiny_model, tmp_path, cluster, retrieval,
                                                                    monkeypatch):
    trained = []  # each rollout's samples
    original_train = Workers.train

    def recording_train(self, samples):
        trained.append(samples)
        return original_train(self, samples)

    monkeypatch.setattr(Workers, "train", recording_train)
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a, "metadata": {
        "search_url": retrieval.url, "question": q}}) + "\n" for q, a in QUESTIONS))
    cfg = build_config([], **{
        "hf-checkpoint": str(tiny_model), "prompt-data": str(data), "input-key": "question", "label-key": "answer",
        "metadata-key": "metadata", "apply-chat-template": True, "num-rollout": 2, "rollout-batch-size": 3,
        "n-samples-per-prompt": 2, "rollout-max-response-len": 8, "global-batch-size": 6, "lr": 1e-2,
        "vllm-kv-cache-gb": 0.25, "rollout-mode": "server",
        "custom-rm-path": str(REPO / "tests/support/tiny_task.py") + ":digit_share",
        "custom-generate-function-path": str(REPO / "tests/support/vime_agents.py") + ":generate",
        "output-dir": str(tmp_path / "out"),
    })
    result = train(cfg)
    assert result.rollouts_done == [0, 1]
    # the server's and the router's output among the run's logs (not in /tmp), each to a file of its own
    logs = tmp_path / "out" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["vllm-router.log", "vllm-server-0.log"]
    assert "Application startup complete" in (logs / "vllm-server-0.log").read_text()
    for row in result.history:
        assert row["train/train_rollout_logprob_abs_diff"] <= 1e-5, row  # the passages take no part in the loss
        # a rollout's groups: one searched (two model turns), one in the sandbox agent (one turn: the tiny model
        # writes no code), one of the OpenAI agent (two turns)
        assert row["rollout/model_turns/mean"] == pytest.approx(5 / 3), row
        assert row["rollout/model_tokens/mean"] < row["rollout/response_len/mean"]  # the passages in between
        assert 0.0 <= row["rollout/raw_reward"] <= 1.0
        assert row["train/grad_norm"] > 0

    # The OpenAI agent's episodes (group 2 of each rollout): its two answers trained, what came between them (the
    # template's glue, the search results) not, and, in rollout 0 (the model as loaded), their log-probs those of
    # the model's own forward over the whole episode
    episodes = [s for samples in trained for s in samples if s.group_index % 3 == 2]
    assert len(episodes) == 4
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    for s in episodes:
        mask = s.loss_mask
        first, second = mask.index(0), mask.index(1, mask.index(0))
        assert mask == [1] * first + [0] * (second - first) + [1] * (len(mask) - second)
        between = tokenizer.decode(s.response_tokens[first:second])
        assert "<information>" in between and between.endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        for s in episodes[:2]:  # rollout 0
            ids = torch.tensor([s.prompt_tokens + s.response_tokens])
            logits = policy(input_ids=ids).logits[0, len(s.prompt_tokens) - 1:-1]
            ours = response_log_probs(logits, torch.tensor(s.response_tokens), temperature=1.0)
            model_tokens = torch.tensor(s.loss_mask, dtype=torch.bool)
            gap = (ours - torch.tensor(s.rollout_log_probs))[model_tokens].abs().max().item()
            assert gap <= 1e-5, gap
