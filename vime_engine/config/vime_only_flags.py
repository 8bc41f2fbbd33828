"""vime's flags that are no field of EngineConfig: each is refused with the reason, or accepted only at the one value
that names what this engine does anyway (vime's default there), so a vime launch script's flags are never ignored.

The flags come from vime's dense launch scripts for the families built here (scripts/run-qwen3-4B*.sh with their
NPU variants, run-qwen3-32B.sh, run-qwen3-8B-amd.sh, run-qwen2.5-*.sh); tests/unit/test_every_flag_acts.py holds
that list as data and checks each flag acts or is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vime_engine.config.errors import ConfigError
from vime_engine.config.switches import switch_value


@dataclass(frozen=True)
class VimeOnlyFlag:
    kind: type  # bool: a switch; str: takes a value
    reason: str  # why the engine does not take it (and what to use instead)
    runs_at: str | None = None  # the one value accepted: what the engine does anyway
    secret: bool = False  # its value is never repeated in a message


_WEIGHT_SYNC = ("the weights reach vLLM through its own reload, from Ray's object store or a collective broadcast "
                "(--weight-sync object_store | broadcast) or, in server mode, the server's control endpoint")
_DISK_SYNC = (f"vime's disk weight sync (a checkpoint on a shared file system per sync) is not built: {_WEIGHT_SYNC}; "
              "drop the flag")
_DIST_OPTIMIZER = ("needs Megatron's distributed optimizer (--use-distributed-optimizer), which the Megatron backend "
                   "does not build: each data-parallel rank keeps its whole optimizer state; drop the flag")

VIME_ONLY_FLAGS: dict[str, VimeOnlyFlag] = {
    "rollout-backend": VimeOnlyFlag(str, "this engine generates with vLLM only (SGLang is not built)", runs_at="vllm"),
    "update-weight-mode": VimeOnlyFlag(
        str, "every sync sends the full weights; vime's delta sync is not built (vime disables it too)",
        runs_at="full"),
    "update-weights-interval": VimeOnlyFlag(
        str, "the weights reach the engines after every rollout's training (vime's train_async.py interval 1)",
        runs_at="1"),
    "vllm-weight-sync-mode": VimeOnlyFlag(
        str, f"vime's choice of how its vLLM servers take new weights (removed in later vime): {_WEIGHT_SYNC}; "
        "drop the flag"),
    "update-weight-transport": VimeOnlyFlag(str, _DISK_SYNC),
    "update-weight-disk-dir": VimeOnlyFlag(str, _DISK_SYNC),
    "update-weight-local-checkpoint-dir": VimeOnlyFlag(str, _DISK_SYNC),
    "update-weight-delta-encoding": VimeOnlyFlag(str, _DISK_SYNC),
    "update-weight-delta-checksum": VimeOnlyFlag(str, _DISK_SYNC),
    "no-load-optim": VimeOnlyFlag(
        bool, "a resume here restores the optimizer with the weights, so that it equals a run never stopped; to "
        "start from weights alone give them as --ref-load (a converted torch_dist) or --hf-checkpoint with a fresh "
        "--save"),
    "optimizer-cpu-offload": VimeOnlyFlag(bool, _DIST_OPTIMIZER),
    "overlap-cpu-optimizer-d2h-h2d": VimeOnlyFlag(bool, _DIST_OPTIMIZER),
    "use-precision-aware-optimizer": VimeOnlyFlag(bool, _DIST_OPTIMIZER),
    "wandb-key": VimeOnlyFlag(
        str, "a key on the command line lands in the checkpoint's config and the process list: give it as "
        "WANDB_API_KEY in the environment (or `wandb login`)", secret=True),
    "deterministic-mode": VimeOnlyFlag(
        bool, "Megatron's deterministic mode (fixed NCCL / HCCL algorithms and kernels) is not passed on; on CPU the "
        "trainers are bitwise deterministic without it (a resumed run equals one never stopped); drop the flag"),
    "vllm-enable-deterministic-inference": VimeOnlyFlag(
        bool, "every sample already draws from its own seed and, on CPU, a request's tokens do not depend on its "
        "batch; vLLM's batch-invariant kernels on accelerators (VLLM_BATCH_INVARIANT) are not wired up; drop the "
        "flag"),
    "custom-tis-function-path": VimeOnlyFlag(
        str, "vime's TIS / rejection-sampling hook (its mismatch helper) is not called here; --use-tis with "
        "--tis-clip weights the loss by the clipped train / rollout probability ratio"),
    "custom-config-path": VimeOnlyFlag(
        str, "a YAML of extra `args` for vime's custom functions; give the engine's flags in --config instead"),
    "num-epoch": VimeOnlyFlag(
        str, "vime ignores it beside --num-rollout and derives the rollout count from it otherwise; give "
        "--num-rollout (epochs × prompts / --rollout-batch-size)"),
}


def check_vime_only(name: str, value: Any) -> None:
    """ConfigError naming `--name`, its value and the reason, unless `value` is the one the engine runs at."""
    flag = VIME_ONLY_FLAGS[name]
    if flag.runs_at is not None and str(value).strip().lower() == flag.runs_at:
        return
    given = "" if flag.secret or (flag.kind is bool and switch_value(value) is True) else f" {value}"
    accepted = f" (only {flag.runs_at} is accepted)" if flag.runs_at is not None else ""
    raise ConfigError(f"--{name}{given}: {flag.reason}{accepted}")
