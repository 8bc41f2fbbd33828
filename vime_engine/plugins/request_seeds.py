"""A generation request's seed: the sample's seed mixed with the number of input tokens.

Every request carries a seed (vLLM samples from it), so a round of conversations draws the same tokens however
its requests interleave and however often it is generated again after a resume. The sample's seed is
`sampling_params["sampling_seed"]`, set per sample by the rollout worker; mixing in the input length gives each
turn of a multi-turn sample its own draw. It lives here, below the rollout room, because both clients of the
engine derive seeds this way: the in-process `args.rollout_engine` (vime_engine/rollout/custom_generate.py) and
the HTTP helpers vime's plugins import (vime_engine/plugins/vime_modules/), so both rollout modes draw alike.
"""

from __future__ import annotations

import hashlib


def request_seed(sampling_seed: int, num_input_tokens: int) -> int:
    digest = hashlib.sha256(f"{sampling_seed}/{num_input_tokens}".encode()).digest()
    return int.from_bytes(digest[:4], "little")
