"""Multi-turn samples: the model's turns trained, tool replies loss-masked all the way to the gradients; the
bookkeeping a custom generate function relies on; the checks on what it returns; the metrics of a multi-turn
rollout."""

from __future__ import annotations

import random

import pytest
import torch

from vime_engine.config import ConfigError, build_config
from vime_engine.rollout.metrics import rollout_metrics
from vime_engine.rollout.custom_generate import (
    TOOL_CALLS, check_returned, load_generate_function, model_turns, request_seed,
)
from vime_engine.sample import ENVIRONMENT_LOG_PROB, Sample, SampleStatus
from vime_engine.train.objective import MicroBatchOutputs, micro_batch_loss
from vime_engine.train.rollout_batch import build_rollout_batch

REQUIRED = {"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"}
# Two groups of two; each response: model turn, tool reply (mask 0), model turn (the last: a tool reply at the end).
MASKS = [
    [1, 1, 1, 0, 0, 1, 1],
    [1, 1, 0, 0, 0, 0, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0],
    [1, 0, 0, 1, 1, 1, 1, 1],
]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def _samples() -> list[Sample]:
    rng = random.Random(0)
    return [Sample(group_index=i // 2, prompt="p", label="1", prompt_tokens=[1, 2], response_tokens=[3] * len(m),
                   rollout_log_probs=[-rng.random() if t else ENVIRONMENT_LOG_PROB for t in m], loss_mask=list(m),
                   reward=r, version_segments=[(0, sum(m))])
            for i, (m, r) in enumerate(zip(MASKS, REWARDS))]


CASES = {
    "grpo-tis-kl-entropy": ["--use-tis", "--use-kl-loss", "--kl-loss-coef", "0.1", "--entropy-coef", "0.01"],
    "grpo-per-token": ["--calculate-per-token-loss", "--use-tis"],
    "gspo": ["--advantage-estimator", "gspo"],
    "reinforce++": ["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.1", "--use-kl-loss"],
    "reinforce++-baseline": ["--advantage-estimator", "reinforce_plus_plus_baseline", "--kl-coef", "0.1",
                             "--use-kl-loss"],
}


def _loss_and_grads(flags: list[str], change: str | None):
    """The loss, the gradient w.r.t. every response token's log-prob input, and the metrics, for the samples above;
    `change` rewrites what tool tokens ("tool") or one model token ("model") carry before the loss."""
    cfg = build_config(flags + ["--n-samples-per-prompt", "2", "--rollout-batch-size", "2"], **REQUIRED)
    samples = _samples()
    n = sum(map(len, MASKS))
    mask = torch.tensor([t for m in MASKS for t in m], dtype=torch.bool)
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(n, generator=gen, dtype=torch.float64).requires_grad_()
    old = torch.nn.functional.logsigmoid(theta.detach() + 0.05 * torch.randn(n, generator=gen, dtype=torch.float64))
    ref = old - 0.1 * torch.rand(n, generator=gen, dtype=torch.float64)
    pick = ~mask if change == "tool" else torch.zeros(n, dtype=torch.bool)
    if change == "model":
        pick[0] = True
    if change is not None:  # other rollout and reference log-probs, other old log-probs, other advantages
        old, ref = old.clone(), ref.clone()
        old[pick] -= 3.0
        ref[pick] += 2.0
        offset = 0
        for s in samples:
            for k in range(s.response_length):
                if pick[offset + k]:
                    s.rollout_log_probs[k] -= 5.0
            offset += s.response_length
    rollout = build_rollout_batch(cfg, samples, old, ref, device=torch.device("cpu"))
    if change is not None:
        rollout.advantages.advantages[pick] += 100.0
    everyone = list(range(len(samples)))
    out = MicroBatchOutputs(log_probs=torch.nn.functional.logsigmoid(theta),
                            entropy=torch.nn.functional.softplus(theta) if cfg.algorithm.entropy_coef else None)
    loss, metrics = micro_batch_loss(cfg, out, rollout.targets(everyone), rollout.num_tokens(everyone), len(samples))
    loss.backward()
    return loss.detach(), theta.grad, metrics, mask


@pytest.mark.parametrize("case", CASES)
def test_tool_tokens_contribute_nothing_to_the_loss_its_gradients_or_the_metrics(case):
    loss, grads, metrics, mask = _loss_and_grads(CASES[case], change=None)
    changed_loss, changed_grads, changed_metrics, _ = _loss_and_grads(CASES[case], change="tool")
    assert torch.equal(loss, changed_loss)
    assert torch.equal(grads, changed_grads)
    assert metrics == changed_metrics  # log-prob agreement, clip fraction, KL, entropy: model tokens only
    assert torch.all(grads[~mask] == 0) and torch.any(grads[mask] != 0)
    # The same change on one model token does move them: the comparison above could fail.
    _, model_changed_grads, model_changed_metrics, _ = _loss_and_grads(CASES[case], change="model")
    assert not torch.equal(grads, model_changed_grads)
    assert metrics != model_changed_metrics


