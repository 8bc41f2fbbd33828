"""Rollout throughput: our vLLM path (VLLMEngine, in-process) vs transformers `generate`, same model and sampling.

Both sample the same tokenized prompts with the same settings (temperature, top-p 1, no top-k, n samples per
prompt, max new tokens) in fp32 on the same threads. Tokens counted are generated tokens up to and including
the first EOS (HF pads finished rows; those pads are not counted). Each side first runs the full timed call
once untimed (vLLM's first batch of a new shape is several times slower); the best of `--repeat` is kept.

vLLM runs once per `--prefix-caching` setting, with its prefix cache emptied before every timed round (as a
weight sync does), so only the n samples of one prompt share their prompt's blocks. With both settings the
bench also checks that they generated identical tokens and log-probs. vLLM's CPU block size is 128 tokens:
prompts shorter than that share nothing; `--min-prompt-tokens` lengthens them with an instruction preamble.

    .venv/bin/python bench/rollout_throughput.py                     # tiny + SmolLM2-135M
    .venv/bin/python bench/rollout_throughput.py --models tiny-qwen3 --prompts 16 --n 8 --max-tokens 64
    .venv/bin/python bench/rollout_throughput.py --models smollm2-135m-instruct --min-prompt-tokens 300 --n 8

Goal: vLLM / transformers >= 5x tokens/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as in the actors
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = [f"What is {a} + {b}? Answer with a number." for a, b in
             [(3, 4), (12, 9), (7, 21), (5, 5), (18, 27), (40, 2), (9, 9), (33, 11), (6, 14), (25, 25),
              (1, 99), (64, 36), (8, 16), (70, 7), (13, 31), (2, 2)]]


PREAMBLE = "Solve the problem step by step, check each step, and end with the answer as a single number. "


def prompts_for(model_path: Path, count: int, min_tokens: int = 0) -> tuple[list[list[int]], int | None]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)

    def encoded(question: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    prompts = []
    for q in (QUESTIONS * (count // len(QUESTIONS) + 1))[:count]:
        while len(ids := encoded(q)) < min_tokens:
            q = PREAMBLE + q
        prompts.append(ids)
    return prompts, tok.eos_token_id


def generated_tokens(rows: list[list[int]], eos: int | None) -> int:
    total = 0
    for row in rows:
        total += row.index(eos) + 1 if eos is not None and eos in row else len(row)
    return total


def bench_vllm(model_path: Path, prompts, n: int, max_tokens: int, temperature: float, repeat: int,
               prefix_caching: bool) -> tuple[float, list]:
    """Best tokens/s, and every timed round's (tokens, log-probs) per request."""
    from vime_engine.rollout.vllm_engine import DeviceTuning, EngineSettings, Request, SamplingSettings, VLLMEngine

    engine = VLLMEngine(EngineSettings(str(model_path), kv_cache_bytes=1 << 30,
                                       tuning=DeviceTuning(enable_prefix_caching=prefix_caching)))
    sampling = SamplingSettings(max_tokens=max_tokens, temperature=temperature)

    def requests(seed: int) -> list[Request]:
        return [Request(f"{i}/{j}", p, max_tokens, seed + i * n + j) for i, p in enumerate(prompts) for j in range(n)]

    engine.generate(requests(0), sampling)  # warm-up at the timed shape
    best, outputs = 0.0, []
    for r in range(repeat):
        engine.llm.reset_prefix_cache()  # what every weight sync does: nothing cached from an earlier round
        start = time.perf_counter()
        completions = engine.generate(requests(r * 1000 + 1), sampling)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for c in completions)
        best = max(best, tokens / seconds)
        outputs.append([(c.token_ids, c.log_probs) for c in completions])
    del engine
    return best, outputs


def compare(a: list, b: list) -> str:
    """How far two runs of the same requests apart are: samples with other tokens, largest log-prob gap."""
    pairs = [(x, y) for round_a, round_b in zip(a, b) for x, y in zip(round_a, round_b)]
    other_tokens = sum(x[0] != y[0] for x, y in pairs)
    gaps = [0.0]
    for (tokens_a, lp_a), (tokens_b, lp_b) in pairs:
        for ta, tb, p, q in zip(tokens_a, tokens_b, lp_a, lp_b):
            if ta != tb:
                break
            gaps.append(abs(p - q))
    same = sum(x == y for x, y in pairs)
    return (f"{same}/{len(pairs)} samples identical (tokens and log-probs), {other_tokens} with other tokens, "
            f"largest log-prob gap {max(gaps):.3g} (before the first differing token)")


def bench_hf(model_path: Path, prompts, n: int, max_tokens: int, temperature: float, eos, repeat: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])  # left padding for decoder-only
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])

    def run(batch_ids, batch_mask):
        with torch.no_grad():
            out = model.generate(
                input_ids=batch_ids, attention_mask=batch_mask, do_sample=True, temperature=temperature, top_p=1.0,
                top_k=0, num_return_sequences=n, max_new_tokens=max_tokens, pad_token_id=pad, eos_token_id=eos,
            )
        return out[:, batch_ids.shape[1]:].tolist()

    run(ids, mask)  # warm-up at the timed shape
    best = 0.0
    for r in range(repeat):
        torch.manual_seed(r)
        start = time.perf_counter()
        rows = run(ids, mask)
        seconds = time.perf_counter() - start
        best = max(best, generated_tokens(rows, eos) / seconds)
    return best


def main() -> None:
    from vime_engine.models.builtin import materialize_builtin_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-qwen3", "smollm2-135m-instruct"])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vf_bench"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--min-prompt-tokens", type=int, default=0)
    parser.add_argument("--prefix-caching", nargs="+", choices=["on", "off"], default=["on", "off"])
    parser.add_argument("--skip-transformers", action="store_true", help="time vLLM only")
    args = parser.parse_args()

    import torch

    print(f"torch threads: {torch.get_num_threads()}; {args.prompts} prompts x {args.n} samples, "
          f"<= {args.max_tokens} new tokens, T={args.temperature}, fp32")
    for name in args.models:
        path = materialize_builtin_model(name, args.cache / name)
        prompts, eos = prompts_for(path, args.prompts, args.min_prompt_tokens)
        lengths = sorted(len(p) for p in prompts)
        print(f"{name}: prompt tokens {lengths[0]}..{lengths[-1]}", flush=True)
        hf = None if args.skip_transformers else bench_hf(
            path, prompts, args.n, args.max_tokens, args.temperature, eos, args.repeat)
        outputs = {}
        for setting in args.prefix_caching:
            ours, outputs[setting] = bench_vllm(path, prompts, args.n, args.max_tokens, args.temperature,
                                                args.repeat, prefix_caching=setting == "on")
            versus = "" if hf is None else f"   transformers {hf:8.0f} tok/s   ratio {ours / hf:6.1f}x (goal >= 5x)"
            print(f"{name:24s} vLLM, prefix caching {setting:3s} {ours:9.0f} tok/s{versus}", flush=True)
        if len(outputs) == 2:
            print(f"{name:24s} prefix caching on vs off: {compare(outputs['on'], outputs['off'])}")


if __name__ == "__main__":
    main()
