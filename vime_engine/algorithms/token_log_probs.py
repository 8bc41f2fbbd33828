"""Per-token log-probs and entropy of sampled tokens, over the vocabulary in chunks of tokens.

The plain computation (`log_softmax(logits.float() / T)`, then a gather, then softmax and log_softmax again for
the entropy) materialises several fp32 [tokens, vocab] tensors and keeps them for the backward pass; at a
49k-token vocabulary they dominate the trainer's memory traffic. Here each chunk of tokens is processed on its
own: the forward keeps only the logits it was given (for the backward) and the results, and the backward recomputes
the chunk's softmax to write the logits' gradient, using

    d log p(y) / d z_j = [j == y] - p_j          d H / d z_j = -(p_j log p_j + p_j H)

for z = logits / T and H = -sum_j p_j log p_j. Each pass over a chunk's [tokens, vocab] block costs as much as
the arithmetic on it, so the forward takes the log-probs from one logsumexp (log p(y) = z_y - logsumexp(z)) and
the entropy from that same logsumexp as H = logsumexp(z) - sum_j p_j z_j, with p = exp(z - logsumexp(z)) written
over in place (no logarithm over the vocabulary: half the time of entr(softmax(z)) on CPU, 512 tokens x 49,152),
and the backward, which the entropy reaches only when the loss uses it, does the log-probs' part with one softmax
written over in place. `p log p` is `xlogy(p, p)`: 0 where p == 0 (logit -inf).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DEFAULT_CHUNK_TOKENS", "token_log_probs_and_entropy"]

# 512 tokens x 49,152 vocabulary x 4 bytes = 100 MB of fp32 scratch per chunk at most.
DEFAULT_CHUNK_TOKENS = 512


def token_log_probs_and_entropy(
    logits: Tensor, tokens: Tensor, temperature: float, with_entropy: bool,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor | None]:
    """log p(tokens) under softmax(logits / temperature) and, if asked, the entropy of that distribution.

    logits [N, V] (any float dtype), tokens [N] -> (log_probs [N] fp32, entropy [N] fp32 or None); both
    differentiable with respect to `logits`, the gradient in `logits`' dtype. Equal to the plain computation
    up to float rounding. Vocabulary entries with logit -inf have p = 0 and add 0 to the entropy.
    """
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V] and tokens [N], got {tuple(logits.shape)} and {tuple(tokens.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    log_probs, entropy = _ChunkedLogSoftmax.apply(logits, tokens, temperature, with_entropy, chunk_tokens)
    return log_probs, (entropy if with_entropy else None)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


class _ChunkedLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, with_entropy: bool, chunk: int):
        n = logits.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z = _scaled(logits[start:end], temperature)
            lse = torch.logsumexp(z, dim=-1)
            log_probs[start:end] = z.gather(-1, tokens[start:end].unsqueeze(-1)).squeeze(-1) - lse
            if with_entropy:  # H = lse - sum_j p_j z_j; nansum: a -inf logit's 0 * -inf adds 0
                p = (z - lse.unsqueeze(-1)).exp_()
                entropy[start:end] = lse - p.mul_(z).nansum(dim=-1)
        ctx.save_for_backward(logits, tokens)
        ctx.set_materialize_grads(False)  # an output the loss does not use (entropy as a metric) gets None
        ctx.temperature, ctx.with_entropy, ctx.chunk = temperature, with_entropy, chunk
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None):
        logits, tokens = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        n = logits.shape[0]
        entropy_grad = ctx.with_entropy and grad_entropy is not None
        for start in range(0, n, ctx.chunk):
            end = min(start + ctx.chunk, n)
            p = torch.softmax(_scaled(logits[start:end], ctx.temperature), dim=-1)
            if entropy_grad:
                p_log_p = torch.special.xlogy(p, p)
                entropy = -p_log_p.sum(dim=-1, keepdim=True)
                grad_z = p_log_p.add_(p * entropy).mul_(-grad_entropy[start:end].unsqueeze(-1))
                if grad_log_probs is not None:
                    grad_z -= grad_log_probs[start:end].unsqueeze(-1) * p
            elif grad_log_probs is not None:
                grad_z = p.mul_(-grad_log_probs[start:end].unsqueeze(-1))
            else:
                grad_z = p.zero_()
            if grad_log_probs is not None:
                grad_z.scatter_add_(-1, tokens[start:end].unsqueeze(-1), grad_log_probs[start:end].unsqueeze(-1))
            grad_logits[start:end] = grad_z if ctx.temperature == 1.0 else grad_z.div_(ctx.temperature)
        return grad_logits, None, None, None, None
