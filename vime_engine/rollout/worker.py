"""RolloutWorker: prompts in, rewarded Samples out. Runs inside a Ray actor (or beside the trainer).

Generation is a stream of rounds: `begin` a round (partial groups to continue, then fresh prompts),
`advance` it until more groups have finished, and `abort` what still runs (partial rollout), or run it to
the end (`generate`). Randomness is pinned per group: sample j of group g generated in rollout r draws from
seed `group_seed(rollout seed, namespace, r, g) + j`, so a rollout generated again after a resume draws
exactly the same samples.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vime_engine.config import EngineConfig
from vime_engine.data.chat import render_prompt
from vime_engine.data.records import PromptRecord
from vime_engine.devices.host_memory import release_free_heap
from vime_engine.plugins.boundary import user_functions_in
from vime_engine.rewards import BatchRewardFn, RewardInput, extract_answer, get_batch_reward, run_reward
from vime_engine.rollout.custom_generate import CustomRound, EngineClient, load_generate_function
from vime_engine.rollout.partial import continuation, extend
from vime_engine.rollout.server.router_engine import RouterEngine
from vime_engine.rollout.vllm_engine import (
    Completion, DeviceTuning, EngineSettings, Request, SamplingSettings, VLLMEngine,
)
from vime_engine.sample import Sample, SampleStatus

if TYPE_CHECKING:  # annotations only: the driver imports this module for its generation plans
    import torch


@dataclass(frozen=True)
class GenerationPlan:
    """What to generate: the sampling settings and how many samples per prompt."""

    sampling: SamplingSettings
    n_samples: int
    seed_namespace: str  # "train" or "eval/NAME": keeps eval draws independent of training draws
    rm_type: str | None = None  # None: the run's reward (--rm-type / --custom-rm-path)


def group_seed(rollout_seed: int, namespace: str, rollout_id: int, index: int) -> int:
    digest = hashlib.sha256(f"{rollout_seed}/{namespace}/{rollout_id}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def train_plan(cfg: EngineConfig) -> GenerationPlan:
    r = cfg.rollout
    return GenerationPlan(
        SamplingSettings(r.rollout_max_response_len, r.rollout_temperature, r.rollout_top_p, r.rollout_top_k),
        r.n_samples_per_prompt,
        "train",
    )


def engine_settings(cfg: EngineConfig, kv_cache_bytes: int | None) -> EngineSettings:
    r = cfg.rollout

    def given(value):  # "auto" leaves the choice to the device (device_engine_kwargs)
        return None if value == "auto" else value

    spread_over_ranks = cfg.placement.colocate is True and r.rollout_num_gpus_per_engine > 1
    return EngineSettings(
        model_path=cfg.model.hf_checkpoint, dtype=cfg.model.dtype, max_model_len=r.vllm_max_model_len,
        seed=cfg.data.rollout_seed, kv_cache_bytes=kv_cache_bytes,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization, tensor_parallel_size=r.rollout_num_gpus_per_engine,
        distributed_executor_backend="external_launcher" if spread_over_ranks else None,
        enable_sleep_mode=cfg.placement.colocate is True,
        max_num_seqs=r.vllm_max_num_seqs, attention_backend=r.vllm_attention_backend,
        return_routed_experts=cfg.algorithm.use_rollout_routing_replay,
        tuning=DeviceTuning(
            enforce_eager=given(r.vllm_enforce_eager), enable_prefix_caching=given(r.vllm_enable_prefix_caching),
            enable_chunked_prefill=given(r.vllm_enable_chunked_prefill),
            max_num_batched_tokens=given(r.vllm_max_num_batched_tokens),
            cudagraph_capture_sizes=(tuple(r.vllm_cudagraph_capture_sizes)
                                     if r.vllm_cudagraph_capture_sizes is not None else None),
        ),
    )


@dataclass
class _Round:
    """The open round: how to reward it, and its groups by index (removed as they finish)."""

    rm_type: str
    reward_fn: BatchRewardFn
    groups: dict[int, list[Sample]]
    where: str  # "rollout 3" or "rollout 3, eval/aime": where a user's reward function's error happened


class RolloutWorker:
    """Generates on `engine`: by default an in-process VLLMEngine built from `cfg`; in server mode the servers
    behind the router (vime_engine/rollout/server/router_engine.py), which answer the same calls."""

    def __init__(self, cfg: EngineConfig, kv_cache_bytes: int | None = None,
                 engine: VLLMEngine | RouterEngine | None = None):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
        self.engine = engine or VLLMEngine(engine_settings(cfg, kv_cache_bytes))
        self.reward_fn = run_reward(cfg)
        self._round: _Round | None = None
        r = cfg.rollout
        self._custom: CustomRound | None = None  # the open round of --custom-generate-function-path
        path = r.custom_generate_function_path
        self._generate_fn = load_generate_function(path) if path else None
        if self._generate_fn:
            from vime_engine.plugins.vime_args import vime_args

            self._client = EngineClient(self.engine, r.rollout_temperature, r.rollout_max_context_len, self.tokenizer)
            self._args = vime_args(cfg, rollout_engine=self._client)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def tokenize(self, record: PromptRecord) -> tuple[str, list[int]]:
        text = render_prompt(record, self.tokenizer, self.cfg.data.apply_chat_template)
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def begin(
        self, records: list[PromptRecord], resumed: list[list[Sample]], rollout_id: int, first_group: int,
        plan: GenerationPlan,
    ) -> None:
        """Start a round: the unfinished samples of `resumed` groups first, then a group per record (numbered
        from `first_group`); nothing is generated until `advance`."""
        release_free_heap()  # the last round's activations, of other shapes than this round's (vime_engine.devices.host_memory)
        groups = resumed + [self._new_group(r, first_group + i, plan.n_samples) for i, r in enumerate(records)]
        requests, jobs, s = [], [], plan.sampling
        for group in groups:
            seed = group_seed(self.cfg.data.rollout_seed, plan.seed_namespace, rollout_id, group[0].group_index)
            for j, sample in enumerate(group):
                if not sample.finished and self._generate_fn:  # the function continues a cut-off sample itself
                    # on its own copy: the group's sample counts as unfinished until the function returns
                    jobs.append((f"{sample.group_index}/{j}", copy.deepcopy(sample), {
                        "max_new_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                        "top_k": s.top_k, "sampling_seed": seed + j}))
                elif not sample.finished:
                    prompt, budget = continuation(sample, s.max_tokens)
                    requests.append(Request(f"{sample.group_index}/{j}", prompt, budget, seed + j))
        if self._generate_fn:
            self._client.temperature = s.temperature
            self._custom = CustomRound(self._generate_fn, self._args, self._client, jobs,
                                       self.cfg.rollout.rollout_max_turns)
        else:
            self.engine.submit(requests, s)
        self._round = _Round(
            plan.rm_type or self.cfg.reward.rm_type,
            get_batch_reward(plan.rm_type, rm_url=self.cfg.reward.rm_url) if plan.rm_type else self.reward_fn,
            {group[0].group_index: group for group in groups},
            f"rollout {rollout_id}" + ("" if plan.seed_namespace == "train" else f", {plan.seed_namespace}"),
        )

    def advance(self) -> list[list[Sample]]:
        """Engine steps until at least one more group has finished, or nothing runs; those groups, rewarded,
        by group index."""
        done: list[int] = []
        while not done and self._custom is not None and self._custom.running:
            done += [i for key, sample in self._custom.step() if (i := self._place(key, sample)) is not None]
        while not done and self._custom is None and self.engine.running:
            for c in self.engine.step():
                if (index := self._record(c)) is not None:
                    done.append(index)
        return [self._round.groups.pop(g) for g in sorted(done)]

    def abort(self) -> list[list[Sample]]:
        """Abort what still runs; the unfinished groups with what they have so far (finished samples kept)."""
        if self._custom is not None:
            for key, sample in self._custom.abort():
                self._place(key, sample)
            self._custom = None
        for c in self.engine.abort():
            self._record(c)
        unfinished, self._round = list(self._round.groups.values()), None
        return unfinished

    def generate(
        self, records: list[PromptRecord], rollout_id: int, first_group: int, plan: GenerationPlan
    ) -> list[Sample]:
        """`plan.n_samples` rewarded samples per record, in record order: a round run to the end."""
        self.begin(records, [], rollout_id, first_group, plan)
        groups = []
        while finished := self.advance():
            groups += finished
        return [s for group in sorted(groups, key=lambda g: g[0].group_index) for s in group]

    def _new_group(self, record: PromptRecord, index: int, n: int) -> list[Sample]:
        text, tokens = self.tokenize(record)
        return [
            Sample(group_index=index, prompt=text, label=record.label, prompt_tokens=tokens,
                   status=SampleStatus.ABORTED, metadata=dict(record.metadata))
            for _ in range(n)
        ]

    def _record(self, c: Completion) -> int | None:
        """Fold a completion into its sample; its group's index if that finished (the group then rewarded)."""
        index, j = map(int, c.key.split("/"))
        sample = self._round.groups[index][j]
        return self._place(c.key, extend(sample, c.token_ids, c.log_probs, c.status, self.engine.weight_version,
                                         c.routed_experts))

    def _place(self, key: str, sample: Sample) -> int | None:
        """Put a sample (generated further) in its group; the group's index if that finished (then rewarded)."""
        index, j = map(int, key.split("/"))
        group = self._round.groups[index]
        group[j] = sample
        if not all(s.finished for s in group):
            return None
        self._reward(group)
        return index

    def _reward(self, group: list[Sample]) -> None:
        # The whole group at once: a remote reward sends it as one concurrent wave of requests. Decoded here, not
        # by vLLM, since a continued response spans several requests; decoded as vLLM would (special tokens
        # skipped, spaces left alone).
        for s in group:  # the response is set first: vime's rewards read it from the sample
            s.response = self.tokenizer.decode(s.response_tokens, skip_special_tokens=True,
                                               clean_up_tokenization_spaces=False)
        with user_functions_in(self._round.where):
            rewards = self._round.reward_fn([RewardInput(s.prompt, s.response, s.label, s) for s in group])
        for sample, reward in zip(group, rewards, strict=True):
            sample.reward = float(reward)
            sample.metadata = {**sample.metadata,
                               "extracted_answer": extract_answer(self._round.rm_type, sample.response)}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict, version: int) -> float:
        if isinstance(named_tensors, dict):
            named_tensors = named_tensors.items()
        return self.engine.update_weights(named_tensors, version)
