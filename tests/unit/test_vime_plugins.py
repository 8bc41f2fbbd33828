"""vime's plugin flags: a plugin file written in vime's signatures (tests/support/vime_plugins.py) runs unchanged
against our own objects (EngineConfig as `args`, our Samples, the real collect loop, reward and advantage code)."""

from __future__ import annotations

import json

import pytest
import torch

from vime_engine.algorithms.advantages import AdvantageInputs, group_normalized_advantages, masked_whiten
from vime_engine.config import ConfigError, build_config, with_overrides
from vime_engine.preflight import PreflightError, preflight
from vime_engine.rewards import RewardInput, run_reward
from vime_engine.rewards.custom import load_sample_reward
from vime_engine.rollout.dynamic_sampling import CarryOver, FinishedRound, collect_groups, load_group_filter
from vime_engine.sample import Sample, SampleStatus
from vime_engine.plugins.vime_args import vime_args
from vime_engine.rollout.vime_hooks import load_rollout_hooks
from vime_engine.train.vime_hooks import load_trainer_hooks

PLUGINS = "tests/support/vime_plugins.py"


def _cfg(tmp_path, **flags):
    return build_config([], **{"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl",
                               "n-samples-per-prompt": 2, "rollout-batch-size": 2,
                               "output-dir": str(tmp_path), **flags})


def _sample(group, tokens, reward=0.0, prompt=(1, 2), status=SampleStatus.COMPLETED):
    return Sample(group_index=group, prompt="p", label="l", prompt_tokens=list(prompt), response_tokens=list(tokens),
                  loss_mask=[1] * len(tokens), reward=reward, status=status)


def _notes(tmp_path, hook):
    path = tmp_path / "vime_plugins.jsonl"
    return [row for row in map(json.loads, path.read_text().splitlines()) if row["hook"] == hook]


# -- args and Sample under vime's names ------------------------------------------------------------------------
def test_args_carry_vime_names_and_are_read_only(tmp_path):
    args = vime_args(_cfg(tmp_path, **{"tensor-model-parallel-size": 1, "disable-grpo-std-normalization": True}))
    assert (args.n_samples_per_prompt, args.rollout_batch_size, args.rm_type) == (2, 2, "math")
    assert args.global_batch_size == 4 and args.tensor_model_parallel_size == 1
    assert args.grpo_std_normalization is False and args.reward_key is None
    assert args.use_routing_replay is False
    r3 = vime_args(_cfg(tmp_path, **{"use-rollout-routing-replay": True}))
    assert r3.use_routing_replay is True and r3.use_rollout_routing_replay is True  # slime's: R3 implies R2
    with pytest.raises(AttributeError, match="read-only"):
        args.rollout_batch_size = 3
    with pytest.raises(AttributeError, match="no flag --sglang-router-ip"):
        _ = args.sglang_router_ip


def test_sample_answers_vime_attribute_names(tmp_path):
    s = _sample(0, [5, 6, 7], reward=0.5)
    s.loss_mask = [1, 0, 1]
    assert s.tokens == [1, 2, 5, 6, 7] and s.response_length == 3 and s.effective_response_length == 2
    assert s.status == Sample.Status.COMPLETED and s.remove_sample is False
    assert s.get_reward_value(vime_args(_cfg(tmp_path))) == 0.5


# -- rewards ---------------------------------------------------------------------------------------------------
def test_async_sample_reward_grades_our_samples(tmp_path):
    reward = run_reward(_cfg(tmp_path, **{"custom-rm-path": f"{PLUGINS}:custom_rm"}))
    group = [_sample(0, [2, 4, 5, 7]), _sample(0, [8]), _sample(0, [])]
    assert reward([RewardInput("p", "", "l", s) for s in group]) == [0.5, 1.0, 0.0]


