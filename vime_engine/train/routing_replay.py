"""Routing replay for mixture-of-experts models (vime's `--use-routing-replay` and `--use-rollout-routing-replay`):
the trainer's forward sends each token to recorded experts instead of the ones its router picks now.

The routing record, the one contract the rollout side and every training backend share:
  one integer array per sample, shape [len(sample.tokens) - 1, num_hidden_layers, top_k], where sample.tokens is
  prompt + response. Row t holds, for each decoder layer l, the top_k experts (indices in [0, num_experts)) that
  layer l's router sent token t to. The last token has no row: generation never feeds it to the model, and no
  trained log-prob depends on its output. A layer without experts holds anything (vLLM leaves zeros). The order
  of a row's top_k entries carries nothing (the experts' outputs are summed); the set does. Any integer dtype:
  vLLM returns uint8 for up to 256 experts and uint16 above; the trainer's own records are int64.
  This is vLLM's `CompletionOutput.routed_experts` ([seq_len, layer_num, topk], `enable_return_routed_experts`)
  and vime's / slime's `Sample.rollout_routed_experts`.
Where it lives:
  --use-rollout-routing-replay (R3): on the Sample, as `rollout_routed_experts`, the engine's routing while it
  generated; it travels with the sample through Ray, the dynamic-sampling carry-over and the partial-rollout
  buffer (the checkpoint's buffer.pkl). Every forward of the policy replays it: the old-log-prob pass and the
  training forwards. A response continued after an abort takes its last request's record, which covers the whole
  sequence (vLLM returns routing only for finished requests, from token 0 of the request's prompt).
  --use-routing-replay (R2): the trainer records it in the rollout's old-policy forward (the no-grad pass that
  computes the old log-probs, run for that even when the rollout is one optimizer step, as slime does), keeps it
  beside the samples for the rollout's optimizer steps, whose forwards replay it, and drops it. The reference
  model's forward routes freely in both modes.
The Megatron backend replays the same records through megatron-core's own router replay
(`moe_enable_routing_replay`), laid out in Megatron's token order: vime_engine.train.megatron_routing_replay.

Mechanics on HF's Qwen3-MoE router (softmax over every expert's logit, top_k, renormalised when the model's
`norm_topk_prob`): the router runs as usual and a forward hook replaces its top_k with the recorded experts and
its weights with the softmax at those experts, renormalised as the router does (`replayed_gate_weights`). For a
renormalising router that is Megatron's replay (`probs = scores.gather(1, recorded)`, then the router's softmax
over the gathered logits: the same numbers): the weights come from the current logits, so the gradient reaches the router's weights
through the recorded experts' logits. Replaying the router's own choice leaves the forward bit for bit as it was.
The load-balancing loss (`--moe-aux-loss-coeff`) keeps counting the router's fresh top-k of the current logits,
as Megatron's aux loss does under replay (`compute_routing_scores_for_aux_loss`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vime_engine.sample import Sample
from vime_engine.train.forward_rows import ForwardRows

# Routing replay's counts of token × MoE-layer decisions, summed over micro-batches and ranks like the metrics, then
# turned into train/routing_replay_match (`match_share`): the share whose freshly computed experts were the replayed
# ones. Every training backend reports them under these keys.
ROUTES_MATCHED, ROUTES_REPLAYED = "routing/matched", "routing/replayed"

# The HF model types whose router this module replays, and why each other MoE would need its own hook: the
# router's output must be (logits, top-k weights, top-k indices) with softmax-then-top-k weights.
REPLAYABLE_MODEL_TYPES = ("qwen3_moe",)


def replayed_gate_weights(logits: Tensor, experts: Tensor, renormalise: bool) -> Tensor:
    """The gate weights of the chosen `experts` [tokens, top_k] under the router's `logits` [tokens, num_experts]:
    softmax over all experts (in float32, as HF's router), taken at `experts`, divided by their sum if
    `renormalise`, in the logits' dtype. Invariant: with `experts` = the top_k of the softmax, exactly HF's
    Qwen3-MoE router weights."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, experts)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def match_share(totals: dict[str, float]) -> dict[str, float]:
    """`totals` with the routing counts of a rollout's training forwards (averaged over its optimizer steps alike)
    replaced by their ratio, `train/routing_replay_match` (absent where nothing was replayed)."""
    totals = dict(totals)
    matched, replayed = totals.pop(ROUTES_MATCHED), totals.pop(ROUTES_REPLAYED)
    if replayed:
        totals["train/routing_replay_match"] = matched / replayed
    return totals


def same_experts(a: Tensor, b: Tensor) -> Tensor:
    """[tokens] bool: whether rows of `a` and `b` ([tokens, top_k]) name the same set of experts."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def rollout_record(sample: Sample, num_layers: int, top_k: int, num_experts: int) -> Tensor:
    """`sample.rollout_routed_experts` as an int64 tensor, checked against the record's contract."""
    where = f"sample of group {sample.group_index}"
    if sample.rollout_routed_experts is None:
        raise ValueError(f"--use-rollout-routing-replay: {where} has no rollout_routed_experts; the engine returns "
                         "them with every finished request (vLLM's enable_return_routed_experts)")
    record = torch.as_tensor(np.asarray(sample.rollout_routed_experts, dtype=np.int64))
    expected = (sample.total_length - 1, num_layers, top_k)
    if tuple(record.shape) != expected:
        raise ValueError(f"--use-rollout-routing-replay: {where} has rollout_routed_experts of shape "
                         f"{tuple(record.shape)}, expected {expected} (tokens - 1, layers, experts per token)")
    if record.numel() and (record.min() < 0 or record.max() >= num_experts):
        raise ValueError(f"--use-rollout-routing-replay: {where} routes to experts outside [0, {num_experts})")
    return record


def moe_routers(model: nn.Module) -> dict[nn.Module, int]:
    """The model's replayable routers and the decoder layer each routes for (from its module name)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    routers = {}
    for name, module in model.named_modules():
        if isinstance(module, Qwen3MoeTopKRouter):
            routers[module] = int(re.search(r"layers\.(\d+)\.", name).group(1))
    return routers


class RoutingPass:
    """The routing of one forward over forward rows: the records to replay (one per sample of the rows, in row
    order; None: route freely), and once the forward ran, the experts each token went to (`records`) and how often
    the routers' fresh choice was the replayed one (`matched` of `replayed` token × MoE-layer decisions).

    A shared-prompt row (vime_engine.train.forward_rows) runs its prompt once: its prompt positions replay the
    row's last sample's record there (the samples of a prompt share its routing up to the engine's arithmetic)."""

    def __init__(self, replay: Sequence[Tensor] | None = None):
        self.replay = replay
        self.matched = 0
        self.replayed = 0
        self._layout: ForwardRows | None = None
        self._chosen: Tensor | None = None  # [rows × length, layers, top_k] the experts each token went to

    @contextlib.contextmanager
    def applied(self, model: nn.Module, layout: ForwardRows) -> Iterator[None]:
        """Replay (and record) the routing while `model` runs over `layout`."""
        routers = moe_routers(model)
        config = model.config
        positions = layout.input_ids.numel()
        self._layout = layout
        self._chosen = torch.zeros(positions, config.num_hidden_layers, config.num_experts_per_tok,
                                   dtype=torch.long, device=layout.input_ids.device)
        targets, replayed = self._targets(layout, self._chosen) if self.replay is not None else (None, None)

        def hook(router: nn.Module, _inputs: Any, output: tuple[Tensor, Tensor, Tensor]):
            logits, weights, fresh = output
            layer = routers[router]
            if targets is None:
                self._chosen[:, layer] = fresh
                return None
            experts = torch.where(replayed[:, None], targets[:, layer], fresh)
            self.matched += int(same_experts(fresh, experts)[replayed].sum())
            self.replayed += int(replayed.sum())
            self._chosen[:, layer] = experts
            return logits, replayed_gate_weights(logits, experts, router.norm_topk_prob), experts

        handles = [router.register_forward_hook(hook) for router in routers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def records(self) -> list[Tensor]:
        """Each sample's routing in this forward, in row order, as the record's contract lays it out."""
        return [self._chosen[index[:-1]] for index in self._layout.sample_token_index()]

    def _targets(self, layout: ForwardRows, like: Tensor) -> tuple[Tensor, Tensor]:
        """The replayed experts at every position of the rows, and where a record gives them."""
        targets = torch.zeros_like(like)
        replayed = torch.zeros(like.shape[0], dtype=torch.bool, device=like.device)
        for index, record in zip(layout.sample_token_index(), self.replay, strict=True):
            if record.shape[0] != index.numel() - 1:
                raise ValueError(f"a routing record of {record.shape[0]} rows for a sample of {index.numel()} tokens")
            targets[index[:-1]] = record.to(targets.device)
            replayed[index[:-1]] = True
        return targets, replayed
