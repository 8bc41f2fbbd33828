"""`--rm-type remote_rm`: the HTTP client against the real reward server on 127.0.0.1, with faults injected on
the wire by a proxy (503s, hang-ups, half answers), and under load; then a rollout worker rewarded by it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.support.fault_proxy import FaultProxy
from tests.support.http_server import BackgroundHTTPServer
from tests.support.tiny_task import digit_share
from vime_engine.rewards import RemoteReward, RemoteRewardError, RewardInput
from vime_engine.rewards.math import math_reward
from vime_engine.rewards.server import RewardServer

ROOT = Path(__file__).resolve().parents[2]
FAST_RETRIES = {"backoff_s": 0.01, "backoff_cap_s": 0.05}

BATCH = [
    RewardInput("What is 6 * 7?", r"so \boxed{42}", "42"),
    RewardInput("What is 6 * 7?", r"so \boxed{41}", "42"),
    RewardInput("Half of one?", r"\boxed{\frac{1}{2}}", "0.5"),
    RewardInput("Half of one?", "one half, no box", "0.5"),
    RewardInput("x = ?", r"\boxed{x = 3}", r"\boxed{3}"),
]
EXPECTED = [1.0, 0.0, 1.0, 0.0, 1.0]


@contextmanager
def serving(server: RewardServer):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def reward_server():
    with serving(RewardServer(math_reward, "math")) as server:
        yield server


@pytest.fixture
def proxy(reward_server):
    front = FaultProxy(reward_server.url).start()
    yield front
    front.stop()


def _posts(proxy: FaultProxy, status: int | None = None) -> int:
    return proxy.count(lambda e: e.method == "POST" and (status is None or e.status == status))


def test_client_scores_a_batch_as_the_reward_function_does(reward_server):
    before = reward_server.served
    rewards = RemoteReward(reward_server.url)(BATCH)
    assert rewards == EXPECTED == [math_reward(i.response, i.label) for i in BATCH]
    assert reward_server.served - before == len(BATCH)
    assert RemoteReward(reward_server.url)([]) == []


def test_server_answers_slime_shape_and_refuses_bad_requests(reward_server):
    import httpx

    bare = httpx.post(reward_server.url, json={"prompt": "p", "response": r"\boxed{2}", "label": "2"})
    assert bare.status_code == 200 and bare.json() == 1.0  # no id: the bare number slime's client reads
    with_id = httpx.post(reward_server.url, json={"response": r"\boxed{2}", "label": "3", "id": 7})
    assert with_id.json() == {"reward": 0.0, "id": 7}
    for body, message in [(b"not json", "not JSON"), (b'{"response": 1, "label": "2"}', '"response" must be')]:
        answer = httpx.post(reward_server.url, content=body)
        assert answer.status_code == 400 and message in answer.json()["error"]
    health = httpx.get(reward_server.url + "health").json()
    assert health == {"status": "ok", "rm_type": "math", "served": reward_server.served}


def test_retries_503_then_gets_every_reward(proxy):
    proxy.fail(4, status=503, match=lambda m, p, q: m == "POST")
    assert RemoteReward(proxy.url + "/", **FAST_RETRIES)(BATCH) == EXPECTED
    assert _posts(proxy, 503) == 4
    assert _posts(proxy, 200) == len(BATCH)  # each sample rewarded exactly once


@pytest.mark.parametrize("fault", ["hang_up", "drop"])
def test_survives_a_server_that_drops_connections(proxy, fault):
    # hang_up: the request is read and the socket closed with no answer; drop: half an answer, then closed.
    if fault == "hang_up":
        proxy.hang_up(4, match=lambda m, p, q: m == "POST")
    else:
        proxy.drop(4, match=lambda m, p, q: m == "POST")
    assert RemoteReward(proxy.url + "/", **FAST_RETRIES)(BATCH) == EXPECTED
    assert _posts(proxy) == len(BATCH) + 4


def test_4xx_fails_at_once_naming_the_url_and_status(proxy):
    url = proxy.url + "/score"  # the real server answers 404 on any path but /
    with pytest.raises(RemoteRewardError, match=rf"reward server {url} answered 404 Not Found: .*not retried"):
        RemoteReward(url, **FAST_RETRIES)(BATCH[:1])
    assert _posts(proxy) == 1


def test_gives_up_after_bounded_retries_naming_the_url(proxy):
    proxy.fail(100, status=503, match=lambda m, p, q: m == "POST")
    url = proxy.url + "/"
    with pytest.raises(RemoteRewardError, match=rf"reward server {url} gave no reward after 3 tries \(last: HTTP 503"):
        RemoteReward(url, max_attempts=3, **FAST_RETRIES)(BATCH[:1])
    assert _posts(proxy) == 3


def test_unreachable_and_silent_servers_fail_after_their_tries():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}/"  # bound, not listening: refused
    with pytest.raises(RemoteRewardError, match=rf"{refused} gave no reward after 2 tries \(last: ConnectError"):
        RemoteReward(refused, max_attempts=2, **FAST_RETRIES)(BATCH[:1])
    with socket.socket() as silent:  # listens, never answers: the per-request timeout ends each try
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match=rf"{url} gave no reward after 2 tries \(last: ReadTimeout"):
            RemoteReward(url, timeout_s=0.3, max_attempts=2, **FAST_RETRIES)(BATCH[:1])
        assert time.monotonic() - started < 5


def _json_server(answer_for, delay_s: float = 0.0):
    """A server answering every POST with `answer_for(request)`; tracks the peak of requests in flight."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        in_flight = peak = 0
        lock = threading.Lock()

        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with Handler.lock:
                Handler.in_flight += 1
                Handler.peak = max(Handler.peak, Handler.in_flight)
            time.sleep(delay_s)
            with Handler.lock:
                Handler.in_flight -= 1
            data = json.dumps(answer_for(request)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return BackgroundHTTPServer(Handler).start(), Handler


def test_a_batch_is_one_concurrent_wave_bounded_by_max_concurrency():
    server, handler = _json_server(lambda r: {"reward": float(len(r["response"])), "id": r["id"]}, delay_s=0.2)
    try:
        items = [RewardInput("p", "x" * n, "") for n in range(12)]
        started = time.monotonic()
        assert RemoteReward(server.url + "/", max_concurrency=4)(items) == [float(n) for n in range(12)]
        elapsed = time.monotonic() - started
    finally:
        server.stop()
    assert handler.peak == 4  # four at a time, never more
    assert elapsed < 12 * 0.2 / 2  # three waves of four, not twelve calls in a row


@pytest.mark.parametrize(
    ("answer", "message"),
    [({"reward": 1.0, "id": "someone-else"}, "with the reward of request 'someone-else'"),
     ("yes", "expected a finite JSON number"), (True, "expected a finite JSON number"),
     ({"score": 1.0}, "expected a finite JSON number")],
)
def test_an_answer_that_is_not_this_samples_reward_is_refused(answer, message):
    server, _ = _json_server(lambda r: answer)
    try:
        with pytest.raises(RemoteRewardError, match=message):
            RemoteReward(server.url + "/")(BATCH[:1])
    finally:
        server.stop()


def test_load_many_concurrent_clients_lose_and_duplicate_nothing(reward_server):
    """8 clients send waves of 8 for 3 s; every sample carries its own id in its response and expects the
    reward that id implies, and the server gives exactly one reward per sample sent."""
    clients, wave, duration_s = 8, 8, 3.0
    before = reward_server.served
    deadline = time.monotonic() + duration_s

    def client(c: int) -> tuple[int, list[int]]:
        sent, wrong = 0, []
        while time.monotonic() < deadline:
            ids = [c * 1_000_000 + sent + i for i in range(wave)]
            # Every third sample's label is off by one: the reward tells which sample an answer belongs to.
            items = [RewardInput("p", rf"sample {n}: \boxed{{{n}}}", str(n + 1 if n % 3 == 0 else n)) for n in ids]
            rewards = RemoteReward(reward_server.url)(items)
            wrong += [n for n, r in zip(ids, rewards, strict=True) if r != (0.0 if n % 3 == 0 else 1.0)]
            sent += wave
        return sent, wrong

    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, range(clients)))
    sent = sum(s for s, _ in results)
    assert [w for _, w in results] == [[]] * clients
    assert sent >= clients * wave  # every client got at least one wave through
    assert reward_server.served - before == sent


