"""Samples that share a prompt share one forward row: the layout by hand, and on a real model the same log-probs,
entropies and gradients as each sample in its own row."""

from __future__ import annotations

import random

import pytest
import torch

from vime_engine.config import build_config
from vime_engine.models.builtin import materialize_builtin_model
from vime_engine.sample import Sample
from vime_engine.train.forward_rows import build_forward_rows
from vime_engine.train.torch_backend import TorchTrainBackend


def test_layout_by_hand():
    prompt = [5, 6, 7]
    rows = [[Sample(0, "", "", prompt, [8, 9]), Sample(0, "", "", prompt, [10])], [Sample(1, "", "", [1], [2])]]
    layout = build_forward_rows(rows, torch.device("cpu"))
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [1, 2, 0, 0, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 0, 0, 0, 0]]
    # Tokens 8, 9 of the first sample, 10 of the second (predicted by the prompt's end too), 2 of the other row.
    assert layout.token_rows.tolist() == [0, 0, 0, 1]
    assert layout.predictors.tolist() == [2, 3, 2, 0]
    assert layout.targets.tolist() == [3, 4, 5, 1]
    assert layout.flat_predictors.tolist() == [2, 3, 2, 6]
    # Where each sample's tokens are computed in the rows flattened to [2 × 6]: the shared prompt once for both.
    assert [index.tolist() for index in layout.sample_token_index()] == [[0, 1, 2, 3, 4], [0, 1, 2, 5], [6, 7]]
    mask = layout.attention_mask[:, 0].int().tolist()
    assert mask[0] == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],  # the second response sees the prompt and itself, not the first response
    ]
    assert mask[1][1] == [1, 1, 0, 0, 0, 0] and mask[1][4] == [0, 0, 0, 0, 1, 0]  # padding sees itself only


def test_rows_of_one_sample_keep_the_models_own_mask():
    rows = [[Sample(0, "", "", [1, 2], [3])], [Sample(1, "", "", [4], [5, 6, 7])]]
    layout = build_forward_rows(rows, torch.device("cpu"))
    assert layout.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match="same prompt tokens"):
        build_forward_rows([[Sample(0, "", "", [1], [2]), Sample(0, "", "", [3], [4])]], torch.device("cpu"))


def _trainer(model_dir: str, **flags) -> TorchTrainBackend:
    return TorchTrainBackend(build_config([], **{"hf-checkpoint": model_dir, "prompt-data": "unused", **flags}))


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return _trainer(str(materialize_builtin_model("tiny-qwen3", tmp_path_factory.mktemp("tiny") / "model")))


def _groups() -> list[list[Sample]]:
    """Two prompts of different lengths, four responses of different lengths each."""
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(10, 90) for _ in range(n)]  # noqa: E731
    return [[Sample(g, "", "", prompt, tokens(rng.randrange(1, 12))) for _ in range(4)]
            for g, prompt in enumerate([tokens(9), tokens(5)])]


def test_shared_rows_give_each_samples_log_probs_entropy_and_gradients(backend):
    groups = _groups()
    weights = torch.randn(sum(s.response_length for g in groups for s in g), generator=torch.Generator().manual_seed(1))

    def run(rows):
        backend.model.zero_grad(set_to_none=True)
        log_probs, entropy, _ = backend._forward(backend.model, rows, with_entropy=True)
        ((log_probs * weights).sum() + entropy.sum()).backward()
        return log_probs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in backend.model.named_parameters()}

    shared = run(groups)
    alone = run([[s] for g in groups for s in g])
    torch.testing.assert_close(shared[0], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[1], alone[1], atol=1e-5, rtol=0)
    for name, grad in alone[2].items():
        torch.testing.assert_close(shared[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_backend_shares_prompts_and_returns_log_probs_in_sample_order(backend):
    samples = [s for g in _groups() for s in g]
    random.Random(2).shuffle(samples)
    rows = [row for mb in backend._micro_batches(samples) for row in mb]
    assert any(len(row) > 1 for row in rows)  # the tiny model's attention is cheap: its groups share
    expected = torch.cat([backend._forward(backend.model, [[s]], with_entropy=False)[0] for s in samples])
    torch.testing.assert_close(backend.log_probs(samples), expected.detach(), atol=1e-5, rtol=0)


def test_training_on_shared_rows_does_not_depend_on_the_thread_count(backend):
    """A shared prompt's last logit predicts several tokens; the sum of their gradients must not depend on how
    many threads the trainer has (a run on a one-core node must end where the same run on two cores ends)."""
    model_dir = backend.cfg.model.hf_checkpoint
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(10, 90) for _ in range(n)]  # noqa: E731
    samples = []
    for group in range(4):  # the tiny pipeline's rollout: 4 prompts x 4 samples, short responses
        prompt = tokens(rng.randrange(30, 40))
        for i in range(4):
            n = rng.randrange(3, 9)
            samples.append(Sample(group, "", "", prompt, tokens(n), rollout_log_probs=[-1.0] * n, loss_mask=[1] * n,
                                  reward=float(i % 2)))
    weights = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            trainer = _trainer(model_dir, **{"rollout-batch-size": 4, "n-samples-per-prompt": 4})
            trainer.train_rollout(samples)
            weights.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(weights[0], weights[1])


def test_the_reference_model_runs_the_same_shared_rows(backend):
    """--use-kl-loss: the reference model's forward takes the policy's layout (its own LM head on the predicting
    positions); before any step both hold the same weights."""
    trainer = _trainer(backend.cfg.model.hf_checkpoint, **{"use-kl-loss": True, "kl-loss-coef": 0.1})
    groups = _groups()
    with torch.no_grad():
        policy = trainer._forward(trainer.model, groups, with_entropy=False)[0]
        reference = trainer._forward(trainer.ref_model, groups, with_entropy=False)[0]
    assert reference.shape == (sum(s.response_length for g in groups for s in g),)
    assert torch.equal(policy, reference)
