"""`--rollout-mode server`: the server's command line is the in-process engine's, the generate payload carries
each request's seed, a response becomes the Completion the in-process engine would give, and what server mode
cannot run yet is refused naming the flag."""

from __future__ import annotations

import pytest

from vime_engine.config import ConfigError, build_config
from vime_engine.rollout.server.router import RouterOptions, router_argv
from vime_engine.rollout.server.router_engine import generate_payload, parse_completion
from vime_engine.rollout.server.vllm_server import WEIGHT_EXTENSION, server_argv
from vime_engine.rollout.vllm_engine import DeviceTuning, EngineSettings, Request, SamplingSettings
from vime_engine.runtime.placement import with_placement_decided
from vime_engine.sample import SampleStatus

REQUIRED = {"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"}


def _flag_values(argv: list[str]) -> dict[str, str | None]:
    """`--flag value` and bare `--flag` pairs of a command line (after the module)."""
    out, i = {}, argv.index("vllm.entrypoints.openai.api_server") + 1
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        out[argv[i]] = value
        i += 1 if value is None else 2
    return out


def test_a_cpu_server_runs_the_in_process_engine_with_the_server_endpoints():
    settings = EngineSettings("/models/m", max_model_len=512, seed=7, kv_cache_bytes=2**28, tensor_parallel_size=2)
    flags = _flag_values(server_argv(settings, "cpu", "127.0.0.1", 8100))
    assert flags["--model"] == "/models/m" and flags["--seed"] == "7" and flags["--max-model-len"] == "512"
    assert flags["--tensor-parallel-size"] == "2" and flags["--kv-cache-memory-bytes"] == str(2**28)
    assert flags["--logprobs-mode"] == "processed_logprobs"  # the trainer's log_softmax(logits / T)
    # vLLM's CPU choices (device_engine_kwargs): eager, no prefix caching, whole prompts in one step
    assert "--enforce-eager" in flags and "--no-enable-prefix-caching" in flags
    assert "--no-enable-chunked-prefill" in flags and flags["--max-num-batched-tokens"] == "16384"
    assert "--enable-scale-out" in flags  # /inference/v1/generate
    assert flags["--worker-extension-cls"] == WEIGHT_EXTENSION
    assert (flags["--host"], flags["--port"]) == ("127.0.0.1", "8100")


def test_an_accelerator_server_keeps_the_devices_choices_and_the_users():
    flags = _flag_values(server_argv(
        EngineSettings("/m", max_model_len=4096, tuning=DeviceTuning(enable_prefix_caching=False)),
        "cuda", "10.0.0.2", 8100))
    assert "--enforce-eager" not in flags and "--enable-chunked-prefill" in flags
    assert "--no-enable-prefix-caching" in flags  # the user's --vllm-enable-prefix-caching false
    assert "--kv-cache-memory-bytes" not in flags and "--max-num-batched-tokens" not in flags
    with pytest.raises(ValueError, match="--vllm-enable-chunked-prefill"):
        server_argv(EngineSettings("/m", max_model_len=512, tuning=DeviceTuning(enable_chunked_prefill=True)),
                    "cpu", "h", 1)


def test_the_router_starts_with_vimes_policy_and_timeout():
    argv = router_argv(RouterOptions(policy="round_robin", request_timeout_secs=60), "127.0.0.1", 9000, 9001)
    assert argv[0].endswith("vllm-router")
    assert argv[1:] == ["--host", "127.0.0.1", "--port", "9000", "--policy", "round_robin",
                        "--request-timeout-secs", "60", "--prometheus-host", "127.0.0.1", "--prometheus-port", "9001"]


def test_a_request_carries_its_seed_and_a_response_becomes_a_completion():
    payload = generate_payload(Request("3/1", [5, 6, 7], 16, seed=1234), SamplingSettings(16, 0.7, 0.9, 20))
    assert payload["request_id"] == "3/1" and payload["token_ids"] == [5, 6, 7]
    assert payload["sampling_params"] == {"max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                          "seed": 1234, "logprobs": 0, "detokenize": False}

    def response(reason, tokens=(11, 12), log_probs=(-0.5, -1.5)):
        return {"request_id": "3/1", "choices": [{
            "index": 0, "finish_reason": reason, "token_ids": list(tokens),
            "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, log_probs)]},
            "weight_versions": [{"version": "4", "start": 0, "end": len(tokens)}]}]}

    completion, version = parse_completion("3/1", response("stop"))
    assert (completion.token_ids, completion.log_probs, completion.status) == ([11, 12], [-0.5, -1.5],
                                                                                SampleStatus.COMPLETED)
    assert version == "4"
    assert parse_completion("3/1", response("length"))[0].status is SampleStatus.TRUNCATED
    assert parse_completion("3/1", response("abort"))[0].status is SampleStatus.ABORTED
    with pytest.raises(RuntimeError, match="2 tokens but 1 log-probs"):
        parse_completion("3/1", response("stop", log_probs=(-0.5,)))


@pytest.mark.parametrize(("flags", "named"), [
    (["--colocate"], "drop --colocate"),
    (["--weight-sync", "broadcast"], "--weight-sync object_store"),
    (["--partial-rollout", "--over-sampling-batch-size", "16"], "--partial-rollout"),
    (["--over-sampling-batch-size", "16"], "--over-sampling-batch-size"),
])
def test_what_server_mode_cannot_run_yet_is_refused(flags, named):
    with pytest.raises(ConfigError, match="--rollout-mode server") as refused:
        build_config(["--rollout-mode", "server", *flags], **REQUIRED)
    assert named in str(refused.value)
    build_config(flags, **REQUIRED)  # each is fine in process


def test_an_existing_router_is_named_by_both_flags_and_only_in_server_mode():
    with pytest.raises(ConfigError, match="give both"):
        build_config(["--rollout-mode", "server", "--vllm-router-ip", "10.0.0.1"], **REQUIRED)
    with pytest.raises(ConfigError, match="add --rollout-mode server"):
        build_config(["--vllm-router-ip", "10.0.0.1", "--vllm-router-port", "8000"], **REQUIRED)
    build_config(["--rollout-mode", "server", "--vllm-router-ip", "10.0.0.1", "--vllm-router-port", "8000"],
                 **REQUIRED)


def test_server_mode_places_the_engines_on_their_own_actors():
    cfg = build_config(["--rollout-mode", "server"], **REQUIRED)
    assert with_placement_decided(cfg, "cpu").placement.colocate is False
    assert with_placement_decided(build_config([], **REQUIRED), "cpu").placement.colocate is True
