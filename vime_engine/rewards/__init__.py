"""Reward functions: `(response: str, label: str) -> float`, chosen by `--rm-type` or loaded
from `--custom-rm-path` (which also takes vime's `async (args, sample)` form, see `custom.py`); `--rm-type
remote_rm` asks a reward server over HTTP instead (`remote.py`)."""

from __future__ import annotations

from vime_engine.config import EngineConfig
from vime_engine.rewards.batch import BatchRewardFn, PerSampleReward, RewardInput
from vime_engine.rewards.boxed import last_boxed_content
from vime_engine.rewards.code import code_reward, extract_code
from vime_engine.rewards.custom import RewardFn, load_custom_reward, load_sample_reward
from vime_engine.rewards.dapo import answer_line, dapo_reward
from vime_engine.rewards.deepscaler import THINK_END, deepscaler_reward
from vime_engine.rewards.gsm8k import final_number, gsm8k_reward
from vime_engine.rewards.math import math_reward
from vime_engine.rewards.remote import RemoteReward, RemoteRewardError
from vime_engine.plugins.vime_args import vime_args

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "gsm8k": gsm8k_reward,
    "dapo": dapo_reward,
    "deepscaler": deepscaler_reward,
    "code": code_reward,
}
REMOTE_RM = "remote_rm"


def get_reward_fn(rm_type: str, custom_rm_path: str | None = None) -> RewardFn:
    """The reward function for a run: the custom one when `custom_rm_path` is given (as in
    vime/slime, it takes precedence over `rm_type`), otherwise the built-in named `rm_type`."""
    if custom_rm_path:
        return load_custom_reward(custom_rm_path)
    try:
        return BUILTIN_REWARDS[rm_type]
    except KeyError:
        raise ValueError(
            f"--rm-type {rm_type!r} is unknown; choose one of {', '.join(BUILTIN_REWARDS)}, {REMOTE_RM} "
            "(with --rm-url) or give your own function with --custom-rm-path"
        ) from None


def get_batch_reward(rm_type: str, custom_rm_path: str | None = None, rm_url: str | None = None) -> BatchRewardFn:
    """The reward of a batch of samples: `remote_rm` asks the reward server at `rm_url` (unless a custom reward
    takes precedence, as in `get_reward_fn`); any other type applies its per-sample function to each."""
    if rm_type == REMOTE_RM and not custom_rm_path:
        if not rm_url:
            raise ValueError(f"--rm-type {REMOTE_RM} needs --rm-url URL (a reward server: `vimeflow reward-server`)")
        return RemoteReward(rm_url)
    return PerSampleReward(get_reward_fn(rm_type, custom_rm_path))


def run_reward(cfg: EngineConfig) -> BatchRewardFn:
    """The training reward of a run (an EngineConfig): `--custom-rm-path` in either form (vime's gets `args`
    built from `cfg`, and with `--group-rm` one call per group), else `--rm-type`."""
    r = cfg.reward
    if r.custom_rm_path:
        return load_sample_reward(r.custom_rm_path, vime_args(cfg), r.group_rm)
    return get_batch_reward(r.rm_type, rm_url=r.rm_url)


def extract_answer(rm_type: str, response: str) -> str | None:
    """The answer a built-in reward grades, for reports; None when it finds none (or for custom rewards)."""
    if rm_type == "code":
        return extract_code(response)
    if rm_type == "gsm8k":
        value = final_number(response)
        return None if value is None else str(value)
    if rm_type == "dapo":
        return answer_line(response)
    if rm_type == "deepscaler":
        _, separator, response = response.rpartition(THINK_END)
        if not separator:
            return None
    if rm_type in ("math", "deepscaler"):
        return last_boxed_content(response)
    return None


__all__ = [
    "BUILTIN_REWARDS", "REMOTE_RM", "BatchRewardFn", "RemoteReward", "RemoteRewardError", "RewardFn", "RewardInput",
    "extract_answer", "get_batch_reward", "get_reward_fn", "run_reward",
]
