"""Routing replay on the Megatron backend: megatron-core's own router replay (`moe_enable_routing_replay`: one
`RouterReplay` per MoE layer, the same API in megatron-core 0.16 and 0.19) fed from the routing record of
vime_engine.train.routing_replay, so that `--use-routing-replay` (R2) and `--use-rollout-routing-replay` (R3) mean
here what they mean on the torch backends: every forward of the policy in a rollout's training replays the record
(R3: the old-log-prob pass too; R2: that pass records it), the reference model routes freely (it is built without
replay), and so does every other forward of the policy.

Megatron's token order: a MoE layer's router gets the micro-batch's hidden states as [sequence, rows, hidden] and
routes them flattened sequence-major (position s of row b is token s·rows + b); under sequence parallelism each
tensor-parallel rank r routes only its contiguous slice of the sequence, positions [r·S/tp, (r+1)·S/tp); an
expert-parallel rank routes its own micro-batch's tokens before they are dispatched. Micro-batches are padded to
their longest sample (to a multiple of tp under sequence parallelism), and Megatron's replay cannot leave a token
free: the positions no record covers (each sample's last token, whose output no trained log-prob reads, and the
padding) replay the first top_k experts, and only covered positions count in the match.

Each rank replays the MoE layers of its own pipeline stage; a record it makes (R2) fills those layers, the other
layers' columns stay zero and are never read on this rank.

Activation recomputation reruns a micro-batch's MoE layers in its backward. Megatron's REPLAY_FORWARD answers that
run with the micro-batch's targets as long as no later micro-batch's forward came in between, which holds for
Megatron's schedule without pipeline parallelism; with it (several forwards in flight) the recomputation would need
REPLAY_BACKWARD switched on at the right moments, which megatron-core leaves to the caller: refused
(`check_replay_layout`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from vime_engine.train.megatron_layout import MegatronSetupError, ParallelLayout
from vime_engine.train.routing_replay import same_experts


def check_replay_layout(megatron_flags: dict[str, Any], flag: str) -> None:
    """What Megatron's router replay cannot run here, refused naming the flags (Megatron's pass-through flags,
    read without importing Megatron: the preflight calls it too)."""
    recompute = megatron_flags.get("recompute-granularity")
    pipeline = int(megatron_flags.get("pipeline-model-parallel-size") or 1)
    if recompute is not None and pipeline > 1:
        raise MegatronSetupError(
            f"{flag} with --recompute-granularity {recompute} and --pipeline-model-parallel-size {pipeline}: a "
            "recomputed MoE layer would replay a later micro-batch's routing (Megatron's REPLAY_BACKWARD is not "
            "wired); drop the recomputation or the pipeline parallelism")


def sequence_share(length: int, layout: ParallelLayout, tensor_rank: int) -> slice:
    """The positions of a padded micro-batch of `length` that this tensor-parallel rank's routers see."""
    if not layout.sequence_parallel:
        return slice(None)
    share = length // layout.tensor
    return slice(tensor_rank * share, (tensor_rank + 1) * share)


def micro_batch_routes(records: Sequence[Tensor], lengths: Sequence[int], padded_length: int, layers: Sequence[int],
                       top_k: int, positions: slice = slice(None)) -> tuple[Tensor, Tensor]:
    """Megatron's replay targets of one micro-batch whose row b holds a sample of `lengths[b]` tokens (the record
    `records[b]`, [lengths[b] - 1, num_layers, top_k]) padded to `padded_length`: [len(layers), tokens, top_k] int64,
    token s·rows + b of the `positions` share of the sequence, and [tokens] bool, whether a record covers it.
    Invariant: `records_of_micro_batch` of the targets (all positions) gives the records back on `layers`."""
    rows = len(records)
    targets = torch.arange(top_k).expand(padded_length, rows, len(layers), top_k).clone()
    covered = torch.zeros(padded_length, rows, dtype=torch.bool)
    for row, (record, length) in enumerate(zip(records, lengths, strict=True)):
        if record.shape[0] != length - 1:
            raise ValueError(f"a routing record of {record.shape[0]} rows for a sample of {length} tokens")
        targets[: length - 1, row] = record[:, list(layers)].long()
        covered[: length - 1, row] = True
    targets, covered = targets[positions], covered[positions]
    return targets.permute(2, 0, 1, 3).reshape(len(layers), -1, top_k), covered.reshape(-1)


def records_of_micro_batch(chosen: Tensor, lengths: Sequence[int], num_layers: int,
                           layers: Sequence[int]) -> list[Tensor]:
    """Each row's record ([lengths[b] - 1, num_layers, top_k], zero outside `layers`) from what the routers of
    `layers` chose over the whole micro-batch, `chosen` [len(layers), padded_length · rows, top_k]."""
    rows = len(lengths)
    per_position = chosen.reshape(len(layers), -1, rows, chosen.shape[-1])
    records = []
    for row, length in enumerate(lengths):
        record = torch.zeros(length - 1, num_layers, chosen.shape[-1], dtype=torch.long)
        record[:, list(layers)] = per_position[:, : length - 1, row].permute(1, 0, 2).to("cpu", torch.long)
        records.append(record)
    return records