def test_group_reward_is_called_once_per_group(tmp_path):
    cfg = _cfg(tmp_path, **{"custom-rm-path": f"{PLUGINS}:group_rm", "group-rm": True})
    group = [_sample(0, [1, 1, 1]), _sample(0, [1])]
    assert run_reward(cfg)([RewardInput("p", "", "l", s) for s in group]) == [1.0, 0.0]
    (tmp_path / "short.py").write_text("async def one_reward(args, samples):\n    return [1.0]\n")
    short = load_sample_reward(f"{tmp_path}/short.py:one_reward", vime_args(cfg), group_rm=True)
    with pytest.raises(ValueError, match=r"one_reward returned 1 rewards for 2 samples; return one per sample, in "
                                         r"order \(group 0\)"):
        short([RewardInput("p", "", "l", s) for s in group])


def test_group_reward_refuses_our_text_form_and_group_rm_needs_a_custom_reward(tmp_path):
    (tmp_path / "ours.py").write_text("def ours(response, label):\n    return float(response == label)\n")
    with pytest.raises(ValueError, match=r"--group-rm calls it once per group, as `async \(args, samples"):
        load_sample_reward(f"{tmp_path}/ours.py:ours", None, group_rm=True)
    with pytest.raises(ConfigError, match="--group-rm calls --custom-rm-path once per group"):
        _cfg(tmp_path, **{"group-rm": True})


def test_our_text_reward_still_loads_from_its_signature(tmp_path):
    (tmp_path / "ours.py").write_text("def ours(response, label):\n    return float(response == label)\n")
    reward = load_sample_reward(f"{tmp_path}/ours.py:ours", None)
    assert reward([RewardInput("p", "4", "4"), RewardInput("p", "5", "4")]) == [1.0, 0.0]


# -- the driver's hooks ----------------------------------------------------------------------------------------
def test_vime_dynamic_filter_keeps_spread_groups_and_names_its_drops(tmp_path):
    keep = load_group_filter(f"{PLUGINS}:dynamic_filter", vime_args(_cfg(tmp_path)))
    rounds = [[_sample(0, [1], 1.0), _sample(0, [1], 1.0), _sample(1, [1], 0.0), _sample(1, [1], 1.0)],
              [_sample(2, [1], 0.0), _sample(2, [1], 0.0), _sample(3, [1], 0.2), _sample(3, [1], 0.0)]]
    got = collect_groups(lambda r, resumed: FinishedRound(rounds[r]), wanted=2, keep=keep, carry=CarryOver())
    assert [g[0].group_index for g in got.groups] == [1, 3]
    assert got.drops == {"zero_std_1.0": 1, "zero_std_0.0": 1}
    assert [g[0].group_index for g in got.seen] == [0, 1, 2, 3]


def test_our_one_argument_filter_still_loads(tmp_path):
    (tmp_path / "f.py").write_text("def first_wins(group):\n    return group[0].reward > 0\n")
    keep = load_group_filter(f"{tmp_path}/f.py:first_wins", vime_args(_cfg(tmp_path)))
    assert keep([_sample(0, [1], 1.0)]) is True and keep([_sample(0, [1], 0.0)]) is False


class _Round:
    """A round that finishes every group at once: resumed ones first, then fresh groups 10, 11, ..."""

    def __init__(self, resumed, fresh):
        done = [[_sample(g[0].group_index, [1], float(j)) for j in range(2)] for g in resumed]
        self.groups = done + [[_sample(10 + i, [1], float(j)) for j in range(2)] for i in range(fresh)]

    def advance(self):
        groups, self.groups = self.groups, []
        return groups

    def abort(self):
        return []


