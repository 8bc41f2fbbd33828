"""The rollout group's servers behind vllm-router, driven like one in-process engine (VLLMEngine's calls).

Every request goes to the router's `/inference/v1/generate` as token ids with its own seed, so what it generates
does not depend on which server the router picks nor on what else that server is running (on CPU vLLM's result
for a request does not depend on its batch): a round comes out as one in-process engine would give it. The
`x-session-id` header names the sample's group, so the consistent-hash policy keeps a group's samples (one
prompt) on one server, where their prompt's blocks are cached.

Requests are in flight on a pool of threads, one blocking HTTP call each; `step()` waits until at least one more
has come back. Completions come back in the order the servers finish them, which depends on timing: a caller
that needs a fixed order sorts them (a whole round is returned by group index).

With `--use-fault-tolerance` a request that fails for want of a server (the router cannot connect, or answers 5xx:
its server died and it found no other, or none is registered while the only one restarts) is posted again, the
same body with the same seed, until it is answered or `--vllm-router-request-timeout-secs` has passed since its
first post: the rollout group meanwhile replaces the dead server (vime_engine/runtime/server_group.py). The router
re-sends a request whose server died to another one itself where it can; either way the answer is the one the
dead server would have given.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import httpx

from vime_engine.plugins import generate_api
from vime_engine.rollout.vllm_engine import Completion, Request, SamplingSettings
from vime_engine.sample import SampleStatus

log = logging.getLogger(__name__)
# Requests in flight at once (vime's --vllm-server-concurrency default); more wait in the pool's queue.
MAX_IN_FLIGHT = 512
RESEND_BACKOFF_S = (0.5, 5.0)  # the first wait before posting a failed request again, and the longest
_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@dataclass(frozen=True)
class RouterAddress:
    """Where the router listens and the servers behind it (their own URLs, for aborting)."""

    url: str
    server_urls: tuple[str, ...]


def generate_payload(request: Request, sampling: SamplingSettings) -> dict[str, Any]:
    """The `/inference/v1/generate` body of one request: its token ids, seed and sampling settings, with the
    sampled tokens' log-probs (generate_api says how)."""
    settings = {"max_tokens": request.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k}
    return generate_api.request_body(request.prompt_token_ids, settings, request.seed, request_id=request.key)


def parse_completion(key: str, body: dict[str, Any]) -> tuple[Completion, str | None]:
    """A `/inference/v1/generate` response as a Completion, with the weight version the server generated it on
    (None when it reports none)."""
    out = generate_api.read_response(body, f"request {key}")
    return Completion(key, out.token_ids, out.log_probs, _STATUS[out.finish_reason]), out.weight_version


class RouterEngine:
    """Submit requests, `step()` until they have come back, or `abort()` them: VLLMEngine's calls, over HTTP."""

    def __init__(self, address: RouterAddress, max_model_len: int, timeout_s: float, resend: bool = False):
        self.address, self.max_model_len, self.timeout_s, self.resend = address, max_model_len, timeout_s, resend
        self.weight_version = 0  # the version the servers hold, set by the rollout group after each sync
        self._http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=MAX_IN_FLIGHT))
        self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="router-request")
        self._in_flight: dict[Future, str] = {}

    @property
    def running(self) -> bool:
        return bool(self._in_flight)

    def submit(self, requests: list[Request], sampling: SamplingSettings, join_running: bool = False) -> None:
        if self.running and not join_running:
            raise RuntimeError("requests are still running: finish or abort them before submitting more")
        for r in requests:
            self._in_flight[self._pool.submit(self._post, r, sampling)] = r.key

    def _post(self, request: Request, sampling: SamplingSettings) -> Completion:
        group = request.key.split("/")[0]
        body, deadline = generate_payload(request, sampling), time.monotonic() + self.timeout_s
        backoff = RESEND_BACKOFF_S[0]
        while True:
            try:
                response = self._http.post(self.address.url + generate_api.PATH, json=body,
                                           headers={"x-session-id": group})
                if response.status_code < 500 or not self.resend:
                    break
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.TransportError as error:
                if not self.resend:
                    raise
                failure = f"{type(error).__name__}: {error}"
            if time.monotonic() + backoff > deadline:
                raise RuntimeError(f"request {request.key} found no server for {self.timeout_s:.0f} s "
                                   f"(--vllm-router-request-timeout-secs); the last answer: {failure}")
            log.warning("request %s failed (%s): posting it again in %.1f s", request.key, failure, backoff)
            time.sleep(backoff)
            backoff = min(2 * backoff, RESEND_BACKOFF_S[1])
        if response.status_code != 200:
            raise RuntimeError(f"the router answered request {request.key} with HTTP {response.status_code}: "
                               f"{response.text[:500]}")
        completion, version = parse_completion(request.key, response.json())
        if version is not None and version != str(self.weight_version):
            raise RuntimeError(f"request {request.key} was generated on weight version {version}, but the servers "
                               f"were synced to {self.weight_version}: a server missed the sync")
        return completion

    def step(self) -> list[Completion]:
        """Wait until at least one request has come back; every request that has."""
        if not self._in_flight:
            return []
        wait(self._in_flight, return_when=FIRST_COMPLETED)
        return [self._collect(future) for future in list(self._in_flight) if future.done()]

    def _collect(self, future: Future) -> Completion:
        del self._in_flight[future]
        return future.result()

    def abort(self) -> list[Completion]:
        """Abort every request in flight on every server; what each had generated, in submission order."""
        if not self._in_flight:
            return []
        for url in self.address.server_urls:
            self._http.post(url + "/abort_requests", json={}).raise_for_status()
        wait(self._in_flight)
        return [self._collect(future) for future in list(self._in_flight)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
