"""Policy / GSPO / KL / entropy / TIS / value losses and the micro-batch reduction, against hand numbers."""

from __future__ import annotations

import math
import random

import pytest
import torch

from vime_engine.algorithms.losses import (
    entropy_from_logits,
    gspo_policy_loss,
    kl_penalty,
    loss_reducer,
    policy_loss,
    ppo_kl,
    tis_weights,
    value_loss,
)

LN2 = math.log(2.0)


def t(*values: float, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def assert_close(actual: torch.Tensor, expected: list[float], atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.detach(), torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- PPO clipped surrogate --------------------------------------------------------------------------

# eps_clip 0.2, eps_clip_high 0.28 -> ratio clipped to [0.8, 1.28]
RATIOS = [1.5, 1.1, 0.5, 4.0, 0.5, 1.25]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 1.0, 1.0]


def _policy_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    log_probs = t(*[math.log(r) for r in RATIOS], grad=True)
    return log_probs, torch.zeros(len(RATIOS), dtype=torch.float64), t(*ADVANTAGES)


def test_policy_loss_clip_low_and_clip_high() -> None:
    log_probs, old, adv = _policy_inputs()
    loss, clipped = policy_loss(log_probs, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    # A=+1 r=1.5 : max(-1.5, -1.28) = -1.28          clip high
    # A=+1 r=1.1 : max(-1.1, -1.1) = -1.1            inside
    # A=-1 r=0.5 : max(0.5, 0.8) = 0.8               clip low
    # A=-1 r=4.0 : max(4.0, 1.28) = 4.0              unclipped (no dual clip)
    # A=+1 r=0.5 : max(-0.5, -0.8) = -0.5            unclipped (low ratio, positive A)
    # A=+1 r=1.25: max(-1.25, -1.25) = -1.25         inside thanks to clip-higher (0.2 would give -1.2)
    assert_close(loss, [-1.28, -1.1, 0.8, 4.0, -0.5, -1.25])
    assert_close(clipped, [1, 0, 1, 0, 0, 0])
    # d loss / d log_prob = -A * ratio where unclipped, 0 where clipped
    loss.sum().backward()
    assert_close(log_probs.grad, [0.0, -1.1, 0.0, 4.0, -0.5, -1.25])


def test_policy_loss_dual_clip_caps_negative_advantages() -> None:
    log_probs, old, adv = _policy_inputs()
    loss, clipped = policy_loss(log_probs, old, adv, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    # only A=-1 r=4.0 changes: min(4.0, -3 * -1) = 3.0, and it is now clipped (no gradient)
    assert_close(loss, [-1.28, -1.1, 0.8, 3.0, -0.5, -1.25])
    assert_close(clipped, [1, 0, 1, 1, 0, 0])
    loss.sum().backward()
    assert_close(log_probs.grad, [0.0, -1.1, 0.0, 0.0, -0.5, -1.25])


def test_policy_loss_rejects_dual_clip_at_or_below_one() -> None:
    log_probs, old, adv = _policy_inputs()
    with pytest.raises(ValueError, match="--eps-clip-c must be > 1"):
        policy_loss(log_probs, old, adv, 0.2, 0.28, eps_clip_c=1.0)


# --- GSPO -------------------------------------------------------------------------------------------

# sample 0: 3 tokens, the last untrained; log ratios [0.2, 0.4, 5.0] -> masked mean 0.3, s = e^0.3 = 1.349859
# sample 1: 1 token, log ratio -0.1 -> s = e^-0.1 = 0.904837
S0, S1 = math.exp(0.3), math.exp(-0.1)


def _gspo_inputs() -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    log_probs = t(0.2, 0.4, 5.0, -0.1, grad=True)
    return log_probs, torch.zeros(4, dtype=torch.float64), [3, 1], t(1, 1, 0, 1)


def test_gspo_clips_whole_sequences() -> None:
    log_probs, old, lengths, mask = _gspo_inputs()
    loss, clipped = gspo_policy_loss(log_probs, old, t(1, 1, 1, 1), lengths, mask, 0.2, 0.28)
    # A=+1: sample 0 max(-1.349859, -1.28) = -1.28 on all its tokens, clipped; sample 1 -0.904837
    assert_close(loss, [-1.28, -1.28, -1.28, -S1])
    assert_close(clipped, [1, 1, 1, 0])
    loss.sum().backward()
    # clipped sample: no gradient; sample 1: d/dlogp (-A * s) = -0.904837
    assert_close(log_probs.grad, [0, 0, 0, -S1])


def test_gspo_gradient_is_sequence_ratio_times_mean_token_gradient() -> None:
    log_probs, old, lengths, mask = _gspo_inputs()
    adv = t(-1, -1, -1, 1)
    loss, clipped = gspo_policy_loss(log_probs, old, adv, lengths, mask, 0.2, 0.28)
    # A=-1, s=1.349859: max(1.349859, 1.28) = 1.349859, not clipped; every token carries the sequence value
    assert_close(loss, [S0, S0, S0, -S1])
    assert_close(clipped, [0, 0, 0, 0])
    # per-sample mean reduction over 2 samples: d/dlogp_t = -A * s / (trained tokens) / 2
    # sample 0: 1.349859 / 2 / 2 = 0.337465 on each trained token, 0 on the untrained one;
    # sample 1: -0.904837 / 1 / 2 = -0.452419
    reduce = loss_reducer(lengths, mask, per_token=False, global_num_tokens=3, global_num_samples=2)
    reduce(loss).backward()
    assert_close(log_probs.grad, [S0 / 4, S0 / 4, 0.0, -S1 / 2])


# --- KL, ppo_kl, TIS --------------------------------------------------------------------------------


def test_kl_penalty_types() -> None:
    # d = log_probs - ref = [-ln2, ln2, 0]
    log_probs, ref = t(0.0, LN2, 1.0), t(LN2, 0.0, 1.0)
    assert_close(kl_penalty(log_probs, ref, "k1"), [-LN2, LN2, 0.0])
    # 0.5 * 0.693147^2 = 0.240227
    assert_close(kl_penalty(log_probs, ref, "k2"), [0.240227, 0.240227, 0.0])
    # exp(-d) + d - 1: 2 - 0.693147 - 1 = 0.306853; 0.5 + 0.693147 - 1 = 0.193147; 1 + 0 - 1 = 0
    assert_close(kl_penalty(log_probs, ref, "k3"), [0.306853, 0.193147, 0.0])
    assert_close(kl_penalty(log_probs, ref, "low_var_kl"), [0.306853, 0.193147, 0.0])


def test_low_var_kl_is_clamped_and_k3_is_not() -> None:
    # d = -20: k3 = e^20 - 20 - 1 = 485165195.4 - 21 = 485165174.4; low_var_kl clamps it to 10
    log_probs, ref = t(-20.0), t(0.0)
    assert kl_penalty(log_probs, ref, "k3").item() == pytest.approx(485165174.41, rel=1e-9)
    assert kl_penalty(log_probs, ref, "low_var_kl").item() == 10.0


def test_kl_penalty_rejects_unknown_types() -> None:
    with pytest.raises(ValueError, match="unknown --kl-loss-type 'k4'"):
        kl_penalty(t(0.0), t(0.0), "k4")


def test_ppo_kl_is_old_minus_new() -> None:
    assert_close(ppo_kl(t(-1.5, -2.0), t(-1.0, -2.0)), [0.5, 0.0])


def test_tis_weights_truncate_above_and_are_detached() -> None:
    # train - rollout = [ln2, -ln2, 2 ln2] -> exp [2, 0.5, 4]; clip 3 -> [2, 0.5, 3]
    train = t(LN2, 0.0, 2 * LN2, grad=True)
    weights = tis_weights(train, t(0.0, LN2, 0.0), clip=3.0)
    assert_close(weights, [2.0, 0.5, 3.0])
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="--tis-clip"):
        tis_weights(train, t(0.0, 0.0, 0.0), clip=0.0)


# --- entropy ----------------------------------------------------------------------------------------


def test_entropy_of_known_distributions() -> None:
    # uniform over 4: ln 4 = 1.386294
    # p = [0.75, 0.25] (logits [ln3, 0]): 0.75 * 0.287682 + 0.25 * 1.386294 = 0.562335
    # the same shifted by 1000: unchanged, no overflow
    # logits [1000, 0]: p = [1, e^-1000 = 0] -> 0
    logits = t(0, 0, 0, 0, math.log(3), 0, -math.inf, -math.inf,
               1000 + math.log(3), 1000, -math.inf, -math.inf, 1000, 0, -math.inf, -math.inf).view(2, 2, 4)
    entropy = entropy_from_logits(logits)
    assert entropy.shape == (2, 2)
    assert_close(entropy.flatten(), [math.log(4), 0.562335, 0.562335, 0.0])


def test_entropy_with_masked_logits_has_a_finite_gradient() -> None:
    # two live logits of equal value: ln 2 = 0.693147; the -inf ones contribute nothing
    logits = t(1.0, -math.inf, 1.0, -math.inf, grad=True)
    entropy = entropy_from_logits(logits)
    assert entropy.item() == pytest.approx(LN2)
    entropy.backward()
    # at the maximum of the entropy the gradient is 0, and it must not be NaN at the -inf entries
    assert_close(logits.grad, [0.0, 0.0, 0.0, 0.0])


# --- value loss -------------------------------------------------------------------------------------


def test_value_loss_clipping() -> None:
    # value_clip 0.2, old 0.5, return 1.0
    # V=1.0: unclipped 0^2 = 0; clipped V 0.7 -> 0.3^2 = 0.09; 0.5 * max = 0.045 (clipped branch, no grad)
    # V=0.6: inside the clip: 0.4^2 = 0.16 -> 0.08; grad (V - R) = -0.4
    # V=0.0: unclipped 1.0; clipped V 0.3 -> 0.49; 0.5 * max = 0.5; grad (V - R) = -1.0
    values = t(1.0, 0.6, 0.0, grad=True)
    loss = value_loss(values, t(0.5, 0.5, 0.5), t(1.0, 1.0, 1.0), value_clip=0.2)
    assert_close(loss, [0.045, 0.08, 0.5])
    loss.sum().backward()
    assert_close(values.grad, [0.0, -0.4, -1.0])


# --- reduction --------------------------------------------------------------------------------------


def test_loss_reducer_by_hand() -> None:
    # lengths [1, 3], mask [1 | 1, 0, 1], values [2 | 2, 100, 6]
    # per token: (2 + 2 + 6) / 3 masked tokens = 3.333333
    # per sample: sample means 2 and (2 + 6) / 2 = 4 -> (2 + 4) / 2 samples = 3
    values, mask = t(2, 2, 100, 6), t(1, 1, 0, 1)
    per_token = loss_reducer([1, 3], mask, per_token=True, global_num_tokens=3, global_num_samples=2)
    per_sample = loss_reducer([1, 3], mask, per_token=False, global_num_tokens=3, global_num_samples=2)
    assert per_token(values).item() == pytest.approx(10 / 3)
    assert per_sample(values).item() == pytest.approx(3.0)


def test_loss_reducer_sample_without_trained_tokens_adds_zero() -> None:
    # sample means: 4 and (nothing trained) 0 -> 4 / 2 samples = 2
    reduce = loss_reducer([1, 2], t(1, 0, 0), per_token=False, global_num_tokens=1, global_num_samples=2)
    assert reduce(t(4, 7, 9)).item() == pytest.approx(2.0)


@pytest.mark.parametrize("per_token", [True, False])
def test_loss_reduction_is_exact_under_any_micro_batch_split(per_token: bool) -> None:
    rng = random.Random(1234)
    torch.manual_seed(1234)
    for _ in range(20):
        lengths = [rng.randint(1, 9) for _ in range(rng.randint(2, 16))]
        mask = (torch.rand(sum(lengths)) < 0.7).to(torch.float64)
        mask[: lengths[0]] = 0.0  # one sample with nothing trained
        values = torch.randn(sum(lengths), dtype=torch.float64, requires_grad=True)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        samples = [(values[s:s + n], mask[s:s + n]) for s, n in zip(starts, lengths)]
        num_tokens, num_samples = int(mask.sum()), len(lengths)

        # the definition, written out over samples
        if per_token:
            expected = sum((v * m).sum() for v, m in samples) / num_tokens
        else:
            expected = sum((v * m).sum() / max(m.sum().item(), 1.0) for v, m in samples) / num_samples
        (expected_grad,) = torch.autograd.grad(expected, values)

        # a random partition of the samples (shuffled, not contiguous) into micro-batches
        order = list(range(len(lengths)))
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, len(order)), rng.randint(0, len(order) - 1)))
        parts = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)])]
        total = torch.zeros((), dtype=torch.float64)
        for part in parts:
            micro_values = torch.cat([samples[i][0] for i in part])
            micro_mask = torch.cat([samples[i][1] for i in part])
            reduce = loss_reducer([lengths[i] for i in part], micro_mask, per_token, num_tokens, num_samples)
            total = total + reduce(micro_values)
        (total_grad,) = torch.autograd.grad(total, values)

        torch.testing.assert_close(total, expected, atol=1e-12, rtol=0)
        torch.testing.assert_close(total_grad, expected_grad, atol=1e-12, rtol=0)


def test_loss_reducer_rejects_empty_global_counts() -> None:
    with pytest.raises(ValueError, match="global_num_tokens"):
        loss_reducer([1], t(1), per_token=True, global_num_tokens=0, global_num_samples=1)
    with pytest.raises(ValueError, match="global_num_samples"):
        loss_reducer([1], t(1), per_token=False, global_num_tokens=1, global_num_samples=0)
