"""Training backend `torch`: an HF transformers causal LM with a torch AdamW optimizer (vime_engine.train.backend).

Data parallel over the trainer group's ranks (gloo on CPU, nccl on CUDA, hccl on Ascend), each rank training its
round-robin share of each optimizer step (vime_engine.train.data_parallel): with `--train-backend torch` through
torch's DistributedDataParallel (every rank holds the whole model and optimizer state), with `--train-backend fsdp`
through FSDP2 (vime_engine.train.sharding: each rank holds a shard of the parameters, gradients and optimizer
state, and every forward and backward is a collective, so the ranks run equally many). The loss keeps the step's
global denominators and is scaled by the world size (both average gradients), so the summed gradient, and the
update, do not depend on the number of ranks. The per-token log-probs before training, when a rollout needs them
(several optimizer steps), are computed on each rank's share and gathered. Checkpoints hold whole tensors, which
rank 0 writes, so any number of ranks, sharded or not, can load them.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from vime_engine.algorithms.estimators import ESTIMATORS
from vime_engine.algorithms.packing import split_to_count
from vime_engine.algorithms.token_log_probs import token_log_probs_and_entropy
from vime_engine.config import EngineConfig
from vime_engine.checkpoint.manifest import FileEntry, read_verified
from vime_engine.devices.host_memory import keep_freed_heap
from vime_engine.sample import Sample
from vime_engine.checkpoint.tensor_files import join_tensors, read_tensors, split_tensors, write_tensors
from vime_engine.train.data_parallel import DataParallel
from vime_engine.train.forward_rows import build_forward_rows
from vime_engine.train.micro_batches import (
    attention_pair_cost,
    derived_max_tokens,
    micro_batch_fixed_tokens,
    plan_shared_prompt_micro_batches,
)
from vime_engine.train.objective import MicroBatchOutputs, lr_schedule, micro_batch_loss, needs_reference
from vime_engine.train.routing_replay import (
    ROUTES_MATCHED,
    ROUTES_REPLAYED,
    RoutingPass,
    match_share,
    rollout_record,
)
from vime_engine.train.rollout_batch import (
    RolloutBatch,
    build_rollout_batch,
    global_batches,
    old_log_probs_from_training_forward,
)
from vime_engine.train.sample_attention import sample_attention_layout, use_sample_attention
from vime_engine.train.sharding import gathered, shard_model, sharded_like, sharded_optimizer_state, whole

# The files of the resumable state (the checkpoint's trainer part).
MODEL_FILE = "model.safetensors"
TRAINER_TENSORS_FILE = "trainer.safetensors"  # optimizer moments, critic weights
TRAINER_STATE_FILE = "trainer.pt"  # the rest: param groups, scheduler, RNG states (small)
# `--optimizer`: Megatron's "adam" applies weight decay decoupled, as AdamW does.
OPTIMIZERS = {"adam": torch.optim.AdamW}
# Where torch has a fused AdamW kernel (one pass over each tensor instead of a dozen elementwise ops; SmolLM2-135M
# on 2 CPU cores: 71 ms a step against 305 ms, updates within 1.2e-7 of the unfused); elsewhere (torch_npu) the
# unfused one.
FUSED_OPTIMIZER_DEVICES = {"cpu", "cuda"}
# Where each sample's attention runs on its own tokens (vime_engine.train.sample_attention): SDPA with a mask and
# index gathers, measured on CPU; on CUDA the same calls (not measured here); torch_npu keeps the rows' mask.
SAMPLE_ATTENTION_DEVICES = {"cpu", "cuda"}


def train_every_embedding_row(model: nn.Module) -> nn.Module:
    """`model` with its pad token's input-embedding row trained like every other row, as Megatron trains it.

    HF builds the input embeddings with `padding_idx = config.pad_token_id`, which gives that row no gradient from
    its lookups. Our forward rows never feed padding into a loss (forward_rows.py), so the only lookups of the pad
    id are real tokens: SmolLM2's pad is its end of turn <|im_end|>, in every chat prompt and response."""
    model.get_input_embeddings().padding_idx = None
    return model


class ValueHead(nn.Module):
    """PPO critic: the policy's architecture with a scalar head on the last hidden state."""

    def __init__(self, model_path: str, dtype: torch.dtype):
        super().__init__()
        from transformers import AutoModel

        self.body = train_every_embedding_row(AutoModel.from_pretrained(model_path, torch_dtype=dtype))
        self.head = nn.Linear(self.body.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1)


