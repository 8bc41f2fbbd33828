"""RolloutWorker: prompts in, rewarded Samples out. Runs inside a Ray actor (or beside the trainer).

Randomness is pinned per prompt: the seed of a prompt's group is derived from (rollout seed, rollout id,
position in the rollout), so a rollout generated again after a resume draws exactly the same samples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vime_engine.config import EngineConfig
from vime_engine.data.chat import render_prompt
from vime_engine.data.records import PromptRecord
from vime_engine.rewards import extract_answer, get_reward_fn
from vime_engine.rollout.vllm_engine import EngineSettings, SamplingSettings, VLLMEngine
from vime_engine.sample import Sample


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
    return EngineSettings(
        model_path=cfg.model.hf_checkpoint, dtype=cfg.model.dtype, max_model_len=r.vllm_max_model_len,
        seed=cfg.data.rollout_seed, kv_cache_bytes=kv_cache_bytes,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization, tensor_parallel_size=r.rollout_num_gpus_per_engine,
    )


class RolloutWorker:
    def __init__(self, cfg: EngineConfig, kv_cache_bytes: int | None = None):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
        self.engine = VLLMEngine(engine_settings(cfg, kv_cache_bytes))
        self.reward_fn = get_reward_fn(cfg.reward.rm_type, cfg.reward.custom_rm_path)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def tokenize(self, record: PromptRecord) -> tuple[str, list[int]]:
        text = render_prompt(record, self.tokenizer, self.cfg.data.apply_chat_template)
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(
        self, records: list[PromptRecord], rollout_id: int, first_group: int, plan: GenerationPlan
    ) -> list[Sample]:
        """`plan.n_samples` rewarded samples per record; groups numbered from `first_group`."""
        rm_type = plan.rm_type or self.cfg.reward.rm_type
        reward_fn = get_reward_fn(plan.rm_type) if plan.rm_type else self.reward_fn
        prompts = [self.tokenize(r) for r in records]
        seeds = [
            group_seed(self.cfg.data.rollout_seed, plan.seed_namespace, rollout_id, first_group + i)
            for i in range(len(records))
        ]
        groups = self.engine.generate([tokens for _, tokens in prompts], plan.n_samples, plan.sampling, seeds)
        samples = []
        for i, (record, (text, tokens), completions) in enumerate(zip(records, prompts, groups)):
            for c in completions:
                samples.append(
                    Sample(
                        group_index=first_group + i, prompt=text, label=record.label, prompt_tokens=tokens,
                        response_tokens=c.token_ids, response=c.text, rollout_log_probs=c.log_probs,
                        loss_mask=[1] * len(c.token_ids), reward=float(reward_fn(c.text, record.label)),
                        status=c.status, weight_version=self.engine.weight_version,
                        metadata={**record.metadata, "extracted_answer": extract_answer(rm_type, c.text)},
                    )
                )
        return samples

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict, version: int) -> float:
        if isinstance(named_tensors, dict):
            named_tensors = named_tensors.items()
        return self.engine.update_weights(named_tensors, version)
