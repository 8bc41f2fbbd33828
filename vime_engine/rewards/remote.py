"""`--rm-type remote_rm --rm-url URL`: rewards from an HTTP reward server, a group at a time.

Wire format (slime's `remote_rm` shape, plus an id): each sample is one `POST URL` with the JSON body
`{"prompt": str, "response": str, "label": str, "id": str}`. The server answers 200 with either a bare JSON
number (what slime's servers return) or `{"reward": number, "id": str}`; an id in the answer must be the
request's, so an answer can never land on the wrong sample. `vimeflow reward-server` speaks this format.

Failure policy: connection errors, timeouts, dropped connections, 5xx, 408 and 429 are retried with
exponential backoff (jittered, capped) up to `max_attempts` tries, then fail naming the URL; any other 4xx
fails at once (the request itself is wrong, so retrying cannot help); a 2xx whose body is not a reward fails
at once too. A failure stops the whole group: a reward is never silently replaced by a default.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import ssl
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import certifi
import httpx

from vime_engine.rewards.batch import RewardInput

_RETRIED_4XX = {408, 429}  # request timeout, too many requests: the server asks to come back later


class RemoteRewardError(RuntimeError):
    """A reward server that could not give a reward; the message names the URL and what it answered."""


@dataclass(frozen=True)
class RemoteReward:
    """Scores a batch of samples as one concurrent wave of requests (at most `max_concurrency` in flight)."""

    url: str
    timeout_s: float = 30.0
    max_concurrency: int = 64
    max_attempts: int = 6
    backoff_s: float = 0.5  # delay before the first retry; doubles each try, capped at backoff_cap_s
    backoff_cap_s: float = 8.0

    def __call__(self, items: Sequence[RewardInput]) -> list[float]:
        return asyncio.run(self.score(items))

    async def score(self, items: Sequence[RewardInput]) -> list[float]:
        """The rewards of `items`, in order."""
        if not items:
            return []
        limit = asyncio.Semaphore(self.max_concurrency)
        # Its own generator: the global `random` state belongs to the run's seeds and is checkpointed.
        jitter = random.Random()
        pool = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=pool, verify=_tls_context()) as client:
            tasks = [asyncio.create_task(self._reward(client, limit, jitter, item)) for item in items]
            try:
                return list(await asyncio.gather(*tasks))
            finally:  # one failure ends the wave: stop the requests still waiting or retrying
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _reward(
        self, client: httpx.AsyncClient, limit: asyncio.Semaphore, jitter: random.Random, item: RewardInput
    ) -> float:
        request_id = uuid.uuid4().hex
        payload = {"prompt": item.prompt, "response": item.response, "label": item.label, "id": request_id}
        attempt = 0
        while True:
            attempt += 1
            async with limit:
                try:
                    answer = await client.post(self.url, json=payload)
                except httpx.TransportError as exc:  # refused, reset, dropped without an answer, timed out
                    problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                else:
                    if answer.is_success:
                        return _reward_from(answer, request_id, self.url)
                    if answer.status_code < 500 and answer.status_code not in _RETRIED_4XX:
                        raise RemoteRewardError(
                            f"reward server {self.url} answered {answer.status_code} {answer.reason_phrase}: "
                            f"{answer.text[:300]!r}; not retried (the request itself was refused): check --rm-url "
                            "and that the server takes JSON {prompt, response, label, id}"
                        )
                    problem = f"HTTP {answer.status_code} {answer.reason_phrase}"
            if attempt >= self.max_attempts:
                raise RemoteRewardError(
                    f"reward server {self.url} gave no reward after {attempt} tries (last: {problem}); "
                    "check that it is running and reachable from the rollout workers"
                )
            delay = min(self.backoff_s * 2 ** (attempt - 1), self.backoff_cap_s)
            await asyncio.sleep(delay * jitter.uniform(0.5, 1.0))


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # httpx would build one per client, loading certifi's bundle each time (about 50 ms, as long as a wave).
    return ssl.create_default_context(cafile=certifi.where())


def _reward_from(answer: httpx.Response, request_id: str, url: str) -> float:
    """The reward in a 200 answer: a bare number, or `{"reward": number, "id": request_id}`."""
    try:
        body = answer.json()
    except json.JSONDecodeError:
        body = None
    value = body.get("reward") if isinstance(body, dict) else body
    if isinstance(body, dict) and "id" in body and body["id"] != request_id:
        raise RemoteRewardError(
            f"reward server {url} answered request {request_id} with the reward of request {body['id']!r}"
        )
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RemoteRewardError(
            f"reward server {url} answered {answer.text[:300]!r}; expected a finite JSON number or "
            '{"reward": number, "id": ...}'
        )
    return float(value)
