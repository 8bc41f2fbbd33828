"""vLLM's `/inference/v1/generate` wire format, as both of its clients here speak it.

The server mode's RouterEngine (vime_engine/rollout/server/router_engine.py) and the HTTP helpers vime's plugins
import (vime_engine/plugins/vime_modules/) post the same bodies to the same router and read the same answers, so
the format lives once, below both: token ids in, token ids and the sampled tokens' log-probs out (`logprobs: 0`,
after temperature scaling, as the servers run with processed log-probs), never text (`detokenize: false`), each
request with its own seed. Pure functions over dicts: nothing here imports vLLM or opens a connection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PATH = "/inference/v1/generate"
# The sampling settings a body carries, under vLLM's names; a request's seed is passed on its own.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k")
# vLLM's finish reasons read as ours: "stop" (EOS or a stop token), "length" (out of tokens), "abort" (cut off).
_FINISH_REASONS = {"length": "length", "abort": "abort", "cancelled": "abort"}


@dataclass(frozen=True)
class Generated:
    """What one request generated, read from its response."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop", "length" or "abort"
    weight_version: str | None  # the version of the weights that generated it; None when the server names none


def sampling_params(sampling: Mapping[str, Any], seed: int | None) -> dict[str, Any]:
    """A body's `sampling_params`: `sampling`'s SAMPLING_FIELDS (each required) and `seed` (left out when None)."""
    missing = [name for name in SAMPLING_FIELDS if name not in sampling]
    if missing:
        raise ValueError(f"{PATH} sampling settings lack {', '.join(missing)}; "
                         f"give all of {', '.join(SAMPLING_FIELDS)}")
    params = {name: sampling[name] for name in SAMPLING_FIELDS}
    if seed is not None:
        params["seed"] = int(seed)
    return {**params, "logprobs": 0, "detokenize": False}


def request_body(token_ids: Sequence[int], sampling: Mapping[str, Any], seed: int | None,
                 request_id: str | None = None) -> dict[str, Any]:
    """The body of one request: generate after `token_ids` with `sampling` and `seed` (see `sampling_params`)."""
    body = {"token_ids": [int(t) for t in token_ids], "sampling_params": sampling_params(sampling, seed)}
    return body if request_id is None else {"request_id": request_id, **body}


def read_choice(choice: Mapping[str, Any], request: str = "a request") -> Generated:
    """One `choices[i]` of a response. A RuntimeError when its tokens and log-probs differ in number: the trainer
    needs one log-prob per sampled token, and a server that answers otherwise is not speaking this format."""
    tokens = [int(t) for t in choice.get("token_ids") or []]
    log_probs = [float(entry["logprob"]) for entry in (choice.get("logprobs") or {}).get("content") or []]
    if len(log_probs) != len(tokens):
        raise RuntimeError(f"the server answered {request} with {len(tokens)} tokens but {len(log_probs)} "
                           f"log-probs: is it vLLM's {PATH}?")
    spans = choice.get("weight_versions") or []
    version = str(spans[-1]["version"]) if spans else None
    return Generated(tokens, log_probs, _FINISH_REASONS.get(choice.get("finish_reason"), "stop"), version)


def read_response(body: Mapping[str, Any], request: str = "a request") -> Generated:
    """A response body's first (and, as we ask, only) choice; see `read_choice`."""
    return read_choice(body["choices"][0], request)
