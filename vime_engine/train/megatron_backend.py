"""Training backend `megatron`: a Megatron-Core GPT model built from HF weights (vime_engine.train.megatron_hf).

Same contract as the torch backend: build from an HF directory, per-token response log-probs,
`train_rollout(samples)` with the shared RL objective, the weights as an HF-named stream (`named_weights`, the
weight-sync source; collective: every rank iterates it), `save_hf`, and resumable state through Megatron's
distributed checkpointing (`save_state` / `load_state`, collective).

Initial weights: `--hf-checkpoint` (an HF directory: architecture, tokenizer, vLLM's first weights) or, as in slime
(whose actor starts from `--ref-load` when `--load` holds nothing), a converted torch_dist `--ref-load`
(vime_engine.convert), which is then also the KL reference. A resumed run loads its own checkpoint over them.

Parallelism comes from Megatron's flags in `cfg.megatron` (tensor / pipeline / expert parallel, sequence
parallel, recompute); the ranks left over form the data-parallel group. Micro-batches run through Megatron's
forward-backward schedule, so pipeline parallelism works unchanged. Each optimizer step's samples are dealt
round-robin over data-parallel ranks; the loss uses the step's global denominators and is scaled so that the
summed gradient equals the torch backend's (DDP averages over data-parallel ranks, the schedule over
micro-batches: both are undone). Routing replay (`--use-routing-replay`, `--use-rollout-routing-replay`) runs through
megatron-core's own router replay in the policy's MoE layers (vime_engine.train.megatron_routing_replay).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from vime_engine.algorithms.estimators import ESTIMATORS
from vime_engine.algorithms.token_log_probs import token_log_probs_and_entropy
from vime_engine.config import EngineConfig
from vime_engine.checkpoint.finite import check_finite_load, nonfinite_tensors, refuse_nonfinite_save
from vime_engine.checkpoint.manifest import ChecksumMismatch, FileEntry, verify_local_tree
from vime_engine.devices.accelerator import prepare_accelerator, resolve_accelerator
from vime_engine.devices.host_memory import keep_freed_heap
from vime_engine.sample import Sample
from vime_engine.train.megatron_hf import is_converted_checkpoint
from vime_engine.train.megatron_mtp import carried_mtp_tensors, require_kept_mtp_tensors
from vime_engine.train.micro_batches import derived_max_tokens, micro_batch_fixed_tokens, plan_micro_batches
from vime_engine.train.objective import MicroBatchOutputs, lr_schedule, micro_batch_loss, needs_reference
from vime_engine.train.rollout_batch import (
    RolloutBatch,
    build_rollout_batch,
    global_batches,
    old_log_probs_from_training_forward,
)
from vime_engine.train.routing_replay import ROUTES_MATCHED, ROUTES_REPLAYED, match_share, rollout_record


@dataclass
class _MicroBatch:
    indices: list[int]  # into the list of samples the batch was cut from
    input_ids: Tensor
    positions: Tensor
    rows: Tensor  # per response token: its row in input_ids
    columns: Tensor  # per response token: its position in input_ids
    padding: Tensor  # [rows, length]: True after each row's sample (its MoE router's loss leaves those out)
    lengths: list[int]  # each row's sample's tokens
    routes: tuple[Tensor, Tensor] | None = None  # routing replay's targets and covered tokens (MegatronRouterReplay)


class MegatronTrainBackend:
    def __init__(self, cfg: EngineConfig, device: str = "cpu"):
        self.cfg = cfg
        self.accelerator = resolve_accelerator(device)
        prepare_accelerator(self.accelerator)  # before the first megatron import (MindSpeed on NPU)
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.utils import get_model_config

        from vime_engine.train import megatron_model as mm

        if ESTIMATORS[cfg.algorithm.advantage_estimator].needs_critic:
            raise mm.MegatronSetupError(f"--advantage-estimator {cfg.algorithm.advantage_estimator} needs a critic: "
                                        "use --train-backend torch")
        self.mm, self.ps = mm, parallel_state
        self.layout = mm.ParallelLayout.from_flags(cfg.megatron, cfg.algorithm.moe_aux_loss_coeff)
        mm.init_distributed(self.accelerator, self.layout, cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        self.device = torch.device(self.accelerator.torch_device)
        if self.device.type == "cpu":
            keep_freed_heap()  # a step's large blocks are reused, not zeroed again (vime_engine.devices.host_memory)
        self.dtype = getattr(torch, cfg.model.dtype)
        bridge = cfg.train.megatron_to_hf_mode == "bridge"
        self.arch = mm.HFArchitecture.from_pretrained(cfg.model.hf_checkpoint, bridge=bridge)
        self.vocab_size = self.arch.vocab_size
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(cfg.model.hf_checkpoint)
        self.derived_max_tokens = derived_max_tokens(hf_config, self.dtype, self.device)
        self.micro_batch_fixed_tokens = micro_batch_fixed_tokens(hf_config, self.device)
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.layout.grad_reduce_in_fp32, overlap_grad_reduce=False)
        self.initial_weights = initial_weights(cfg)
        require_kept_mtp_tensors(self.initial_weights, self.arch)  # --save-hf carries them: missing, say so now
        # --megatron-to-hf-mode: how HF weights enter (an HF initial or reference model) and leave (the weight sync,
        # --save-hf) the Megatron model.
        self.hf_mapping = mm.hf_mapping(cfg.train.megatron_to_hf_mode, self.arch, cfg.model.hf_checkpoint)
        # Routing replay (vime_engine.train.megatron_routing_replay): "rollout" replays each sample's engine routing
        # (R3), "old_policy" the rollout's old-policy forward's (R2); None routes freely. The policy alone replays.
        self.routing_replay = cfg.algorithm.routing_replay
        if self.routing_replay is not None:
            from vime_engine.train.megatron_routing_replay import check_replay_layout

            flag = cfg.algorithm.routing_replay_flag
            if self.arch.moe is None:
                raise mm.MegatronSetupError(f"{flag}: the model has no experts to route")
            check_replay_layout(cfg.megatron, flag)
        self.model = mm.build_model_from(self.initial_weights, self.arch, self.layout, self.dtype, self.accelerator,
                                         ddp_config=ddp, routing_replay=self.routing_replay is not None,
                                         mapping=self.hf_mapping)
        self.router_replay = None
        if self.routing_replay is not None:
            from vime_engine.train.megatron_routing_replay import MegatronRouterReplay

            self.router_replay = MegatronRouterReplay([mm.unwrap(chunk) for chunk in self.model], self.layout,
                                                      self.arch.num_layers, self.arch.moe.topk)
        self.ref_model = None
        if needs_reference(cfg):
            ref_dir = cfg.checkpoint.ref_load or cfg.model.hf_checkpoint
            ref_arch = mm.architecture_of(ref_dir, bridge=bridge)
            ref_mapping = mm.hf_mapping(cfg.train.megatron_to_hf_mode, ref_arch, ref_dir)
            self.ref_model = mm.build_model_from(ref_dir, ref_arch, self.layout, self.dtype, self.accelerator,
                                                 mapping=ref_mapping)
            for chunk in self.ref_model:
                chunk.eval().requires_grad_(False)
        t = cfg.train
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=t.optimizer, lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
                bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16, params_dtype=self.dtype,
            ),
            self.model,
        )
        self.scheduler = _StepSchedule(cfg, self.optimizer)
        # Megatron's MoE routers add --moe-aux-loss-coeff × their load-balancing loss to the backward themselves
        # (each micro-batch's as its share 1 / micro-batches, averaged over data-parallel ranks like the gradients).
        self.router_losses = None
        if self.arch.moe is not None and self.layout.moe.aux_loss_coeff > 0:
            from vime_engine.train.megatron_moe import RouterLossRecorder

            self.router_losses = RouterLossRecorder([mm.unwrap(chunk) for chunk in self.model])
        config = get_model_config(self.model[0])
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss

    # -- forward passes through Megatron's schedule ------------------------------------------------------------
    def _micro_batches(self, samples: list[Sample]) -> list[list[int]]:
        return plan_micro_batches(self.cfg.train, [s.total_length for s in samples], self.derived_max_tokens,
                                  self.micro_batch_fixed_tokens)

    def _inputs(self, samples: list[Sample], indices: list[int], records: list[Tensor] | None = None) -> _MicroBatch:
        """The micro-batch of `samples[indices]`; with `records` (one per sample of `samples`), the routing it
        replays."""
        chosen = [samples[i] for i in indices]
        longest = max(s.total_length for s in chosen)
        if self.layout.sequence_parallel:  # the sequence splits evenly over the tensor-parallel ranks
            longest = -(-longest // self.layout.tensor) * self.layout.tensor
        input_ids = torch.zeros(len(chosen), longest, dtype=torch.long)
        for row, s in enumerate(chosen):
            input_ids[row, : s.total_length] = torch.tensor(s.prompt_tokens + s.response_tokens)
        rows = torch.repeat_interleave(torch.arange(len(chosen)), torch.tensor([s.response_length for s in chosen]))
        columns = torch.cat([torch.arange(len(s.prompt_tokens), s.total_length) for s in chosen])
        positions = torch.arange(longest).unsqueeze(0).expand(len(chosen), -1)
        lengths = [s.total_length for s in chosen]
        padding = positions >= torch.tensor(lengths).unsqueeze(1)
        routes = None
        if records is not None:
            routes = self.router_replay.routes([records[i] for i in indices], lengths, longest, self.device)
        return _MicroBatch(indices, *(x.to(self.device) for x in (input_ids, positions, rows, columns, padding)),
                           lengths, routes)

    def _response_outputs(self, batch: _MicroBatch, output: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Flat response log-probs and, if asked, entropy of one micro-batch from the last stage's output."""
        logits = self.mm.full_vocab_logits(output, self.vocab_size)
        response_logits = logits[batch.rows, batch.columns - 1]  # the logit at t-1 predicts token t
        tokens = batch.input_ids[batch.rows, batch.columns]
        temperature = self.cfg.rollout.rollout_temperature
        return token_log_probs_and_entropy(response_logits, tokens, temperature, with_entropy)

    def _schedule(self, model, batches: list[_MicroBatch], loss_func, forward_only: bool, routing=None) -> list:
        """Megatron's forward(-backward) schedule over `batches`; `routing` a replay's ReplayFeed (each batch's
        routes set before its forward) or a RecordFeed (each batch's routing taken after it)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from vime_engine.train.megatron_routing_replay import RecordFeed, ReplayFeed

        data = iter(batches)

        def forward_step(data_iterator, chunk):
            batch = next(data_iterator)
            moe = {}
            if self.router_losses is not None:
                self.router_losses.clear()  # drops what a recomputed forward recorded in the last backward
                moe["padding_mask"] = batch.padding
            if isinstance(routing, ReplayFeed):
                routing.replay_next(*batch.routes)
            output = chunk(input_ids=batch.input_ids, position_ids=batch.positions, attention_mask=None, **moe)
            if isinstance(routing, RecordFeed):
                routing.take(batch.indices, batch.lengths)
            return output, partial(loss_func, batch)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=model, num_microbatches=len(batches),
            seq_length=max(b.input_ids.shape[1] for b in batches),
            micro_batch_size=max(b.input_ids.shape[0] for b in batches), forward_only=forward_only,
        )

    @torch.no_grad()
    def _log_probs(self, model, samples: list[Sample], routing=None, records: list[Tensor] | None = None) -> Tensor:
        """Flat response log-probs of `samples` under `model`; the policy's routers replay `records` (one per
        sample) through `routing` (a ReplayFeed), or record into it (a RecordFeed)."""
        for chunk in model:
            chunk.eval()
        batches = [self._inputs(samples, mb, records) for mb in self._micro_batches(samples)]

        def collect(batch, output):
            return output.sum() * 0, {"log_probs": self._response_outputs(batch, output, with_entropy=False)[0]}

        outputs = self._schedule(model, batches, collect, forward_only=True, routing=routing)
        total = sum(s.response_length for s in samples)
        flat = torch.empty(total, dtype=torch.float32, device=self.device)
        if self.ps.is_pipeline_last_stage():
            order = torch.cat([torch.tensor(b.indices) for b in batches]).tolist()
            per_sample = dict(zip(order, _split([o["log_probs"] for o in outputs], batches, samples)))
            flat = torch.cat([per_sample[i] for i in range(len(samples))])
        if self.layout.pipeline > 1:
            torch.distributed.broadcast(
                flat, self.ps.get_pipeline_model_parallel_last_rank(),
                group=self.ps.get_pipeline_model_parallel_group(),
            )
        return flat

    def log_probs(self, samples: list[Sample]) -> Tensor:
        """Current policy's flat response log-probs (no gradient); every rank gets all samples'."""
        return self._log_probs(self.model, samples)

    def _old_policy(self, samples: list[Sample], records: list[Tensor] | None) -> tuple[Tensor, list[Tensor] | None]:
        """The old log-probs and the routing the training forwards replay: the rollout's `records`, replayed here
        too (R3), or this forward's own routing, recorded (R2), or None."""
        if self.routing_replay is None:
            return self.log_probs(samples), None
        if self.routing_replay == "rollout":
            with self.router_replay.replaying(count=False) as feed:
                return self._log_probs(self.model, samples, feed, records), records
        with self.router_replay.recording() as feed:
            log_probs = self._log_probs(self.model, samples, feed)
        return log_probs, [feed.records[i] for i in range(len(samples))]

    def _rollout_records(self, samples: list[Sample]) -> list[Tensor] | None:
        """Each sample's engine routing, checked (R3); None otherwise."""
        if self.routing_replay != "rollout":
            return None
        moe = self.arch.moe
        return [rollout_record(s, self.arch.num_layers, moe.topk, moe.num_experts) for s in samples]

    # -- one rollout's training ---------------------------------------------------------------------------------
    def train_rollout(self, samples: list[Sample]) -> dict[str, float]:
        """Advantages for the whole rollout, then one optimizer step per global batch; averaged metrics. Under
        routing replay every training forward replays `routes` (the rollout's, or the old-policy forward's)."""
        old_lp, routes = None, self._rollout_records(samples)
        if not old_log_probs_from_training_forward(self.cfg, len(samples)):
            old_lp, routes = self._old_policy(samples, routes)
        ref_lp = self._log_probs(self.ref_model, samples) if self.ref_model is not None else None
        rollout = build_rollout_batch(self.cfg, samples, old_lp, ref_lp, device=self.device)
        steps = global_batches(len(samples), self.cfg.global_batch_size)
        totals: dict[str, float] = {}
        for step in steps:
            for key, value in self._optimizer_step(samples, step, rollout, routes).items():
                totals[key] = totals.get(key, 0.0) + value / len(steps)
        totals["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return match_share(totals) if routes is not None else totals

    def _optimizer_step(self, samples: list[Sample], step: list[int], rollout: RolloutBatch,
                        routes: list[Tensor] | None = None) -> dict[str, float]:
        dp_rank, dp_size = self.ps.get_data_parallel_rank(), self.ps.get_data_parallel_world_size()
        local = step[dp_rank::dp_size]
        global_tokens, global_samples = max(rollout.num_tokens(step), 1), len(step)
        local_samples = [samples[i] for i in local]
        local_routes = None if routes is None else [routes[i] for i in local]
        batches = [self._inputs(local_samples, mb, local_routes) for mb in self._micro_batches(local_samples)]
        scale = len(batches) * dp_size  # undo the schedule's 1/num_microbatches and DDP's 1/dp averaging

        def loss_func(batch, output):
            log_probs, entropy = self._response_outputs(batch, output, with_entropy=True)
            targets = rollout.targets([local[i] for i in batch.indices])
            loss, metrics = micro_batch_loss(
                self.cfg, MicroBatchOutputs(log_probs, entropy), targets, global_tokens, global_samples
            )
            aux = self.router_losses.layer_mean() if self.router_losses is not None else None
            if aux is not None:  # its share of the mean over micro-batches and data-parallel ranks
                metrics["train/moe_aux_loss"] = aux / scale
            return loss * scale, metrics

        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if routes is None:
            outputs = self._schedule(self.model, batches, loss_func, forward_only=False)
        else:
            with self.router_replay.replaying(count=True) as feed:
                outputs = self._schedule(self.model, batches, loss_func, forward_only=False, routing=feed)
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        metrics = self._reduce_metrics(outputs)
        if grad_norm is not None:
            metrics["train/grad_norm"] = float(grad_norm)
        if routes is not None:
            metrics.update(self._routing_counts())
        return metrics

    def _routing_counts(self) -> dict[str, float]:
        """The step's replayed token × layer decisions and how many the routers' fresh choice matched, summed over
        the ranks that routed different ones: data-parallel ranks (their samples), pipeline stages (their layers),
        tensor-parallel ranks under sequence parallelism (their slices of the sequence)."""
        counts = torch.tensor([self.router_replay.matched, self.router_replay.replayed], dtype=torch.float64,
                              device=self.device)
        groups = [self.ps.get_data_parallel_group()]
        if self.layout.pipeline > 1:
            groups.append(self.ps.get_pipeline_model_parallel_group())
        if self.layout.sequence_parallel:
            groups.append(self.ps.get_tensor_model_parallel_group())
        for group in groups:
            torch.distributed.all_reduce(counts, group=group)
        return {ROUTES_MATCHED: counts[0].item(), ROUTES_REPLAYED: counts[1].item()}

    def _reduce_metrics(self, outputs: list[dict[str, float]]) -> dict[str, float]:
        """Sum the micro-batches' metric shares over data-parallel ranks; known on every pipeline stage."""
        summed: dict[str, float] = {}
        for metrics in outputs:
            for key, value in metrics.items():
                summed[key] = summed.get(key, 0.0) + value
        if self.layout.pipeline > 1:
            holder = [summed]
            torch.distributed.broadcast_object_list(
                holder, self.ps.get_pipeline_model_parallel_last_rank(),
                group=self.ps.get_pipeline_model_parallel_group(),
            )
            summed = holder[0]
        keys = sorted(summed)
        values = torch.tensor([summed[k] for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(values, group=self.ps.get_data_parallel_group())
        return dict(zip(keys, values.tolist()))

    # -- weights out --------------------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The policy's full weights in HF names (gathered over TP/PP; collective: every rank must iterate);
        `lm_head.weight` always included (vLLM needs it even when tied)."""
        for name, tensor in self.mm.hf_weight_stream(self.arch, self.model, with_lm_head=True, mapping=self.hf_mapping):
            yield name, tensor.detach()

    def save_hf(self, directory: str | Path, tokenizer_from: str | None = None) -> Path:
        """An HF directory (safetensors + config + tokenizer) of the current weights, with the multi-token-prediction
        layers the policy does not hold carried unchanged from its initial weights; collective, rank 0 writes."""
        from vime_engine.train.megatron_hf import copy_non_weight_files

        directory = Path(directory)
        weights = {name: t.cpu() for name, t in self.mm.hf_weight_stream(self.arch, self.model, with_lm_head=False,
                                                                         mapping=self.hf_mapping)}
        if torch.distributed.get_rank() == 0:
            self.mm.save_hf_weights({**weights, **carried_mtp_tensors(self.initial_weights, self.arch)}, directory)
            copy_non_weight_files(Path(tokenizer_from or self.cfg.model.hf_checkpoint), directory)
        torch.distributed.barrier()
        return directory

    # -- resumable state (Megatron distributed checkpointing) ---------------------------------------------------
    def _sharded_state(self, is_loading: bool) -> dict:
        model_state = self.mm.model_sharded_state_dict(self.model)
        return {
            **model_state,
            "optimizer": self.optimizer.sharded_state_dict(model_state, is_loading=is_loading),
            "scheduler": self.scheduler.state_dict(),
        }

    def save_state(self, directory: str | Path) -> dict[str, FileEntry]:
        """Model, optimizer and LR schedule as a torch_dist checkpoint in `directory` (collective), refused before
        a byte is written where any rank's weights hold NaN or inf. Returns no digests: the checkpoint's manifest
        hashes the files torch_dist wrote."""
        weights = {f"model{i}.{name}": p.detach() for i, chunk in enumerate(self.model)
                   for name, p in chunk.named_parameters()}
        refuse_nonfinite_save(directory, self._nonfinite_on_any_rank(nonfinite_tensors(weights)))
        self.mm.save_torch_dist(self._sharded_state(is_loading=False), Path(directory))
        return {}

    def load_state(self, directory: str | Path, expected: Mapping[str, FileEntry]) -> None:
        """Load after checking the files against `expected` (torch_dist reads them itself, so first); a checkpoint
        whose loaded shards (weights, optimizer state) hold NaN or inf on any rank is refused on every rank alike:
        one pass over what the load brought into memory, no second read."""
        directory = Path(directory)
        bad = verify_local_tree(directory, expected)
        if bad:
            raise ChecksumMismatch(f"{directory}: files differ from the manifest: {', '.join(bad)}")
        loaded = self.mm.load_torch_dist(self._sharded_state(is_loading=True), directory)
        bad = self._nonfinite_on_any_rank(nonfinite_tensors(loaded))
        if bad:
            self._back_to_initial_state()
            check_finite_load(directory, bad)
        for i, chunk in enumerate(self.model):
            self.mm.unwrap(chunk).load_state_dict(loaded["model" if len(self.model) == 1 else f"model{i}"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(loaded["scheduler"])


    def _back_to_initial_state(self) -> None:
        """torch_dist loads into the model's parameters and the optimizer's state in place: after a load that is
        refused, the trainer as it was built again (the initial weights, an optimizer that has taken no step), so a
        run with no other checkpoint to resume from starts from its initial weights, as with the torch backends."""
        self.mm.load_weights_from(self.model, self.initial_weights, self.arch, self.hf_mapping)
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            optimizer.optimizer.state.clear()  # torch's Adam makes its moments again at its first step
        self.optimizer.reload_model_params()  # mixed precision: the fp32 main copies from the weights

    def _nonfinite_on_any_rank(self, found: list[str]) -> list[str]:
        """This rank's non-finite tensors, or, where only other ranks' shards hold some, a name saying so: every
        rank decides alike (collective)."""
        anywhere = torch.tensor([float(bool(found))], device=self.device)
        torch.distributed.all_reduce(anywhere, op=torch.distributed.ReduceOp.MAX)
        return found or (["a shard of another rank"] if anywhere.item() else [])


def initial_weights(cfg: EngineConfig) -> str:
    """The directory the policy's weights come from before any checkpoint: a converted torch_dist --ref-load, or
    --hf-checkpoint."""
    ref = cfg.checkpoint.ref_load
    return ref if ref is not None and is_converted_checkpoint(ref) else cfg.model.hf_checkpoint


def _split(log_probs: list[Tensor], batches: list[_MicroBatch], samples: list[Sample]) -> list[Tensor]:
    """Per-sample pieces of each micro-batch's flat log-probs, in micro-batch order."""
    pieces = []
    for flat, batch in zip(log_probs, batches):
        pieces.extend(torch.split(flat, [samples[i].response_length for i in batch.indices]))
    return pieces


class _StepSchedule:
    """The shared LR schedule (vime_engine.algorithms.lr_schedule) driving Megatron's optimizer; its state, the
    optimizer steps taken, is part of the checkpoint."""

    def __init__(self, cfg: EngineConfig, optimizer):
        self.schedule, self.optimizer, self.num_steps = lr_schedule(cfg), optimizer, 0
        self._apply()

    def _apply(self) -> None:
        lr = self.schedule.learning_rate(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]
        self._apply()
