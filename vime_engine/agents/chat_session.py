"""An agent written against the OpenAI API, trained: its episode through the router's `/v1/chat/completions` as
one multi-turn Sample (the pattern for agents outside the driver, `--rollout-mode server`).

The agent gets an `openai.AsyncOpenAI` client (`ChatSession.client()`) whose base URL is the run's router, and
makes its chat completions as it would against any OpenAI-compatible server; between them it does what it likes
(tools, environments, other services). The client's transport turns each completion into one the trainer can use:
- the session's id goes along as `x-session-id` (the router's consistent hash keeps the episode on one server)
  and each turn draws from a seed of its own (the sample's seed and the turn's number, replacing any the agent
  gave), with the run's temperature, top-p and top-k, at most `--rollout-max-response-len` tokens and what the
  context has room for;
- vLLM is asked for the token ids of the prompt and of the answer (`return_token_ids`) and the sampled tokens'
  log-probs (`logprobs`), which the session keeps;
- from the second turn on, the model is given the conversation as token ids (`kv_transfer_params.prompt_token_ids`,
  which vLLM's chat endpoint takes instead of rendering `messages`): the previous turn's prompt and the tokens the
  model generated, then the chat template's rendering of what follows them (`between_turns`). Rendered from the
  agent's messages, the model's earlier answer would be its text tokenized again, which is often not the tokens it
  sampled (a BPE merge, a special token dropped from the text), and its log-probs would then belong to another
  sequence than the one trained.
The answer the agent reads is vLLM's own chat completion, tool-call parsing and all.

`ChatSession.into(sample)` makes the episode one Sample: the first turn's prompt, then for each turn what came
before it that the model did not write (the template's glue, the agent's tool and user messages: loss mask 0) and
its answer (loss mask 1, with its log-probs). The agent must extend its conversation, not rewrite it: each request
holds the previous one's messages, the model's answer, and at least one more message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from vime_engine.plugins.request_seeds import request_seed
from vime_engine.sample import Sample, SampleStatus

SESSION_HEADER = "x-session-id"
CHAT_PATH = "/chat/completions"
_STATUS = {"stop": SampleStatus.COMPLETED, "tool_calls": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED,
           "abort": SampleStatus.ABORTED}
# A stand-in answer whose place in the rendered text shows what the template writes after an assistant's answer.
_PROBE = "VIMEFLOW-END-OF-ANSWER-PROBE"


class ContextFull(RuntimeError):
    """The conversation leaves the model no room for another turn (`--rollout-max-context-len` or the engine's
    context); the episode ends TRUNCATED."""


@dataclass(frozen=True)
class ChatTurn:
    """One chat completion of an episode: the request's messages, the prompt the model was given, its answer."""

    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    output_ids: list[int]
    log_probs: list[float]
    finish_reason: str


def between_turns(tokenizer: Any, previous: list[dict[str, Any]], current: list[dict[str, Any]],
                  ended_with_eos: bool, **template_kwargs: Any) -> str:
    """The text the chat template puts between the end of the model's answer to `previous` and the start of its
    answer to `current` (= `previous`, that answer, one or more messages): what closes the answer (less the EOS
    when the model generated it), the messages added, the generation prompt. A ValueError when `current` does not
    extend `previous` so, or the template does not render the added messages after the conversation so far."""
    n = len(previous)
    if current[:n] != previous or len(current) < n + 2 or current[n].get("role") != "assistant":
        raise ValueError(f"a chat completion of the episode sent {len(current)} messages that are not the previous "
                         f"request's {n}, the model's answer and at least one more: an agent trained from its "
                         "episodes must extend its conversation, not rewrite it")

    def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             **template_kwargs)

    probed = render(previous + [{"role": "assistant", "content": _PROBE}], False)
    answered, full = render(current[:n + 1], False), render(current, True)
    if _PROBE not in probed or not full.startswith(answered):
        raise ValueError("the chat template does not render an assistant's answer, then the messages after it, as "
                         "text appended to the conversation: the episode's turns cannot be joined into one sample")
    closing = probed[probed.rindex(_PROBE) + len(_PROBE):]
    eos = tokenizer.eos_token
    if ended_with_eos:
        if not closing.startswith(eos):
            raise ValueError(f"the chat template closes an answer with {closing[:20]!r}, not the EOS {eos!r} the "
                             "model ended its answer with")
        closing = closing[len(eos):]
    return closing + full[len(answered):]


