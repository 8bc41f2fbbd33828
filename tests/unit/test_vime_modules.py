"""vime's plugin contract over HTTP: `vime.*` imports land on our modules (vime_engine/plugins/vime_modules/) and
never on top of a real vime, `post` retries as vime's does, every request a plugin posts carries the seed our
in-process engine would give it, and the built-in vime-style agents make samples the trainer can use, against a
stand-in router speaking vLLM's `/inference/v1/generate` (no vLLM here)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.http_server import Answer, StandIn
from vime_engine.agents.retrieval_server import CORPUS, retrieve, start_retrieval_server
from vime_engine.plugins.loading import import_function
from vime_engine.plugins.request_seeds import request_seed
from vime_engine.plugins.vime_args import VimeArgs
from vime_engine.plugins.vime_modules import http_utils, vllm_rollout
from vime_engine.rollout.custom_generate import FLAG, TOOL_CALLS, WANTED, check_returned
from vime_engine.sample import ENVIRONMENT_LOG_PROB, Sample, SampleStatus

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 7}


@pytest.fixture
def serve():
    started: list[StandIn] = []

    def start(answer: Answer) -> StandIn:
        started.append(StandIn(answer).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()


def _run_python(code: str, path: Path | None = None) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (nothing imported, no finder installed), `path` first on sys.path."""
    env_path = f"{path}:{ROOT}" if path else str(ROOT)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=120)


def test_vime_and_slime_module_names_are_our_modules_once_installed():
    result = _run_python("""
        import sys
        from vime_engine.plugins.vime_modules import install_vime_modules
        from vime_engine.plugins.vime_modules import http_utils, misc, vllm_rollout
        import vime_engine.sample
        assert install_vime_modules() == install_vime_modules() == {"vime", "slime"}
        assert sum(type(f).__name__ == "VimeModuleFinder" for f in sys.meta_path) == 1  # idempotent
        from vime.utils.http_utils import post
        from vime.rollout.vllm_rollout import GenerateState, _build_inference_sampling_params
        from vime.utils.types import Sample
        from vime.utils.misc import load_function
        from slime.rollout.sglang_rollout import GenerateState as SlimeState
        from slime.rollout.vllm_rollout import _inference_generate_tokens_and_logprobs
        from slime.utils.http_utils import post as slime_post
        assert post is slime_post is http_utils.post and GenerateState is SlimeState is vllm_rollout.GenerateState
        assert Sample is vime_engine.sample.Sample and load_function is misc.load_function
        assert http_utils.__spec__.name == "vime_engine.plugins.vime_modules.http_utils"  # keeps its own name
        assert load_function("vime.utils.types.Sample") is Sample
        try:
            import vime.utils.data
        except ModuleNotFoundError as exc:
            print(exc)
    """)
    assert result.returncode == 0, result.stderr
    assert "No module named 'vime.utils.data': vime is not installed, and vimeflow stands in only for " \
           "vime.rollout.vllm_rollout, vime.utils.http_utils" in result.stdout


def test_a_real_vime_is_never_shadowed(tmp_path):
    (tmp_path / "vime").mkdir()
    (tmp_path / "vime" / "__init__.py").write_text("REAL = True\n")
    later = tmp_path / "later"
    (later / "slime").mkdir(parents=True)
    (later / "slime" / "__init__.py").write_text("REAL = True\n")
    result = _run_python(f"""
        import sys
        from vime_engine.plugins.vime_modules import install_vime_modules
        assert install_vime_modules() == {{"slime"}}  # vime is installed: left alone
        import vime
        assert vime.REAL
        try:
            import vime.utils.http_utils
        except ModuleNotFoundError as exc:
            assert "vimeflow" not in str(exc), exc  # the real vime's own error, not ours
        else:
            raise AssertionError("the real vime was given our http_utils")
        sys.path.insert(0, {str(later)!r})  # a slime installed after the finder: the finder is asked last
        import slime
        assert slime.REAL
    """, tmp_path)
    assert result.returncode == 0, result.stderr


def test_a_plugin_file_importing_vime_helpers_loads(tmp_path):
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(textwrap.dedent("""
        from vime.rollout.vllm_rollout import GenerateState, _build_inference_sampling_params
        from vime.utils.http_utils import post
        from vime.utils.types import Sample

        async def generate(args, sample: Sample, sampling_params) -> Sample:
            return sample
    """))
    fn = import_function(f"{plugin}:generate", FLAG, WANTED)
    assert fn.__globals__["Sample"] is Sample and fn.__globals__["post"] is http_utils.post


