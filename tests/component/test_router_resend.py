"""The dispatcher's re-send under `--use-fault-tolerance` (vime_engine/rollout/server/router_engine.py), against a
real vllm-router: a request that finds no server (the router answers 503 while none is registered, as when the only
server died and its replacement is starting) is posted again, the same body with the same seed, until a server has
joined and answers; without fault tolerance the 503 fails the request at once. The server behind the router is a
stand-in speaking vLLM's `/inference/v1/generate` (a vLLM server would add half a minute for nothing under test)."""

from __future__ import annotations

import threading

import pytest

from tests.support.http_server import StandIn
from vime_engine.rollout.server.router import Router, RouterOptions
from vime_engine.rollout.server.router_engine import RouterAddress, RouterEngine
from vime_engine.rollout.vllm_engine import Request, SamplingSettings
from vime_engine.sample import SampleStatus

SAMPLING = SamplingSettings(max_tokens=4, temperature=1.0, top_p=1.0, top_k=-1)
ANSWER = {"choices": [{"token_ids": [7, 8], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.0}]},
                       "finish_reason": "stop"}]}


@pytest.fixture(scope="module")
def router():
    router = Router.start_or_join(RouterOptions(), "127.0.0.1", log_dir=None)
    yield router
    router.stop()


def _engine(router: Router, resend: bool) -> RouterEngine:
    return RouterEngine(RouterAddress(router.url, ()), max_model_len=64, timeout_s=60, resend=resend)


def test_a_request_that_finds_no_server_is_posted_again_until_one_joins(router):
    engine, server = _engine(router, resend=True), StandIn(lambda path, headers, body: (200, ANSWER)).start()
    try:
        engine.submit([Request("3/1", [5, 6, 7], 4, seed=1234)], SAMPLING)
        threading.Timer(1.5, router.add, [server.url]).start()  # the replacement joins while the request waits
        done = []
        while not done:
            done = engine.step()
        assert (done[0].token_ids, done[0].log_probs, done[0].status) == ([7, 8], [-0.5, -1.0], SampleStatus.COMPLETED)
        assert [body["token_ids"] for _, _, body in server.requests] == [[5, 6, 7]]
        assert server.requests[0][2]["sampling_params"]["seed"] == 1234
    finally:
        router.remove(server.url)
        engine.close()
        server.stop()


def test_without_fault_tolerance_a_request_that_finds_no_server_fails_at_once(router):
    engine = _engine(router, resend=False)
    try:
        engine.submit([Request("3/1", [5, 6, 7], 4, seed=1234)], SAMPLING)
        with pytest.raises(RuntimeError, match="HTTP 503"):
            engine.step()
    finally:
        engine.close()


def test_a_second_router_starts_on_the_same_machine_and_leaves_no_log_behind(router):
    # vllm-router's metrics port is one fixed number by default; each router the runs start gets its own.
    second = Router.start_or_join(RouterOptions(), "127.0.0.1", log_dir=None)
    try:
        assert second.port != router.port and second.workers() == []
    finally:
        second.stop()
    # started outside a run, it logged to a temporary file, which a clean stop removes
    assert second.process.log_path.name.startswith("vimeflow-vllm-router-") and not second.process.log_path.exists()