def response_segments(turns: list[ChatTurn]) -> list[tuple[list[int], list[float] | None]]:
    """The episode after its first prompt: for each turn, the tokens of its prompt past everything before it (not
    the model's: log-probs None) and its answer (with its log-probs), empty parts left out. A ValueError when a
    turn's prompt does not start with everything before it: the model then saw another conversation than the one
    the sample would train."""
    tokens = list(turns[0].prompt_ids)
    segments: list[tuple[list[int], list[float] | None]] = []
    for k, turn in enumerate(turns):
        if turn.prompt_ids[:len(tokens)] != tokens:
            raise ValueError(f"turn {k} of the episode was generated after a prompt that does not continue the "
                             "tokens before it; the server did not take the conversation's token ids")
        if between := turn.prompt_ids[len(tokens):]:
            segments.append((list(between), None))
        if turn.output_ids:
            segments.append((list(turn.output_ids), list(turn.log_probs)))
        tokens = list(turn.prompt_ids) + list(turn.output_ids)
    return segments


@dataclass
class ChatSession:
    """One episode's chat completions against the router at `router_url` (see the module's doc)."""

    router_url: str
    tokenizer: Any
    session_id: str
    sampling_seed: int
    max_tokens: int  # a turn's most new tokens (--rollout-max-response-len)
    context_limit: int  # a conversation's most tokens
    sampling: dict[str, Any]  # temperature, top_p, top_k: the run's
    timeout_s: float
    turns: list[ChatTurn] = field(default_factory=list)

    @classmethod
    def of(cls, args: Any, sample: Sample, sampling_params: dict[str, Any]) -> ChatSession:
        """The session of one sample's episode, from vime's `args` and the generate function's `sampling_params`."""
        if args.vllm_router_ip is None:
            raise ValueError("an OpenAI-API agent's episodes go through the run's router: run it with --rollout-mode "
                             "server")
        seed = int(sampling_params["sampling_seed"])
        limits = [n for n in (args.rollout_max_context_len, args.rollout_engine.max_model_len) if n]
        return cls(
            router_url=f"http://{args.vllm_router_ip}:{args.vllm_router_port}", tokenizer=args.rollout_engine.tokenizer,
            session_id=f"episode-{sample.group_index}-{seed}", sampling_seed=seed,
            max_tokens=int(sampling_params["max_new_tokens"]), context_limit=min(limits),
            sampling={"temperature": float(sampling_params.get("temperature", args.rollout_temperature)),
                      "top_p": float(sampling_params.get("top_p", 1.0)), "top_k": int(sampling_params.get("top_k", -1))},
            timeout_s=float(args.vllm_router_request_timeout_secs),
        )

    def client(self, transport: httpx.AsyncBaseTransport | None = None):
        """An `openai.AsyncOpenAI` client for the agent (close it, or use it as a context manager); `transport` is
        where the session's requests go (default: the network). The client does not retry: a request whose server
        died the router sends to another, and a turn the session refuses must end the episode at once (the agent's
        call raises the session's ContextFull or ValueError as it is)."""
        import openai

        http = httpx.AsyncClient(transport=_SessionTransport(self, transport or httpx.AsyncHTTPTransport()),
                                 timeout=self.timeout_s, trust_env=False)
        return openai.AsyncOpenAI(base_url=f"{self.router_url}/v1", api_key="unused", http_client=http,
                                  max_retries=0)

    def prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion `body` as it is posted: see the module's doc. ValueError for what the trainer
        cannot use (several choices, streaming, another temperature); ContextFull when no room is left."""
        for name, wanted in (("n", 1), ("stream", False)):
            if body.get(name, wanted) not in (wanted, None):
                raise ValueError(f"an OpenAI-API agent's chat completion with {name}={body[name]!r}: a trained episode "
                                 f"takes {name}={wanted!r}")
        temperature = body.get("temperature")
        if temperature is not None and float(temperature) != self.sampling["temperature"]:
            raise ValueError(f"an OpenAI-API agent asked for temperature {temperature}, but the trainer computes "
                             f"log-probs at --rollout-temperature {self.sampling['temperature']}: leave it out")
        turn = len(self.turns)
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.max_tokens
        sent = {k: v for k, v in body.items() if k != "max_tokens"}
        sent.update(self.sampling, seed=request_seed(self.sampling_seed, turn), return_token_ids=True, logprobs=True,
                    max_completion_tokens=min(int(asked), self.max_tokens))
        if turn:
            last = self.turns[-1]
            ended_with_eos = bool(last.output_ids) and last.output_ids[-1] == self.tokenizer.eos_token_id
            template = dict(body.get("chat_template_kwargs") or {})
            if body.get("tools"):  # the template renders them as the server did
                template["tools"] = body["tools"]
            glue = between_turns(self.tokenizer, last.messages, body["messages"], ended_with_eos, **template)
            prompt = last.prompt_ids + last.output_ids + self.tokenizer(glue, add_special_tokens=False)["input_ids"]
            room = self.context_limit - len(prompt)
            if room <= 0:
                raise ContextFull(f"turn {turn} of the episode would start at {len(prompt)} tokens, the limit being "
                                  f"{self.context_limit}")
            sent["max_completion_tokens"] = min(sent["max_completion_tokens"], room)
            sent["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), "prompt_token_ids": prompt}
        return sent

    def record(self, sent: dict[str, Any], answer: dict[str, Any]) -> None:
        """Keep the turn `sent` was answered with: its prompt, the answer's tokens and their log-probs."""
        choice = answer["choices"][0]
        output = [int(t) for t in choice.get("token_ids") or []]
        log_probs = [float(e["logprob"]) for e in (choice.get("logprobs") or {}).get("content") or []]
        prompt = [int(t) for t in answer.get("prompt_token_ids") or []]
        if not prompt or len(log_probs) != len(output):
            raise RuntimeError(f"the chat completion answered with {len(prompt)} prompt token ids, {len(output)} "
                               f"answer token ids and {len(log_probs)} log-probs: is the router's server vLLM's, "
                               "with return_token_ids?")
        spliced = (sent.get("kv_transfer_params") or {}).get("prompt_token_ids")
        if spliced is not None and prompt != spliced:
            raise RuntimeError(f"the server generated turn {len(self.turns)} after another prompt than the "
                               "conversation's token ids (kv_transfer_params.prompt_token_ids): it rendered the "
                               "messages instead")
        self.turns.append(ChatTurn(list(sent["messages"]), prompt, output, log_probs, choice.get("finish_reason")))

    def into(self, sample: Sample, weight_version: int, truncated: bool = False) -> Sample:
        """`sample` holding the episode: the first turn's prompt, then every turn (module's doc); its status that of
        the last turn's end, or TRUNCATED when the context ran out (`truncated`)."""
        if not self.turns:
            raise ValueError("the agent's episode made no chat completion: there is nothing to train")
        if sample.response_tokens:
            raise ValueError("an OpenAI-API agent's episode starts a sample afresh; this one holds a response already")
        sample.prompt_tokens = list(self.turns[0].prompt_ids)
        sample.prompt = self.tokenizer.decode(sample.prompt_tokens)
        meta = {"weight_version": weight_version}
        for tokens, log_probs in response_segments(self.turns):
            if log_probs is None:
                sample.append_response_tokens(tokens=tokens, trainable=False)
            else:
                sample.append_response_tokens(tokens=tokens, log_probs=log_probs, meta_info=meta)
        sample.status = SampleStatus.TRUNCATED if truncated else _STATUS.get(self.turns[-1].finish_reason,
                                                                             SampleStatus.COMPLETED)
        return sample


class _SessionTransport(httpx.AsyncBaseTransport):
    """The client's transport: chat completions go through the session (`prepare`, `record`), the rest as sent."""

    def __init__(self, session: ChatSession, inner: httpx.AsyncBaseTransport):
        self.session, self.inner = session, inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or not request.url.path.endswith(CHAT_PATH):
            return await self.inner.handle_async_request(request)
        sent = self.session.prepare(json.loads(await request.aread()))
        headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
        response = await self.inner.handle_async_request(httpx.Request(
            "POST", request.url, headers={**headers, SESSION_HEADER: self.session.session_id}, json=sent))
        content = await response.aread()
        if response.status_code == 200:
            self.session.record(sent, json.loads(content))
        kept = [(k, v) for k, v in response.headers.items()  # the content as read: decoded, whole
                if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=kept, content=content, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()