def test_cli_serves_a_builtin_reward_and_refuses_others():
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "reward-server", "--port", "0", "--rm-type", "gsm8k"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "reward server (gsm8k) on http://127.0.0.1:" in line, line
        url = line.split(" on ")[1].split()[0]
        items = [RewardInput("q", "1 + 1 = 2", "2"), RewardInput("q", "it is 3", "2")]
        assert RemoteReward(url)(items) == [1.0, 0.0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    refused = CliRunner().invoke(app, ["reward-server", "--rm-type", "remote_rm"])
    assert refused.exit_code == 2 and "cannot be served" in refused.output


@pytest.mark.slow
def test_rollout_worker_rewards_train_and_eval_groups_through_the_server(tmp_path, monkeypatch):
    """A real vLLM rollout rewarded over HTTP: every finished sample gets exactly the served reward, for the
    training reward (--rm-type remote_rm) and an eval plan's (--eval-rm-type remote_rm) alike."""
    from vime_engine.config import build_config
    from vime_engine.data.records import PromptRecord
    from vime_engine.models.builtin import materialize_builtin_model
    from vime_engine.rollout.worker import GenerationPlan, RolloutWorker, train_plan

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = materialize_builtin_model("tiny-qwen3", tmp_path / "tiny")
    records = [PromptRecord([{"role": "user", "content": f"What is {a} + {b}?"}], str(a + b))
               for a, b in [(3, 4), (12, 9), (7, 21)]]
    with serving(RewardServer(digit_share, "digit_share")) as server:
        cfg = build_config([], **{
            "hf-checkpoint": str(model), "prompt-data": "unused.jsonl", "apply-chat-template": True,
            "rollout-batch-size": 3, "n-samples-per-prompt": 4, "rollout-max-response-len": 16,
            "vllm-kv-cache-gb": 0.25, "rm-type": "remote_rm", "rm-url": server.url, "eval-rm-type": "remote_rm",
        })
        worker = RolloutWorker(cfg, kv_cache_bytes=2**28)
        train_samples = worker.generate(records, 0, 0, train_plan(cfg))
        eval_plan = GenerationPlan(train_plan(cfg).sampling, 2, "eval/x", cfg.eval.eval_rm_type)
        eval_samples = worker.generate(records, 0, 0, eval_plan)
        assert server.served == len(train_samples) + len(eval_samples) == 3 * 4 + 3 * 2
    rewards = [s.reward for s in train_samples + eval_samples]
    assert rewards == [digit_share(s.response, s.label) for s in train_samples + eval_samples]
    assert len(set(rewards)) > 1  # the responses differ, so a wrong pairing would show
