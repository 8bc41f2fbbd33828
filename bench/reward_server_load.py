"""Load on `vimeflow reward-server`: latency percentiles and throughput with N concurrent clients.

The server runs as its own process (`python -m flows.cli reward-server --port 0`), as in a deployment. For
each client count, N clients (each its own keep-alive connection) send requests back to back for a fixed
time; every request carries an id, and every answer must echo it with the reward its sample implies, so a
lost, duplicated or misdelivered reward fails the run. The server's own count (`GET /health`) must equal the
answers received. Then `RemoteReward` scores groups of 8 (one wave each), as the rollout worker does.

Baseline: the same reward function called in this process, one thread, no HTTP: the ratio says how much of
one core's grading rate the server delivers over HTTP.

    .venv/bin/python bench/reward_server_load.py                      # 1, 4, 16 clients, 5 s each
    .venv/bin/python bench/reward_server_load.py --clients 32 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from vime_engine.rewards import BUILTIN_REWARDS, RemoteReward, RewardInput  # noqa: E402


def sample(n: int) -> RewardInput:
    """Sample n: its response boxes n in one of four forms; every third label is off by one (reward 0)."""
    forms = [f"The answer is \\boxed{{{n}}}.", f"so x = {n}, hence \\boxed{{x = {n}}}",
             f"\\boxed{{\\frac{{{2 * n}}}{{2}}}}", f"I think it is {n}, not boxed"]
    label = str(n + 1 if n % 3 == 0 else n)
    return RewardInput(f"problem {n}", forms[n % 4], label)


def expected_rewards(rm_type: str, count: int) -> list[float]:
    fn = BUILTIN_REWARDS[rm_type]
    return [float(fn(s.response, s.label)) for s in map(sample, range(count))]


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def local_rate(rm_type: str, seconds: float) -> float:
    fn, done, deadline = BUILTIN_REWARDS[rm_type], 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        s = sample(done % 1000)
        fn(s.response, s.label)
        done += 1
    return done / seconds


async def load(url: str, clients: int, seconds: float, expected: list[float]) -> dict:
    latencies: list[float] = []
    answered: dict[int, int] = {}
    problems: list[str] = []
    deadline = time.perf_counter() + seconds

    async def client(c: int) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            k = 0
            while time.perf_counter() < deadline:
                n, request_id = k % len(expected), c * 10_000_000 + k
                s = sample(n)
                started = time.perf_counter()
                answer = await http.post(url, json={"prompt": s.prompt, "response": s.response, "label": s.label,
                                                    "id": request_id})
                latencies.append(time.perf_counter() - started)
                body = answer.json()
                if answer.status_code != 200 or body["id"] != request_id or body["reward"] != expected[n]:
                    problems.append(f"request {request_id}: {answer.status_code} {body}")
                answered[request_id] = answered.get(request_id, 0) + 1
                k += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed = time.perf_counter() - started
    duplicated = sum(1 for v in answered.values() if v > 1)
    latencies.sort()
    return {"requests": len(latencies), "rate": len(latencies) / elapsed, "problems": problems,
            "duplicated": duplicated, "p50": percentile(latencies, 0.50), "p95": percentile(latencies, 0.95),
            "p99": percentile(latencies, 0.99), "max": latencies[-1]}


def start_server(rm_type: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "reward-server", "--port", "0", "--rm-type", rm_type],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"the reward server did not start: {line}{proc.stdout.read()}")
    return proc, line.split(" on ")[1].split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rm-type", default="math", choices=sorted(BUILTIN_REWARDS))
    args = parser.parse_args()

    expected = expected_rewards(args.rm_type, 1000)
    baseline = local_rate(args.rm_type, args.seconds)
    print(f"baseline: {args.rm_type} reward in-process, one thread: {baseline:.0f} rewards/s")
    proc, url = start_server(args.rm_type)
    failed = False
    try:
        print(f"server {url} ({args.rm_type}), {args.seconds:.0f} s per row")
        print(f"{'clients':>7} {'requests':>9} {'req/s':>8} {'vs base':>8} {'p50 ms':>8} {'p95 ms':>8} "
              f"{'p99 ms':>8} {'max ms':>8}  lost/dup/wrong")
        answered_total = 0
        for clients in args.clients:
            r = asyncio.run(load(url, clients, args.seconds, expected))
            answered_total += r["requests"]
            served = httpx.get(url + "health").json()["served"]
            lost = answered_total - served if served != answered_total else 0
            failed |= bool(r["problems"] or r["duplicated"] or lost)
            print(f"{clients:>7} {r['requests']:>9} {r['rate']:>8.0f} {r['rate'] / baseline:>8.2f} "
                  f"{1e3 * r['p50']:>8.2f} {1e3 * r['p95']:>8.2f} {1e3 * r['p99']:>8.2f} {1e3 * r['max']:>8.2f}  "
                  f"{lost}/{r['duplicated']}/{len(r['problems'])}")
            for problem in r["problems"][:5]:
                print("   ", problem)
        reward = RemoteReward(url)
        groups, waves = [[sample(8 * g + i) for i in range(8)] for g in range(40)], []
        for g, group in enumerate(groups):
            started = time.perf_counter()
            failed |= reward(group) != expected[8 * g: 8 * g + 8]
            waves.append(time.perf_counter() - started)
        waves.sort()
        print(f"RemoteReward, groups of 8 (one wave each, {len(waves)} groups): p50 {1e3 * percentile(waves, 0.5):.1f} "
              f"ms, p95 {1e3 * percentile(waves, 0.95):.1f} ms")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if failed:
        raise SystemExit("FAILED: lost, duplicated or wrong rewards (see above)")


if __name__ == "__main__":
    main()
