"""The server mode's own costs: a server engine's start-up against an in-process engine's, and the router's
overhead per request against posting to the server directly.

Start-up: seconds from a fresh process to an engine that answers, for the in-process engine (a Python process
importing vLLM and building VLLMEngine, as an engine's actor does) and for `vllm serve` (ServerProcess until its
/health answers), on the tiny model; the medians of `--repeat` back-to-back pairs and their ratio.
Router overhead: the same `--requests` short requests, one at a time, posted to one server directly and through
a vllm-router in front of it; the median seconds per request of each and the difference.

    .venv/bin/python bench/server_mode.py [--repeat 3] [--requests 50]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

IN_PROCESS = """
import os
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vime_engine.rollout.vllm_engine import EngineSettings, VLLMEngine
VLLMEngine(EngineSettings({model!r}, max_model_len=512, kv_cache_bytes=2**28))
"""


def settings(model: str):
    from vime_engine.rollout.vllm_engine import EngineSettings

    return EngineSettings(model, max_model_len=512, kv_cache_bytes=2**28)


def start_server(model: str):
    from vime_engine.devices.accelerator import CPU
    from vime_engine.rollout.server.vllm_server import ServerProcess, free_port, server_argv

    port = free_port("127.0.0.1")
    return ServerProcess("vllm-server", server_argv(settings(model), "cpu", "127.0.0.1", port),
                         f"http://127.0.0.1:{port}", "/health", log_dir=None,
                         env={**CPU.actor_env, "VLLM_SERVER_DEV_MODE": "1"})


def startup_pair(model: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", IN_PROCESS.format(model=model)], check=True, capture_output=True)
    in_process = time.perf_counter() - t0
    t0 = time.perf_counter()
    server = start_server(model)
    served = time.perf_counter() - t0
    server.stop()
    return in_process, served


def seconds_per_request(http, url: str, requests: int) -> float:
    from vime_engine.rollout.server.router_engine import generate_payload
    from vime_engine.rollout.vllm_engine import Request, SamplingSettings

    times = []
    for i in range(requests):
        body = generate_payload(Request(f"0/{i}", [1, 2, 3, 4], 4, seed=i), SamplingSettings(4))
        t0 = time.perf_counter()
        http.post(url + "/inference/v1/generate", json=body, headers={"x-session-id": "0"}).raise_for_status()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    import httpx

    from vime_engine.models.builtin import materialize_builtin_model
    from vime_engine.rollout.server.router import Router, RouterOptions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    model = str(materialize_builtin_model("tiny-qwen3", args.cache / "tiny-qwen3"))

    pairs = [startup_pair(model) for _ in range(args.repeat)]
    for in_process, served in pairs:
        print(f"start-up: in-process engine {in_process:.1f} s, server engine {served:.1f} s", flush=True)
    in_process, served = (statistics.median(p[i] for p in pairs) for i in (0, 1))
    print(f"start-up medians: in-process {in_process:.1f} s, server {served:.1f} s ({served / in_process:.2f}x)")

    server = start_server(model)
    router = Router.start_or_join(RouterOptions(), "127.0.0.1", log_dir=None)
    try:
        router.add(server.url)
        with httpx.Client(timeout=60) as http:
            seconds_per_request(http, server.url, 5)  # warm-up
            direct = seconds_per_request(http, server.url, args.requests)
            routed = seconds_per_request(http, router.url, args.requests)
        print(f"per request (4 tokens): direct {1000 * direct:.1f} ms, through the router {1000 * routed:.1f} ms, "
              f"overhead {1000 * (routed - direct):.1f} ms ({routed / direct:.2f}x)")
    finally:
        router.stop()
        server.stop()


if __name__ == "__main__":
    main()