class TorchTrainBackend:
    def __init__(self, cfg: EngineConfig, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_heap()  # a step's large blocks are reused, not zeroed again (vime_engine.devices.host_memory)
        dtype = getattr(torch, cfg.model.dtype)
        torch.manual_seed(cfg.train.seed)
        self.model = train_every_embedding_row(
            AutoModelForCausalLM.from_pretrained(cfg.model.hf_checkpoint, torch_dtype=dtype)).to(self.device)
        self.model.train()
        self.derived_max_tokens = derived_max_tokens(self.model.config, dtype, self.device)
        self.micro_batch_fixed_tokens = micro_batch_fixed_tokens(self.model.config, self.device)
        # Samples share their prompt's forward row. On torch's SDPA (the default attention of HF models), where
        # SAMPLE_ATTENTION_DEVICES has the device, each sample's attention runs on its own tokens
        # (vime_engine.train.sample_attention), so a row's length adds nothing to it; elsewhere SDPA takes the rows'
        # mask and its cost grows with the row's length squared; flash-attention kernels take no mask: a row per
        # sample.
        attention = self.model.config._attn_implementation
        self.sample_attention = self.device.type in SAMPLE_ATTENTION_DEVICES and use_sample_attention(self.model)
        self.attention_pair_cost = (0.0 if self.sample_attention
                                    else attention_pair_cost(self.model.config) if attention == "sdpa" else None)
        # A mixture-of-experts model's load-balancing loss, in the training forward only (preflight refused a
        # coefficient for a model without experts); at 0 the forward and the loss are the dense path's.
        self.moe_aux_loss = cfg.algorithm.moe_aux_loss_coeff > 0
        # Routing replay (vime_engine.train.routing_replay): "rollout" replays each sample's engine routing (R3),
        # "old_policy" the rollout's old-policy forward's (R2); None routes freely.
        self.routing_replay = cfg.algorithm.routing_replay
        self.ref_model = None
        if needs_reference(cfg):
            ref_path = cfg.checkpoint.ref_load or cfg.model.hf_checkpoint
            self.ref_model = AutoModelForCausalLM.from_pretrained(ref_path, torch_dtype=dtype).to(self.device).eval()
            self.ref_model.requires_grad_(False)
            if self.sample_attention and not use_sample_attention(self.ref_model):
                raise ValueError(f"the reference model {ref_path} does not run on torch's SDPA as the policy "
                                 f"{cfg.model.hf_checkpoint} does; give it the same architecture")
        self.critic = None
        if ESTIMATORS[cfg.algorithm.advantage_estimator].needs_critic:
            self.critic = ValueHead(cfg.model.hf_checkpoint, dtype).to(self.device)
        t = cfg.train
        self.dp = DataParallel.from_default_group(str(self.device))
        self.sharded = t.train_backend == "fsdp" and self.dp.size > 1
        # The modules the training forward runs through: DDP wrappers over the same parameters, or the modules
        # themselves sharded in place (their parameters become shards: the optimizer is made after).
        self.train_model = self._data_parallel(self.model)
        self.train_critic = self._data_parallel(self.critic) if self.critic is not None else None
        params = list(self.model.parameters()) + (list(self.critic.parameters()) if self.critic is not None else [])
        optimizer_class = OPTIMIZERS[t.optimizer]
        self.optimizer = optimizer_class(
            params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay,
            fused=self.device.type in FUSED_OPTIMIZER_DEVICES or None,
        )
        schedule = lr_schedule(cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: schedule.learning_rate(step) / schedule.lr)

    # -- forward passes -----------------------------------------------------------------------------------------
    def _forward(self, model: nn.Module, rows: list[list[Sample]], with_entropy: bool,
                 with_moe_aux_loss: bool = False,
                 routing: RoutingPass | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Flat response log-probs of the samples of `rows` (one padded batch of rows, each a prompt and the
        responses sharing it: vime_engine.train.forward_rows), if asked the sampling distribution's entropy there,
        and if asked the router's load-balancing loss over the rows' tokens (`_moe_aux_loss`); with `routing`, the
        policy's routers replay its records and it keeps what they chose. The LM head runs only on the positions
        whose logits predict a response token (`_head_at`), and log-probs and entropy come chunk by chunk over the
        tokens (vime_engine.algorithms.token_log_probs)."""
        layout = build_forward_rows(rows, self.device)
        hf_model = self.model if model is self.train_model else model  # the policy under its DDP wrapper
        router_logits: list[Tensor] = []
        with contextlib.ExitStack() as hooks:
            hooks.enter_context(_head_at(hf_model, layout.flat_predictors))
            if routing is not None:
                hooks.enter_context(routing.applied(self.model, layout))
            if with_moe_aux_loss:
                hooks.enter_context(_recording_router_logits(self.model, router_logits))
            attention = {"sample_attention": sample_attention_layout(layout)} if self.sample_attention else {}
            logits = model(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                           position_ids=layout.position_ids, use_cache=False, **attention).logits
        aux = self._moe_aux_loss(tuple(router_logits), layout.tokens) if with_moe_aux_loss else None
        temperature = self.cfg.rollout.rollout_temperature
        log_probs, entropy = token_log_probs_and_entropy(logits.flatten(0, 1),
                                                         layout.input_ids[layout.token_rows, layout.targets],
                                                         temperature, with_entropy)
        return log_probs, entropy, aux

    def _moe_aux_loss(self, router_logits: tuple[Tensor, ...], tokens: Tensor) -> Tensor:
        """The Switch Transformer load-balancing loss of a mixture-of-experts model, HF's `aux_loss`
        (`load_balancing_loss_func`: experts × Σ_e (share of top-k choices routed to e) × (mean router probability
        of e), over every layer's router and the forward's tokens, padding excluded: top-k when perfectly balanced,
        the number of experts when top-k of them take every token).
        HF's model computes it (`output_router_logits=True`) from a [rows, length] attention mask and fails on the
        4-D one of shared-prompt rows, so the routers' logits are recorded and the rows' token mask given instead."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        config = self.model.config
        return load_balancing_loss_func(router_logits, config.num_experts, config.num_experts_per_tok, tokens)

    def _values(self, rows: list[list[Sample]], critic: nn.Module | None = None) -> Tensor:
        """The critic's values at the response tokens of the samples of `rows`, one sample per padded row."""
        samples = [s for row in rows for s in row]
        input_ids, attention_mask = _pad([s.prompt_tokens + s.response_tokens for s in samples], self.device)
        values = (critic or self.critic)(input_ids, attention_mask)
        positions = _response_positions(samples, self.device)
        rows_of_tokens = torch.repeat_interleave(
            torch.arange(len(samples), device=self.device),
            torch.tensor([s.response_length for s in samples], device=self.device),
        )
        return values[rows_of_tokens, positions - 1]

    @torch.no_grad()
    def _batched(self, fn, samples: list[Sample], sizes: list[list[int]] | None = None) -> list[Tensor]:
        """`fn` over micro-batches of this rank's share of `samples`, gathered on every rank into all samples' flat
        values. `fn(rows, indices)` gets the rows of samples and their indices in `samples` (row order) and returns
        one flat tensor per kind of value, the samples' pieces in row order: `sizes[k][i]` values of kind k for
        sample i (default: one kind, a value per response token)."""
        sizes = sizes or [[s.response_length for s in samples]]
        share = self.dp.share(list(range(len(samples))))
        mine = [samples[i] for i in share]
        pieces: list[dict[int, Tensor]] = [{} for _ in sizes]
        for mb in self._micro_batches(mine):  # packed micro-batches are not in sample order: put each piece back
            if not mb:  # this rank's share ran out; the others' sharded forwards still need it
                fn([samples[:1]], [0])
                continue
            order = [i for row in mb for i in row]
            values = fn([[mine[i] for i in row] for row in mb], [share[i] for i in order])
            for kind, flat in enumerate(values):
                pieces[kind].update(zip(order, torch.split(flat, [sizes[kind][share[i]] for i in order])))
        return [self.dp.gather_per_sample(torch.cat([got[i] for i in range(len(mine))]), kind_sizes)
                for got, kind_sizes in zip(pieces, sizes)]

    def log_probs(self, samples: list[Sample]) -> Tensor:
        """Current policy's flat response log-probs (no gradient)."""
        return self._batched(lambda mb, _: self._forward(self.model, mb, with_entropy=False)[:1], samples)[0]

    def _old_policy(self, samples: list[Sample], records: list[Tensor] | None) -> tuple[Tensor, list[Tensor] | None]:
        """The old log-probs (no gradient) and the routing the training forwards replay: the rollout's `records`,
        replayed here too (R3), or this forward's own routing, recorded (R2), or None."""
        if self.routing_replay != "old_policy":
            def old(rows, indices):
                routing = None if records is None else RoutingPass([records[i] for i in indices])
                return self._forward(self.model, rows, with_entropy=False, routing=routing)[:1]

            return self._batched(old, samples)[0], records

        def recorded(rows, _):
            routing = RoutingPass()
            log_probs = self._forward(self.model, rows, with_entropy=False, routing=routing)[0]
            return log_probs, torch.cat([record.flatten() for record in routing.records()])

        config = self.model.config
        shape = (config.num_hidden_layers, config.num_experts_per_tok)
        routed = [(s.total_length - 1) * math.prod(shape) for s in samples]
        log_probs, flat = self._batched(recorded, samples, [[s.response_length for s in samples], routed])
        return log_probs, [piece.view(-1, *shape) for piece in torch.split(flat, routed)]

    def _rollout_records(self, samples: list[Sample]) -> list[Tensor] | None:
        """Each sample's engine routing, checked (R3); None otherwise."""
        if self.routing_replay != "rollout":
            return None
        c = self.model.config
        return [rollout_record(s, c.num_hidden_layers, c.num_experts_per_tok, c.num_experts) for s in samples]

    def _micro_batches(self, samples: list[Sample]) -> list[list[list[int]]]:
        """The micro-batches of this rank's `samples`, each a list of forward rows of sample indices (samples with
        the same prompt share a row where that saves work); sharded, as many on every rank (some maybe empty)."""
        plan = plan_shared_prompt_micro_batches(
            self.cfg.train, [s.prompt_tokens for s in samples], [s.response_length for s in samples],
            self.derived_max_tokens, self.micro_batch_fixed_tokens, self.attention_pair_cost)
        return split_to_count(plan, self.dp.max_over_ranks(len(plan))) if self.sharded else plan

    # -- one rollout's training ---------------------------------------------------------------------------------
    def train_rollout(self, samples: list[Sample]) -> dict[str, float]:
        """Advantages for the whole rollout, then one optimizer step per global batch; averaged metrics. Under
        routing replay every training forward replays `routes` (the rollout's, or the old-policy forward's)."""
        old_lp, routes = None, self._rollout_records(samples)
        if not old_log_probs_from_training_forward(self.cfg, len(samples)):
            old_lp, routes = self._old_policy(samples, routes)
        ref_lp = None
        if self.ref_model is not None:
            ref_lp = self._batched(lambda mb, _: self._forward(self.ref_model, mb, with_entropy=False)[:1],
                                   samples)[0]
        old_values = self._batched(lambda mb, _: (self._values(mb),), samples)[0] if self.critic is not None else None
        rollout = build_rollout_batch(self.cfg, samples, old_lp, ref_lp, old_values, device=self.device)
        steps = global_batches(len(samples), self.cfg.global_batch_size)
        totals: dict[str, float] = {}
        for step in steps:
            for key, value in self._optimizer_step(samples, step, rollout, routes).items():
                totals[key] = totals.get(key, 0.0) + value / len(steps)
        totals["train/lr"] = self.scheduler.get_last_lr()[0]
        return match_share(totals) if routes is not None else totals

    def _optimizer_step(self, samples: list[Sample], step: list[int], rollout: RolloutBatch,
                        routes: list[Tensor] | None = None) -> dict[str, float]:
        local = (self.dp.balanced_share(step, [s.total_length for s in samples]) if self.cfg.train.balance_data
                 else self.dp.share(step))
        local_samples = [samples[i] for i in local]
        global_tokens, global_samples = max(rollout.num_tokens(step), 1), len(step)
        metrics: dict[str, float] = {} if routes is None else {ROUTES_MATCHED: 0.0, ROUTES_REPLAYED: 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        micro_batches = self._micro_batches(local_samples)
        for n, mb in enumerate(micro_batches):
            # Gradients are reduced once, in the step's last backward; earlier ones only accumulate.
            with self._no_grad_sync(last=n == len(micro_batches) - 1):
                if not mb:  # this rank's share ran out: it joins the others' sharded passes, adding nothing
                    self._zero_backward(samples[step[0]])
                    continue
                rows = [[local_samples[i] for i in row] for row in mb]
                order = [local[i] for row in mb for i in row]
                routing = None if routes is None else RoutingPass([routes[i] for i in order])
                log_probs, entropy, moe_aux_loss = self._forward(self.train_model, rows, with_entropy=True,
                                                                 with_moe_aux_loss=self.moe_aux_loss, routing=routing)
                values = self._values(rows, self.train_critic) if self.critic is not None else None
                loss, mb_metrics = micro_batch_loss(
                    self.cfg, MicroBatchOutputs(log_probs, entropy, values, moe_aux_loss), rollout.targets(order),
                    global_tokens, global_samples,
                )
                if routing is not None:
                    mb_metrics.update({ROUTES_MATCHED: routing.matched, ROUTES_REPLAYED: routing.replayed})
                (loss * self.dp.size).backward()  # gradients are averaged over ranks; the global denominators did
            for key, value in mb_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        metrics = self.dp.sum_metrics(metrics)
        max_norm = self.cfg.train.clip_grad if self.cfg.train.clip_grad > 0 else math.inf
        metrics["train/grad_norm"] = whole(torch.nn.utils.clip_grad_norm_(self._optimized(), max_norm)).item()
        self.optimizer.step()
        self.scheduler.step()
        return metrics

    def _zero_backward(self, stand_in: Sample) -> None:
        """A forward and backward through every trained module whose gradient is zero."""
        log_probs, _, _ = self._forward(self.train_model, [[stand_in]], with_entropy=False)
        loss = log_probs.sum()
        if self.critic is not None:
            loss = loss + self._values([[stand_in]], self.train_critic).sum()
        (loss * 0.0).backward()

    @contextlib.contextmanager
    def _no_grad_sync(self, last: bool) -> Iterator[None]:
        modules = [m for m in (self.train_model, self.train_critic) if m is not None]
        with contextlib.ExitStack() as stack:
            for module in modules if not last else []:
                if isinstance(module, nn.parallel.DistributedDataParallel):
                    stack.enter_context(module.no_sync())
                elif self.sharded:
                    module.set_requires_gradient_sync(False)
                    stack.callback(module.set_requires_gradient_sync, True)
            yield

    # -- weights out --------------------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The policy's weights in HF names; `lm_head.weight` always included (vLLM needs it even when tied)."""
        state = self.model.state_dict()
        if "lm_head.weight" not in state:
            state["lm_head.weight"] = self.model.get_output_embeddings().weight
        for name, tensor in state.items():
            yield name, whole(tensor).detach()

    def save_hf(self, directory: str | Path, tokenizer_from: str | None = None) -> Path:
        from transformers import AutoTokenizer

        directory = Path(directory)
        weights = self._whole_state(self.model)
        if self.dp.rank != 0:
            return directory
        self.model.save_pretrained(directory, state_dict=weights, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_from or self.cfg.model.hf_checkpoint).save_pretrained(directory)
        return directory

    # -- resumable state ----------------------------------------------------------------------------------------
    def save_state(self, directory: str | Path) -> dict[str, FileEntry]:
        """Weights and the optimizer/critic tensors as safetensors, the small rest (param groups, scheduler, RNG)
        pickled beside them; returns the digests computed while writing, so the manifest needs no re-read."""
        directory = Path(directory)
        weights = self._whole_state(self.model)
        trainer = {
            "optimizer": gathered(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "critic": self._whole_state(self.critic) if self.critic is not None else None,
        }
        if self.dp.rank != 0:  # rank 0 holds the whole state now
            return {}
        skeleton, tensors = split_tensors(trainer)
        digests = {
            MODEL_FILE: write_tensors(directory / MODEL_FILE, weights, {"format": "pt"}),
            TRAINER_TENSORS_FILE: write_tensors(directory / TRAINER_TENSORS_FILE, tensors),
        }
        torch.save({"skeleton": skeleton, "rng": capture_rng_state()}, directory / TRAINER_STATE_FILE)
        return digests

    def load_state(self, directory: str | Path, expected: Mapping[str, FileEntry]) -> None:
        """Load what `save_state` wrote; each file's sha256 is checked against `expected` while it is read."""
        directory = Path(directory)
        weights = read_tensors(directory / MODEL_FILE, expected[MODEL_FILE])
        tensors = read_tensors(directory / TRAINER_TENSORS_FILE, expected[TRAINER_TENSORS_FILE])
        rest = torch.load(io.BytesIO(read_verified(directory / TRAINER_STATE_FILE, expected[TRAINER_STATE_FILE])),
                          weights_only=False)
        self._take_weights(directory, weights)
        state = join_tensors(rest["skeleton"], tensors)
        self.optimizer.load_state_dict(sharded_optimizer_state(state["optimizer"], self._optimized()))
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            self.critic.load_state_dict(self._sharded_like(self.critic, state["critic"]))
        restore_rng_state(rest["rng"])

    def load_weights(self, directory: str | Path, expected: Mapping[str, FileEntry]) -> None:
        """The policy's weights alone of what `save_state` wrote (checked as they are read), for an export: the
        optimizer's moments, twice the weights' size, stay on disk."""
        directory = Path(directory)
        self._take_weights(directory, read_tensors(directory / MODEL_FILE, expected[MODEL_FILE]))

    def _take_weights(self, directory: Path, weights: dict[str, Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(self._sharded_like(self.model, weights), strict=False)
        if unexpected or set(missing) - _tied_names(self.model):
            # Not a corrupt file (those fail their sha256 above): a checkpoint of another model. Stop, do not
            # fall back to an older checkpoint of that same other model.
            raise RuntimeError(f"{directory / MODEL_FILE}: does not hold this model's weights "
                               f"(missing {missing[:3]}, unexpected {unexpected[:3]})")

    # -- layouts ------------------------------------------------------------------------------------------------
    def _optimized(self) -> list[nn.Parameter]:
        """The optimizer's parameters in its state dict's numbering (param-group order)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _data_parallel(self, module: nn.Module) -> nn.Module:
        if self.dp.size == 1:
            return module
        if self.sharded:
            return shard_model(module, self.device.type, self.dp.size)
        return nn.parallel.DistributedDataParallel(module)

    @staticmethod
    def _whole_state(module: nn.Module) -> dict[str, Tensor]:
        """`module`'s weights as whole tensors (collective when sharded), each tied weight once."""
        tied = _tied_names(module)
        return {name: whole(t) for name, t in module.state_dict().items() if name not in tied}

    @staticmethod
    def _sharded_like(module: nn.Module, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        local = module.state_dict()
        return {name: sharded_like(t, local[name]) if name in local else t for name, t in weights.items()}


@contextlib.contextmanager
def _head_at(model: nn.Module, positions: Tensor) -> Iterator[None]:
    """While the block runs, `model`'s LM head takes only the hidden states at `positions` of its input rows
    flattened to [rows × length]: the logits come out [1, positions, vocab], in `positions`' order, and the model's
    own steps after the head (a logit scale or soft cap) still apply. The head's products and the [tokens, vocab]
    logits are the log-probs' alone, not the padding's or the prompts'. index_select, not advanced indexing: a
    shared prompt's last position predicts several tokens, and the backward of advanced indexing sums repeated
    indices in an order that depends on the thread count (a run trained on one core and on two would differ);
    index_select's backward adds them in index order."""
    def select(_head: nn.Module, args: tuple) -> tuple:
        hidden, *rest = args
        return (hidden.flatten(0, 1).index_select(0, positions).unsqueeze(0), *rest)

    hook = model.get_output_embeddings().register_forward_pre_hook(select)
    try:
        yield
    finally:
        hook.remove()


@contextlib.contextmanager
def _recording_router_logits(model: nn.Module, into: list[Tensor]) -> Iterator[None]:
    """Append each router's logits ([tokens, experts], layer by layer) to `into` while the block runs: the modules
    and output index HF's MoE model declares for `output_router_logits` (its `_can_record_outputs`)."""
    recorder = model._can_record_outputs["router_logits"]
    hooks = [m.register_forward_hook(lambda _m, _in, out: into.append(out[recorder.index]))
             for m in model.modules() if isinstance(m, recorder.target_class)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _tied_names(module: nn.Module) -> set[str]:
    """Names of parameters that are an earlier name's parameter (tied embeddings): saved once."""
    first: dict[int, str] = {}
    tied = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.add(name)
        first.setdefault(id(param), name)
    return tied


def capture_rng_state() -> dict:
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _pad(sequences: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    longest = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention_mask[row, : len(seq)] = 1
    return input_ids.to(device), attention_mask.to(device)


def _response_positions(samples: list[Sample], device: torch.device) -> Tensor:
    return torch.cat(
        [torch.arange(len(s.prompt_tokens), s.total_length) for s in samples]
    ).to(device)