def test_post_retries_until_the_service_answers(serve, monkeypatch):
    monkeypatch.setattr(http_utils, "RETRY_DELAY_S", 0.0)
    answers = iter([(503, {"error": "starting"}), (500, "oops"), (200, {"ok": True})])
    flaky = serve(lambda path, headers, body: next(answers))
    assert asyncio.run(http_utils.post(flaky.url + "/tool", {"x": 1})) == {"ok": True}
    assert [body for _, _, body in flaky.requests] == [{"x": 1}] * 3

    down = serve(lambda path, headers, body: (503, {"error": "down"}))
    with pytest.raises(httpx.HTTPStatusError, match="503"):
        asyncio.run(http_utils.post(down.url + "/tool", {}, max_retries=2))
    assert len(down.requests) == 2  # max_retries attempts in all, as vime counts them

    text = serve(lambda path, headers, body: (200, "plain text"))
    assert asyncio.run(http_utils.post(text.url, {})) == "plain text"


def test_every_generate_request_carries_the_seed_of_its_sample_and_input_length(serve):
    router = serve(lambda path, headers, body: (200, _choice([5], [-0.1])))
    params = vllm_rollout._build_inference_sampling_params(SAMPLING)
    assert params == {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": 0,
                      "detokenize": False}
    url = router.url + "/inference/v1/generate"
    for token_ids in ([1, 2, 3], [1, 2, 3, 5, 8]):  # one sampling_params for every turn, as vime's plugins do
        asyncio.run(http_utils.post(url, {"token_ids": token_ids, "sampling_params": params},
                                    headers={"x-session-id": "4"}))
    assert [(path, headers["x-session-id"], body["sampling_params"]["seed"]) for path, headers, body in
            router.requests] == [("/inference/v1/generate", "4", request_seed(7, 3)),
                                 ("/inference/v1/generate", "4", request_seed(7, 5))]
    assert "seed" not in params  # the caller's dict is left as it was

    explicit = vllm_rollout._build_inference_sampling_params({**SAMPLING, "seed": 99})
    asyncio.run(http_utils.post(url, {"token_ids": [1], "sampling_params": explicit}))
    assert router.requests[-1][2]["sampling_params"]["seed"] == 99  # vime's own per-request seed, kept
    with pytest.raises(ValueError, match="without a seed"):
        asyncio.run(http_utils.post(url, {"token_ids": [1], "sampling_params": dict(params)}))
    with pytest.raises(ValueError, match=r"unsupported sampling parameters \['stop'\]"):
        vllm_rollout._build_inference_sampling_params({**SAMPLING, "stop": ["\n"]})


def test_a_choice_reads_as_vime_reads_it():
    choice = _choice([11, 12], [-0.5, -1.5], version="3")["choices"][0]
    assert vllm_rollout._inference_generate_tokens_and_logprobs(choice) == ([11, 12], [-0.5, -1.5])
    assert vllm_rollout._vllm_meta_from_generate_choice(None, choice, {"prompt_tokens": 4, "completion_tokens": 2}) \
        == {"finish_reason": {"type": "stop"}, "weight_version": "3", "prompt_tokens": 4, "completion_tokens": 2}
    assert vllm_rollout._vllm_meta_from_generate_choice(None, {**choice, "finish_reason": "cancelled"})[
        "finish_reason"] == {"type": "abort"}
    with pytest.raises(RuntimeError, match="2 tokens but 1 log-probs"):
        vllm_rollout._inference_generate_tokens_and_logprobs(_choice([11, 12], [-0.5])["choices"][0])
    args = VimeArgs({"vllm_router_ip": "10.0.0.1", "vllm_router_port": 3000})
    assert vllm_rollout.get_model_url(args, "actor") == "http://10.0.0.1:3000/inference/v1/generate"


def test_retrieval_ranks_passages_by_shared_words():
    assert [p["title"] for p in retrieve(CORPUS, "What is the capital of France?", topk=2)] == ["Paris", "Berlin"]
    assert retrieve(CORPUS, "the of a", topk=3) == []


