"""Chunked per-token log-probs and entropy against the plain computation, values and gradients."""

import pytest
import torch

from vime_engine.algorithms.losses import entropy_from_logits
from vime_engine.algorithms.token_log_probs import token_log_probs_and_entropy


def _plain(logits, tokens, temperature):
    z = logits.float() / temperature
    log_probs = torch.log_softmax(z, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy_from_logits(z)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_the_plain_computation(chunk, temperature):
    torch.manual_seed(0)
    logits = (torch.randn(7, 50, dtype=torch.float64) * 3)
    logits[2, 5] = float("-inf")  # an entry with p == 0 adds nothing to the entropy, with a finite gradient
    tokens = torch.randint(0, 50, (7,))
    tokens[2] = 4
    w_lp, w_h = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)

    ours_in = logits.clone().requires_grad_(True)
    lp, h = token_log_probs_and_entropy(ours_in, tokens, temperature, with_entropy=True, chunk_tokens=chunk)
    ((lp * w_lp).sum() + (h * w_h).sum()).backward()

    plain_in = logits.clone().requires_grad_(True)
    plain_lp, plain_h = _plain(plain_in, tokens, temperature)
    ((plain_lp * w_lp).sum() + (plain_h * w_h).sum()).backward()

    assert lp.dtype == torch.float32 and h.dtype == torch.float32
    torch.testing.assert_close(lp, plain_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, plain_h, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(ours_in.grad).all()
    torch.testing.assert_close(ours_in.grad, plain_in.grad, atol=1e-5, rtol=1e-4)


def test_log_probs_alone_and_half_precision_logits():
    torch.manual_seed(1)
    logits = torch.randn(5, 40).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, 40, (5,))
    lp, h = token_log_probs_and_entropy(logits, tokens, 1.0, with_entropy=False, chunk_tokens=2)
    assert h is None
    lp.sum().backward()
    plain_in = logits.detach().clone().requires_grad_(True)
    torch.log_softmax(plain_in.float(), -1).gather(-1, tokens.unsqueeze(-1)).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, _plain(logits.detach(), tokens, 1.0)[0])
    torch.testing.assert_close(logits.grad, plain_in.grad)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_alone_in_fp32_and_one_backward_only(temperature):
    """Without the entropy the saved softmax becomes the logits' gradient in place: the gradient is the plain
    one, and a second backward through the same graph is refused rather than computed from a spent buffer."""
    torch.manual_seed(2)
    logits = (torch.randn(6, 30) * 2).requires_grad_(True)
    tokens = torch.randint(0, 30, (6,))
    weights = torch.randn(6)
    lp, _ = token_log_probs_and_entropy(logits, tokens, temperature, with_entropy=False, chunk_tokens=4)
    (lp * weights).sum().backward(retain_graph=True)
    plain_in = logits.detach().clone().requires_grad_(True)
    (_plain(plain_in, tokens, temperature)[0] * weights).sum().backward()
    torch.testing.assert_close(logits.grad, plain_in.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="differentiated twice"):
        (lp * weights).sum().backward()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        token_log_probs_and_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long), 1.0, True)
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0.0, True)