def test_model_turns_are_the_runs_of_trained_tokens():
    assert [model_turns(m) for m in MASKS] == [2, 2, 1, 2]
    assert model_turns([]) == 0 and model_turns([0, 0]) == 0 and model_turns([1, 0, 1, 0, 1]) == 3


def test_appending_turns_keeps_tokens_log_probs_mask_and_versions_aligned():
    s = Sample(group_index=0, prompt="p", label="", prompt_tokens=[1], status=SampleStatus.ABORTED)
    s.append_response_tokens(tokens=[5, 6], log_probs=[-0.5, -0.25], meta_info={"weight_version": 3})
    s.append_response_tokens(tokens=[7, 8, 9], trainable=False)
    s.append_response_tokens(tokens=[10], log_probs=[-1.0], meta_info={"weight_version": 3})
    s.append_response_tokens(tokens=[11], log_probs=[-2.0], meta_info={"weight_version": 4})
    assert s.response_tokens == [5, 6, 7, 8, 9, 10, 11]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1, 1]
    assert s.rollout_log_probs == [-0.5, -0.25, ENVIRONMENT_LOG_PROB, ENVIRONMENT_LOG_PROB, ENVIRONMENT_LOG_PROB,
                                   -1.0, -2.0]
    assert s.version_segments == [(3, 3), (4, 1)]  # the model's tokens only
    with pytest.raises(ValueError, match="log-probs"):
        s.append_response_tokens(tokens=[1, 2], log_probs=[-1.0], meta_info={"weight_version": 4})
    with pytest.raises(ValueError, match="no log-probs"):
        s.append_response_tokens(tokens=[1], log_probs=[-1.0], trainable=False)
    with pytest.raises(ValueError, match="weight_version"):
        s.append_response_tokens(tokens=[1], log_probs=[-1.0])


def _checked(sample, aborting=False, max_turns=2, max_context_len=12):
    check_returned(sample, "3/1", max_turns, max_context_len, aborting)


def test_what_a_generate_function_returns_is_checked():
    ok = _samples()[0]  # 2 prompt + 7 response tokens, 2 turns
    _checked(ok)
    with pytest.raises(ValueError, match="list of 2 samples"):
        _checked([ok, ok])
    with pytest.raises(ValueError, match="must be equal"):
        _checked(Sample(0, "p", "", [1], response_tokens=[2, 3], rollout_log_probs=[-1.0], loss_mask=[1, 1]))
    with pytest.raises(ValueError, match="--rollout-max-turns 1"):
        _checked(ok, max_turns=1)
    with pytest.raises(ValueError, match="--rollout-max-context-len 8"):
        _checked(ok, max_context_len=8)
    cut = _samples()[0]
    cut.status = SampleStatus.ABORTED
    _checked(cut, aborting=True)
    with pytest.raises(ValueError, match="not cut off"):
        _checked(cut)


async def vime_style(args, sample, sampling_params):
    return sample


def plain(args, sample, sampling_params):
    return sample


def test_the_generate_function_is_loaded_async_with_vimes_signature():
    assert load_generate_function(f"{__name__}:vime_style") is vime_style
    with pytest.raises(ValueError, match="not async"):
        load_generate_function(f"{__name__}:plain")
    with pytest.raises(ValueError, match="--custom-generate-function-path"):
        load_generate_function(f"{__name__}:missing")


def test_turn_and_context_caps_need_a_generate_function():
    for flag in ("--rollout-max-turns", "--rollout-max-context-len"):
        with pytest.raises(ConfigError, match="--custom-generate-function-path"):
            build_config([flag, "4"], **REQUIRED)
    cfg = build_config(["--custom-generate-function-path", f"{__name__}:vime_style", "--rollout-max-turns", "4"],
                       **REQUIRED)
    assert cfg.rollout.rollout_max_turns == 4


def test_each_turn_draws_from_its_own_seed():
    seeds = {request_seed(7, n) for n in range(100, 200)}
    assert len(seeds) == 100 and request_seed(7, 120) == request_seed(7, 120) != request_seed(8, 120)


def test_multi_turn_metrics_count_model_tokens_turns_and_tool_users():
    samples = _samples()
    for s, calls in zip(samples, [1, 1, 0, 2]):
        s.metadata[TOOL_CALLS] = calls
    m = rollout_metrics(samples)
    assert m["rollout/tool_call_share"] == 0.75
    assert m["rollout/model_turns/mean"] == 7 / 4
    assert m["rollout/model_tokens/mean"] == (5 + 5 + 4 + 6) / 4
    assert m["rollout/response_len/mean"] == (7 + 9 + 7 + 8) / 4
    single = [Sample(0, "p", "", [1], response_tokens=[2], rollout_log_probs=[-1.0], loss_mask=[1],
                     version_segments=[(0, 1)])]
    assert "rollout/model_turns/mean" not in rollout_metrics(single)