def test_buffer_filter_picks_which_cut_off_groups_resume_and_the_rest_wait(tmp_path):
    hooks = load_rollout_hooks(_cfg(tmp_path, **{"buffer-filter-path": f"{PLUGINS}:buffer_filter",
                                                 "partial-rollout": True, "over-sampling-batch-size": 3}))
    cut = [[_sample(g, [1], status=SampleStatus.ABORTED)] * 2 for g in (4, 5, 6)]
    carry, resumed = CarryOver(partial=list(cut)), []

    def start(round_, groups):
        resumed.append([g[0].group_index for g in groups])
        return _Round(groups, 0)

    got = collect_groups(start, wanted=2, keep=hooks.keep, carry=carry, take_buffered=hooks.take_buffered,
                         draw_size=2)
    assert resumed == [[6, 5]]  # the newest first, and only as many as a draw holds
    assert [g[0].group_index for g in carry.partial] == [4]  # the rest waits for a later round
    assert [g[0].group_index for g in got.groups] == [6, 5] and got.resumed == 2


def test_buffer_filter_needs_partial_rollout(tmp_path):
    with pytest.raises(ConfigError, match="--buffer-filter-path picks which cut-off groups resume"):
        _cfg(tmp_path, **{"buffer-filter-path": f"{PLUGINS}:buffer_filter"})


def test_sample_filter_removes_samples_from_the_loss_and_all_samples_process_sees_every_group(tmp_path):
    hooks = load_rollout_hooks(_cfg(tmp_path, **{
        "rollout-sample-filter-path": f"{PLUGINS}:rollout_sample_filter",
        "rollout-all-samples-process-path": f"{PLUGINS}:rollout_all_samples_process"}))
    kept = [[_sample(0, [1, 2], 1.0), _sample(0, [3], 0.0)], [_sample(1, [4], 0.3), _sample(1, [5, 6, 7], 0.6)]]
    dropped = [[_sample(2, [1], 0.0), _sample(2, [1], 0.0)]]
    hooks.after_collect(kept, kept + dropped, data_source=object())
    assert [[s.loss_mask for s in g] for g in kept] == [[[1, 1], [0]], [[0], [1, 1, 1]]]
    assert [[s.remove_sample for s in g] for g in kept] == [[False, True], [True, False]]
    assert _notes(tmp_path, "rollout_all_samples_process") == [
        {"hook": "rollout_all_samples_process", "pid": _notes(tmp_path, "rollout_sample_filter")[0]["pid"],
         "groups": 3, "sizes": [2], "has_data_source": True}]


@pytest.mark.parametrize("function, skip", [("log_rollout", False), ("log_rollout_instead", True)])
def test_rollout_log_function_sees_the_rollout_and_may_replace_our_logging(tmp_path, function, skip):
    hooks = load_rollout_hooks(_cfg(tmp_path, **{"custom-rollout-log-function-path": f"{PLUGINS}:{function}"}))
    samples = [_sample(0, [1], 1.0), _sample(0, [2], 0.0)]
    assert hooks.skip_default_log(3, samples, {"rollout/aborted_groups": 0}, 1.5) is skip
    assert _notes(tmp_path, function)[0]["rollout_id"] == 3


# -- the trainer's hooks ---------------------------------------------------------------------------------------
def _inputs(rewards, lengths, group_size=2):
    mask = torch.ones(sum(lengths))
    return AdvantageInputs(rewards=torch.tensor(rewards), response_lengths=lengths, loss_mask=mask,
                           group_size=group_size, kl=torch.zeros_like(mask))


LOG_PROBS = {"log_probs": None, "ref_log_probs": None, "rollout_log_probs": None}


def test_reward_post_process_replaces_the_group_normalisation(tmp_path):
    cfg = _cfg(tmp_path, **{"custom-reward-post-process-path": f"{PLUGINS}:reward_post_process"})
    samples = [_sample(0, [1, 2], 1.0), _sample(0, [3], 0.0), _sample(1, [4], 0.5), _sample(1, [5], 0.5)]
    result = load_trainer_hooks(cfg).advantages(cfg, samples, _inputs([1.0, 0.0, 0.5, 0.5], [2, 1, 1, 1]),
                                                 LOG_PROBS)
    # Centred, not divided by the std (grpo's default would give ±0.7071 for the first group).
    assert result.advantages.tolist() == [0.5, 0.5, -0.5, 0.0, 0.0]
    assert _notes(tmp_path, "reward_post_process")[0]["rewards"] == [0.5, -0.5, 0.0, 0.0]