class MegatronRouterReplay:
    """The policy model's RouterReplay instances (one per MoE layer of this rank's pipeline stage, in layer order),
    driven one forward pass at a time (`replaying`, `recording`); between passes they route freely. Counts how often
    the routers' fresh top-k was the replayed one in the passes asked to (`matched` of `replayed` token × layer
    decisions), once per micro-batch: not again in its recomputation."""

    def __init__(self, chunks: Sequence[torch.nn.Module], layout: ParallelLayout, num_layers: int, top_k: int):
        from megatron.core.transformer.moe.router import TopKRouter

        found = sorted(((module.layer_number - 1, module.router_replay) for chunk in chunks
                        for module in chunk.modules()
                        if isinstance(module, TopKRouter) and module.router_replay is not None), key=lambda x: x[0])
        self.layers = [layer for layer, _ in found]
        self.instances = [instance for _, instance in found]
        self.layout, self.num_layers, self.top_k = layout, num_layers, top_k
        self.matched = self.replayed = 0
        self._covered: Tensor | None = None
        self._to_count: set[int] = set()
        for instance in self.instances:
            instance.get_replay_topk = self._counting(instance, instance.get_replay_topk)

    def _counting(self, instance, get_replay_topk):
        def get_replay_topk_and_count(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, chosen = get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
            if id(instance) in self._to_count:
                self._to_count.discard(id(instance))
                fresh = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
                covered = self._covered.to(scores.device)
                self.matched += int(same_experts(fresh, chosen)[covered].sum())
                self.replayed += int(covered.sum())
            return probs, chosen

        return get_replay_topk_and_count

    def set_targets(self, targets: Tensor, covered: Tensor | None) -> None:
        """The next micro-batch's targets, [layers, tokens, top_k]; its match counted over `covered` unless None."""
        for instance, layer_targets in zip(self.instances, targets, strict=True):
            instance.set_target_indices(layer_targets)
        if covered is not None:
            self._covered = covered
            self._to_count = {id(instance) for instance in self.instances}

    def routes(self, records: Sequence[Tensor], lengths: Sequence[int], padded_length: int,
               device: torch.device) -> tuple[Tensor, Tensor]:
        """This rank's replay targets of a micro-batch (`micro_batch_routes` on its layers and sequence share)."""
        from megatron.core import parallel_state

        positions = sequence_share(padded_length, self.layout, parallel_state.get_tensor_model_parallel_rank())
        targets, covered = micro_batch_routes(records, lengths, padded_length, self.layers, self.top_k, positions)
        return targets.to(device), covered.to(device)

    @contextlib.contextmanager
    def replaying(self, count: bool) -> Iterator[ReplayFeed]:
        """A pass whose micro-batches replay the targets `ReplayFeed.replay_next` gives before each forward; with
        `count`, `matched` and `replayed` are this pass's."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if count:
            self.matched = self.replayed = 0
        with self._acting(RouterReplayAction.REPLAY_FORWARD):
            yield ReplayFeed(self, count)

    @contextlib.contextmanager
    def recording(self) -> Iterator[RecordFeed]:
        """A pass whose routers' choices `RecordFeed.take` collects after each micro-batch's forward."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        with self._acting(RouterReplayAction.RECORD):
            yield RecordFeed(self)

    @contextlib.contextmanager
    def _acting(self, action) -> Iterator[None]:
        for instance in self.instances:
            instance.set_router_replay_action(action)
        try:
            yield
        finally:
            for instance in self.instances:
                instance.clear_router_replay_action()
                instance.clear_indices()
            self._to_count.clear()


class ReplayFeed:
    """One replaying pass: the targets of each micro-batch, set before its forward."""

    def __init__(self, replay: MegatronRouterReplay, count: bool):
        self.replay, self.count = replay, count

    def replay_next(self, targets: Tensor, covered: Tensor) -> None:
        self.replay.set_targets(targets, covered if self.count else None)


class RecordFeed:
    """One recording pass: each sample's record, taken micro-batch by micro-batch after its forward."""

    def __init__(self, replay: MegatronRouterReplay):
        self.replay = replay
        self.records: dict[int, Tensor] = {}

    def take(self, indices: Sequence[int], lengths: Sequence[int]) -> None:
        """What the routers chose in the forward that just ran over the samples `indices` (rows in order, of
        `lengths` tokens), kept as their records; under sequence parallelism gathered over the tensor-parallel
        ranks first (collective)."""
        from megatron.core import parallel_state

        replay = self.replay
        if not replay.instances:  # a pipeline stage of dense layers only
            for index, length in zip(indices, lengths, strict=True):
                self.records[index] = torch.zeros(length - 1, replay.num_layers, replay.top_k, dtype=torch.long)
            return
        chosen = torch.stack([instance.get_recorded_indices() for instance in replay.instances])
        if replay.layout.sequence_parallel:
            group = parallel_state.get_tensor_model_parallel_group()
            shares = [torch.empty_like(chosen) for _ in range(replay.layout.tensor)]
            torch.distributed.all_gather(shares, chosen.contiguous(), group=group)
            chosen = torch.cat(shares, dim=1)  # the sequence slices, in rank order: sequence-major again
        for index, record in zip(indices, records_of_micro_batch(chosen, lengths, replay.num_layers, replay.layers),
                                 strict=True):
            self.records[index] = record