def test_the_search_agent_appends_the_passages_unmasked_between_its_two_turns(serve, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    router = serve(_scripted(tokenizer, ["<search>capital of France</search>", "<answer>Paris</answer>"]))
    retrieval = start_retrieval_server()
    try:
        sample = _sample(tokenizer, metadata={"search_url": retrieval.url})
        generate = import_function("vime_engine.agents.search_generate:generate", FLAG, WANTED)
        sample = asyncio.run(generate(_args(tiny_model, router), sample, dict(SAMPLING)))
    finally:
        retrieval.close()
    first, second = (len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in
                     ("<search>capital of France</search>", "<answer>Paris</answer>"))
    _assert_two_turns(sample, router, first, second)
    assert "<information>Doc 1(Title: Paris) Paris is the capital" in sample.response


def test_the_search_agent_stops_when_the_passages_would_fill_the_context(serve, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    turn = "<search>capital of France</search>"
    router = serve(_scripted(tokenizer, [turn]))
    retrieval = start_retrieval_server()
    try:
        sample = _sample(tokenizer, metadata={"search_url": retrieval.url})
        cap = len(sample.prompt_tokens) + len(tokenizer(turn, add_special_tokens=False)["input_ids"]) + 5
        generate = import_function("vime_engine.agents.search_generate:generate", FLAG, WANTED)
        sample = asyncio.run(generate(_args(tiny_model, router, rollout_max_context_len=cap), sample, SAMPLING))
    finally:
        retrieval.close()
    assert sample.status is SampleStatus.TRUNCATED and set(sample.loss_mask) == {1} and len(router.requests) == 1
    check_returned(sample, "4/0", None, cap, aborting=False)


def test_the_sandbox_agent_runs_the_models_code_and_appends_its_output_unmasked(serve, tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    turns = ["```python\nprint(6 * 7)\n```", "The answer is 42."]
    router = serve(_scripted(tokenizer, turns))
    generate = import_function("vime_engine.agents.sandbox_tool_generate:generate", FLAG, WANTED)
    sample = asyncio.run(generate(_args(tiny_model, router), _sample(tokenizer), dict(SAMPLING)))
    first, second = (len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in turns)
    _assert_two_turns(sample, router, first, second)
    assert "<output>\n42\n</output>" in sample.response


def _choice(tokens: list[int], log_probs: list[float], reason: str = "stop", version: str = "2") -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": reason, "token_ids": tokens,
                         "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, log_probs)]},
                         "weight_versions": [{"version": version, "start": 0, "end": len(tokens)}]}]}


def _scripted(tokenizer: Any, turns: list[str]) -> Answer:
    """A router whose model says `turns`, one a request (cut at its max_tokens), each token with log-prob -0.25."""
    replies = iter(turns)

    def answer(path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        tokens = tokenizer(next(replies), add_special_tokens=False)["input_ids"]
        budget = body["sampling_params"]["max_tokens"]
        return 200, _choice(tokens[:budget], [-0.25] * min(budget, len(tokens)),
                            "length" if len(tokens) > budget else "stop")

    return answer


def _args(model: Path, router: StandIn, **flags: Any) -> VimeArgs:
    vllm_rollout.GenerateState.clear_instances()
    host, port = router.url.removeprefix("http://").split(":")
    return VimeArgs({"hf_checkpoint": str(model), "vllm_router_ip": host, "vllm_router_port": int(port),
                     "partial_rollout": False, "rollout_max_context_len": None, "vllm_max_model_len": None,
                     "rollout_max_turns": None, "rollout_temperature": 1.0, "rollout_top_p": 1.0, "rollout_top_k": -1,
                     "rollout_max_response_len": 64, **flags})


def _sample(tokenizer: Any, **fields: Any) -> Sample:
    prompt = "What is the capital of France?"
    return Sample(group_index=4, prompt=prompt, label="Paris",
                  prompt_tokens=tokenizer(prompt, add_special_tokens=False)["input_ids"], **fields)


def _assert_two_turns(sample: Sample, router: StandIn, first: int, second: int) -> None:
    """Model turn (mask 1), tool reply (mask 0, placeholder log-probs), model turn; each request seeded by its input
    length and sent with the group as the session; what the trainer's checks accept."""
    observation = len(sample.response_tokens) - first - second
    assert observation > 0 and sample.status is SampleStatus.COMPLETED
    assert sample.loss_mask == [1] * first + [0] * observation + [1] * second
    assert sample.rollout_log_probs == [-0.25] * first + [ENVIRONMENT_LOG_PROB] * observation + [-0.25] * second
    assert sample.version_segments == [(2, first + second)] and sample.metadata[TOOL_CALLS] == 1
    bodies = [body for _, _, body in router.requests]
    assert [len(b["token_ids"]) for b in bodies] == [len(sample.prompt_tokens),
                                                      len(sample.prompt_tokens) + first + observation]
    assert [b["sampling_params"]["seed"] for b in bodies] == [request_seed(7, len(b["token_ids"])) for b in bodies]
    assert {headers["x-session-id"] for _, headers, _ in router.requests} == {"4"}
    assert bodies[1]["token_ids"] == sample.tokens[:len(bodies[1]["token_ids"])]
    check_returned(sample, "4/0", None, None, aborting=False)
