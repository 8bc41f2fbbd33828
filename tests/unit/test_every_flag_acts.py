"""Every flag acts: each EngineConfig field (and Megatron pass-through flag) is read by code outside the config
package (vime_engine/config/, its rules in checks.py included), or is refused when set, or only feeds a derived value
that is read. A field nobody reads is a flag that tells a user their setting took effect when it did not.

Reads are found in the source of vime_engine/, tasks/ and flows/ (the config package excluded):
`<section>.<field>` (`cfg.train.lr`), `<alias>.<field>` where `<alias> = <something>.<section>` (`t = cfg.train;
t.lr`, `e, r = cfg.eval, cfg.rollout`), the field's name quoted (flat dicts, `flags.get("…")`), and for Megatron flags
the quoted flag name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vime_engine.config import MEGATRON_FLAGS, SECTIONS, ConfigError, build_config
from vime_engine.config.sections import FIELD_SECTION
from vime_engine.config.vime_only_flags import VIME_ONLY_FLAGS

REPO = Path(__file__).resolve().parents[2]
REQUIRED = {"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"}

# Fields read only through a derived value of EngineConfig, which is then read outside the config package.
DERIVED = {"num_steps_per_rollout": "global_batch_size", "global_batch_size": "global_batch_size",
           "eps_clip_high": "eps_clip_high", "rollout_num_gpus": "rollout_engines"}
# Fields that cannot act yet and are refused when set (flag value that must raise ConfigError, and why).
REFUSED: dict[str, tuple[list[str], str]] = {}

# vime's whole-rollout functions drive vime's own HTTP rollout servers, which this engine does not run.
REFUSED.update({
    "rollout_function_path": (["--rollout-function-path", "mine.py:generate_rollout"], "needs vime's servers"),
    "eval_function_path": (["--eval-function-path", "mine.py:generate_rollout"], "needs vime's servers"),
})


def _source() -> str:
    files = [p for d in ("vime_engine", "tasks", "flows") for p in (REPO / d).rglob("*.py")]
    config = REPO / "vime_engine" / "config"
    return "\n".join(p.read_text() for p in files if config not in p.parents)


SOURCE = _source()


def _aliases(section: str) -> set[str]:
    """Names bound to a section: `t = cfg.train`, `e, r = cfg.eval, cfg.rollout`."""
    names = {section}
    for lhs, rhs in re.findall(r"^\s*(\w+(?:, \w+)*) = ([\w.]+(?:, [\w.]+)*)\s*$", SOURCE, re.M):
        names |= {name for name, expr in zip(lhs.split(", "), rhs.split(", ")) if expr.endswith(f".{section}")}
    return names


def _read(section: str, field: str) -> bool:
    aliases = _aliases(section)
    attribute = any(re.search(rf"\b{alias}\.{field}\b", SOURCE) for alias in aliases)
    return attribute or f'"{field}"' in SOURCE


FIELDS = [(section, field) for section, model in SECTIONS.items() for field in model.model_fields]


@pytest.mark.parametrize("section, field", FIELDS, ids=[f for _, f in FIELDS])
def test_every_engine_field_is_read_outside_config(section, field):
    if field in REFUSED:
        flags, why = REFUSED[field]
        with pytest.raises(ConfigError):
            build_config(flags, **REQUIRED)
        return
    if field in DERIVED:
        assert re.search(rf"\.{DERIVED[field]}\b", SOURCE), f"--{field} feeds {DERIVED[field]}, which nobody reads"
        return
    flag = field.replace("_", "-")
    assert _read(section, field), f"--{flag} is parsed but no code outside vime_engine/config/ reads it"


@pytest.mark.parametrize("flag", sorted(MEGATRON_FLAGS))
def test_every_megatron_flag_reaches_the_megatron_backend(flag):
    assert f'"{flag}"' in SOURCE, f"--{flag} is accepted but neither the config's checks nor the backend read it"


# Every flag vime's launch scripts set for the families built here (github:vllm-project/vime, scripts/), as data we
# keep: the dense GPU and Ascend NPU runs of Qwen3 and Qwen2.5 and the model scripts of Qwen3, Qwen2.5 and Llama 3.
# (The MoE scripts' --num-experts / --moe-* flags belong to the MoE issue.)
QWEN3_4B_MODEL = ("swiglu num-layers hidden-size ffn-hidden-size num-attention-heads group-query-attention "
                  "num-query-groups use-rotary-position-embeddings disable-bias-linear normalization norm-epsilon "
                  "rotary-base vocab-size kv-channels qk-layernorm")
VIME_SCRIPTS = {
    "models/qwen3-4B.sh": QWEN3_4B_MODEL,
    "models/qwen2.5-{0.5B,7B}.sh": QWEN3_4B_MODEL + " add-qkv-bias untie-embeddings-and-output-weights",
    "models/llama3.1-8B-Instruct.sh": QWEN3_4B_MODEL + " max-position-embeddings use-rope-scaling "
                                      "rotary-scaling-factor untie-embeddings-and-output-weights",
    "run-qwen3-4B.sh": (
        "train-backend actor-num-nodes actor-num-gpus-per-node colocate hf-checkpoint ref-load load save "
        "save-interval prompt-data input-key label-key apply-chat-template rollout-shuffle rm-type num-rollout "
        "rollout-batch-size n-samples-per-prompt rollout-max-response-len rollout-temperature global-batch-size "
        "balance-data eval-interval eval-prompt-data n-samples-per-eval-prompt eval-max-response-len eval-top-p "
        "tensor-model-parallel-size sequence-parallel pipeline-model-parallel-size context-parallel-size "
        "expert-model-parallel-size expert-tensor-parallel-size recompute-granularity recompute-method "
        "recompute-num-layers use-dynamic-batch-size max-tokens-per-gpu advantage-estimator use-kl-loss "
        "kl-loss-coef kl-loss-type entropy-coef eps-clip eps-clip-high optimizer lr lr-decay-style weight-decay "
        "adam-beta1 adam-beta2 rollout-num-gpus-per-engine vllm-gpu-memory-utilization attention-dropout "
        "hidden-dropout accumulate-allreduce-grads-in-fp32 attention-softmax-in-fp32 attention-backend "
        "train-memory-margin-bytes"),
    # run-qwen3-4B-npu.sh and run-qwen3-4B-npu-ray.sh (Ascend, ray job submit), models/qwen3-4B_npu.sh (python
    # train.py on Ascend), run-qwen3-4B-multi-agent-npu.sh: beyond run-qwen3-4B.sh's
    "run-qwen3-4B-npu*.sh": (
        "rollout-num-gpus no-load-optim megatron-to-hf-mode vllm-max-model-len kl-coef optimizer-cpu-offload "
        "overlap-cpu-optimizer-d2h-h2d use-precision-aware-optimizer vllm-weight-sync-mode vllm-enable-sleep-mode "
        "micro-batch-size use-flash-attn rollout-backend custom-generate-function-path vllm-enforce-eager "
        "rollout-max-context-len"),
    # run-qwen3-4B-disk-common.sh (Ascend, with -delta-disk / -full-disk) and run-weight-sync-benchmark-npu.sh
    "run-qwen3-4B-*disk*.sh": (
        "update-weight-mode update-weight-transport update-weight-disk-dir update-weight-local-checkpoint-dir "
        "update-weight-delta-encoding update-weight-delta-checksum"),
    "run-qwen3-32B.sh": "vllm-cudagraph-capture-sizes",
    "run-qwen3-8B-amd.sh": ("use-wandb wandb-project wandb-group wandb-key wandb-mode no-gradient-accumulation-fusion "
                            "no-offload-train"),
    "run-qwen2.5-0.5B-reproducibility.sh": (
        "calculate-per-token-loss eval-top-k wandb-host wandb-team vllm-enable-deterministic-inference "
        "vllm-attention-backend deterministic-mode"),
    "run-qwen2.5-3B-ai21-{regression-v2,async}.sh": (
        "metadata-key custom-rm-path dynamic-sampling-filter-path over-sampling-batch-size "
        "rollout-all-samples-process-path custom-rollout-log-function-path rollout-function-path eval-function-path "
        "num-epoch rollout-max-prompt-len rollout-top-k eval-temperature eps-clip-c use-tis custom-tis-function-path "
        "custom-config-path clip-grad vllm-max-num-batched-tokens vllm-max-num-seqs vllm-enable-prefix-caching "
        "update-weights-interval"),
}
SCRIPT_FLAGS = sorted({flag for flags in VIME_SCRIPTS.values() for flag in flags.split()})


@pytest.mark.parametrize("flag", SCRIPT_FLAGS)
def test_every_flag_of_vimes_scripts_acts_or_is_refused_with_a_reason(flag):
    """A field or Megatron flag (each read by code: the tests above), or one of vime's flags this engine refuses, or
    takes only at the value it runs at (vime_engine/config/vime_only_flags.py); never unknown, never ignored."""
    if flag in VIME_ONLY_FLAGS:
        return  # the test below
    assert flag.replace("-", "_") in FIELD_SECTION or flag in MEGATRON_FLAGS, f"--{flag} is neither read nor refused"


@pytest.mark.parametrize("flag", sorted(VIME_ONLY_FLAGS))
def test_vimes_flags_without_a_field_are_refused_naming_the_reason(flag):
    spec = VIME_ONLY_FLAGS[flag]
    argv = [f"--{flag}"] + ([] if spec.kind is bool else ["something-else"])
    with pytest.raises(ConfigError) as refused:
        build_config(argv, **REQUIRED)
    message = str(refused.value)
    assert message.startswith(f"--{flag}") and spec.reason in message
    if spec.runs_at is not None:  # the value the engine runs at names what it does anyway
        build_config([f"--{flag}", spec.runs_at], **REQUIRED)
    if spec.secret:
        assert "something-else" not in message
