"""The seed of each `/inference/v1/generate` request a vime plugin posts, derived as our in-process engine does.

Every request of a sample must carry `request_seed(sampling_seed, number of input tokens)` (request_seeds.py), so a
rollout draws the same tokens in either rollout mode and again after a resume. vime's plugins build a turn's body
themselves, `{"token_ids": ..., "sampling_params": _build_inference_sampling_params(sampling_params)}`, often
building the sampling part once for every turn, so only the request as posted holds both the sample's seed and
its input length. `_build_inference_sampling_params` therefore returns a SeededSamplingParams (the sample's seed
kept as an attribute, not sent), and `post` fills in each request's seed with `with_request_seed`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vime_engine.plugins import generate_api
from vime_engine.plugins.request_seeds import request_seed


class SeededSamplingParams(dict):
    """A body's `sampling_params` whose seed each request derives from the sample's `sampling_seed`."""

    def __init__(self, params: Mapping[str, Any], sampling_seed: int):
        super().__init__(params)
        self.sampling_seed = sampling_seed


def with_request_seed(url: str, payload: Any) -> Any:
    """`payload` as it is to be posted to `url`: a generate body with SeededSamplingParams gets its request's
    seed; any other body passes unchanged. A ValueError for a generate body without a seed, which would draw
    differently every time it ran."""
    if not url.partition("?")[0].endswith(generate_api.PATH) or not isinstance(payload, Mapping):
        return payload
    params = payload.get("sampling_params")
    if isinstance(params, SeededSamplingParams) and params.get("seed") is None:
        seed = request_seed(params.sampling_seed, len(payload["token_ids"]))
        return {**payload, "sampling_params": {**params, "seed": seed}}
    if not isinstance(params, Mapping) or params.get("seed") is None:
        raise ValueError(f"a {generate_api.PATH} body without a seed: build its sampling_params with "
                         "_build_inference_sampling_params(sampling_params) from the sampling_params the generate "
                         "function was given (they carry the sample's sampling_seed), once per request or once for "
                         "all, and post them as returned (a copy drops the seed); or set sampling_params['seed']")
    return payload
