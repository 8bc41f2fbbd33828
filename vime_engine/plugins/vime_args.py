"""The `args` a vime plugin receives: a read-only namespace with vime's attribute names, built from EngineConfig.

vime (like slime) hands its plugins the whole argparse namespace. Our flags keep vime's names, so every
EngineConfig field is an attribute under its flat name (`args.n_samples_per_prompt`, `args.rm_type`), Megatron
pass-through flags under theirs (`args.tensor_model_parallel_size`), and the few values vime names differently or
derives are added (`grpo_std_normalization`, the resolved `global_batch_size`, ...). Writing to it raises: a
plugin that changed the run's settings would change them in one process only.
"""

from __future__ import annotations

from typing import Any

from vime_engine.config import EngineConfig


class VimeArgs:
    """Read-only attributes; a missing one names itself and where vime's names come from."""

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(
                f"args.{name}: vimeflow has no flag --{name.replace('_', '-')}; plugins see vimeflow's flags under "
                "vime's names (EngineConfig fields, see vime_engine/config/sections.py)"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"args is read-only: a plugin cannot set args.{name}; keep its own state elsewhere")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"args is read-only: a plugin cannot delete args.{name}")

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def __dir__(self) -> list[str]:
        return sorted(self._values)

    def __getstate__(self) -> dict[str, Any]:
        return self._values

    def __setstate__(self, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", values)

    def __repr__(self) -> str:
        return f"VimeArgs({len(self._values)} flags)"


def vime_args(cfg: EngineConfig, **extra: Any) -> VimeArgs:
    """`cfg` as vime's `args`: every field by its flat name, plus the values vime derives or names otherwise, plus
    `extra` (the rollout worker adds `rollout_engine`, see vime_engine/rollout/custom_generate.py)."""
    values = cfg.flat()
    values = {k: v for k, v in values.items() if not k.startswith("megatron.")}
    values.update({flag.replace("-", "_"): value for flag, value in cfg.megatron.items()})
    a = cfg.algorithm
    values.update(
        global_batch_size=cfg.global_batch_size,  # resolved from --num-steps-per-rollout when not given
        eps_clip_high=cfg.eps_clip_high,
        grpo_std_normalization=not a.disable_grpo_std_normalization,
        use_routing_replay=a.use_routing_replay or a.use_rollout_routing_replay,  # vime's: R3 implies R2
        rewards_normalization=True,  # vime's default; our group estimators always normalise
        reward_key=None,  # rewards are floats here; Sample.get_reward_value(args) reads it as vime's does
        rollout_global_dataset=True,
        eval_prompt_data=cfg.eval.eval_prompt_data,
        world_size=cfg.trainer_world_size,
        data_parallel_size=cfg.data_parallel_size,
    )
    values.update(extra)
    return VimeArgs(values)
