"""`--rm-url` is checked when the configuration is built, and the batch reward a run gets from its flags."""

from __future__ import annotations

import pytest

from vime_engine.config import ConfigError, build_config, with_overrides
from vime_engine.rewards import RemoteReward, RewardInput, get_batch_reward

BASE = {"hf-checkpoint": "m", "prompt-data": "d.jsonl"}
URL = "http://127.0.0.1:8000/"


def test_remote_rm_needs_an_http_url_and_the_url_needs_remote_rm():
    assert build_config([], **BASE, **{"rm-type": "remote_rm", "rm-url": URL}).reward.rm_url == URL
    assert build_config([], **BASE, **{"eval-rm-type": "remote_rm", "rm-url": URL}).reward.rm_url == URL
    cases = [
        ({"rm-type": "remote_rm"}, r"--rm-type remote_rm \(or --eval-rm-type remote_rm\) needs --rm-url"),
        ({"eval-rm-type": "remote_rm"}, r"needs --rm-url"),
        ({"rm-url": URL}, r"--rm-url http://127.0.0.1:8000/ is only read by remote_rm"),
        # a custom reward takes precedence over --rm-type, so the URL would go unread
        ({"rm-type": "remote_rm", "custom-rm-path": "m:f", "rm-url": URL}, r"is only read by remote_rm"),
        ({"rm-type": "remote_rm", "rm-url": "127.0.0.1:8000"}, r"expected an http:// or https:// URL"),
    ]
    for flags, message in cases:
        with pytest.raises(ConfigError, match=message):
            build_config([], **BASE, **flags)


def test_rm_url_does_not_change_the_math_of_a_run():
    one = build_config([], **BASE, **{"rm-type": "remote_rm", "rm-url": URL})
    other = with_overrides(one, rm_url="http://10.0.0.1:9000/")
    assert one.math_hash() == other.math_hash()


def test_batch_reward_by_type():
    remote = get_batch_reward("remote_rm", rm_url=URL)
    assert isinstance(remote, RemoteReward) and remote.url == URL
    with pytest.raises(ValueError, match="--rm-type remote_rm needs --rm-url"):
        get_batch_reward("remote_rm")
    local = get_batch_reward("gsm8k")
    assert local([RewardInput("q", "1 + 1 = 2", "2"), RewardInput("q", "3", "2")]) == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"'maths' is unknown; choose one of .*remote_rm \(with --rm-url\)"):
        get_batch_reward("maths")