def test_custom_advantage_function_gets_vime_rollout_data_and_sets_the_advantages(tmp_path):
    cfg = _cfg(tmp_path, **{"custom-advantage-function-path": f"{PLUGINS}:custom_advantage"})
    samples = [_sample(0, [1, 2], 1.0), _sample(0, [3], 0.0)]
    inputs = _inputs([1.0, 0.0], [2, 1])
    inputs.loss_mask[1] = 0  # a masked token gets no advantage
    result = load_trainer_hooks(cfg).advantages(cfg, samples, inputs, LOG_PROBS)
    expected = group_normalized_advantages(torch.tensor([1.0, 0.0]), 2)  # vime's default post-process first
    assert torch.equal(result.advantages, torch.stack([expected[0], expected[0] * 0, expected[1]]))
    assert torch.equal(result.returns, result.advantages)

    whitened = with_overrides(cfg, normalize_advantages=True)
    again = load_trainer_hooks(whitened).advantages(whitened, samples, inputs, LOG_PROBS)
    assert torch.allclose(again.advantages, masked_whiten(result.advantages, inputs.loss_mask))


def test_custom_advantage_of_the_wrong_length_is_named(tmp_path):
    (tmp_path / "bad.py").write_text("def adv(args, rollout_data):\n"
                                     "    rollout_data['advantages'] = [m[:1] for m in rollout_data['loss_masks']]\n")
    cfg = _cfg(tmp_path, **{"custom-advantage-function-path": f"{tmp_path}/bad.py:adv"})
    named = r"rollout_data\['advantages'\] to 1 values for a response of 2 tokens \(sample 0 of group 0\)"
    with pytest.raises(ValueError, match=named):
        load_trainer_hooks(cfg).advantages(cfg, [_sample(0, [1, 2]), _sample(0, [3])], _inputs([1.0, 0.0], [2, 1]),
                                           LOG_PROBS)


# -- what is refused, and when ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["rollout-function-path", "eval-function-path"])
def test_vime_rollout_functions_are_refused_with_the_reason(tmp_path, flag):
    with pytest.raises(ConfigError, match=f"--{flag} mine.py:generate_rollout: vime's rollout functions drive"):
        _cfg(tmp_path, **{flag: "mine.py:generate_rollout"})
    assert _cfg(tmp_path, **{flag: "slime.rollout.sglang_rollout.generate_rollout"})  # the default: ours


def test_a_hook_with_the_wrong_signature_fails_when_loaded(tmp_path):
    (tmp_path / "bad.py").write_text("def one(samples):\n    pass\n")
    with pytest.raises(ValueError, match=r"--rollout-sample-filter-path .* cannot be called with \(args, samples\)"):
        load_rollout_hooks(_cfg(tmp_path, **{"rollout-sample-filter-path": f"{tmp_path}/bad.py:one"}))


def test_preflight_loads_and_checks_every_plugin_before_any_model_loads(tmp_path, tiny_model):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 3?", "label": "5"}) + "\n")
    (tmp_path / "bad.py").write_text("def adv(rollout_data):\n    pass\n")
    flags = {"hf-checkpoint": str(tiny_model), "prompt-data": str(data), "n-samples-per-prompt": 2,
             "output-dir": str(tmp_path), "custom-rm-path": f"{PLUGINS}:custom_rm",
             "dynamic-sampling-filter-path": f"{PLUGINS}:dynamic_filter",
             "custom-reward-post-process-path": f"{PLUGINS}:reward_post_process"}
    preflight(build_config([], **flags))  # vime's signatures pass
    with pytest.raises(PreflightError, match=r"--custom-advantage-function-path .*bad.py:adv.* \(args, rollout_data\)"):
        preflight(build_config([], **flags, **{"custom-advantage-function-path": f"{tmp_path}/bad.py:adv"}))
