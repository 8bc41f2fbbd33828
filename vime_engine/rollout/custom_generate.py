"""`--custom-generate-function-path`: vime's `async generate(args, sample, sampling_params) -> Sample`, run on
our step-driven vLLM engine, e.g. a multi-turn agent that calls tools between the model's turns.

How a generate function reaches the engine. vime's functions POST `{"token_ids", "sampling_params"}` to the
router's `/inference/v1/generate` (slime's `{"input_ids", ...}` to an SGLang router); in server mode those run
unchanged (`--rollout-mode server`: vime_engine/plugins/vime_modules/ provides the helpers they import). In
process they call `await args.rollout_engine.generate(input_ids, sampling_params)`, an in-process client of the
rollout worker's engine (`args` is vime's read-only namespace, vime_engine/plugins/vime_args.py, with this
one attribute added). It returns a `GenerateOutput` whose `meta_info` has SGLang's shape (`output_token_logprobs`,
`finish_reason`, `weight_version`), so porting a slime function means replacing its `post(url, payload)` line.
We chose a call over an HTTP endpoint for three reasons: (1) determinism, below; (2) partial rollout: when the
driver cuts a round off, every pending call returns at once with finish_reason "abort" and what it had, and the
function returns the sample as it stands (status ABORTED), to be continued in the next rollout from its tokens;
(3) nothing to bind, secure or keep alive on every rollout engine.

Determinism. Every sample's function runs as a task on a private event loop that `CustomRound` drives between
engine steps: it runs every task until each waits on the engine (or has returned), submits the waiting requests
in order of sample key, steps the engine once, hands finished requests back in the engine's order, and again.
vLLM's step loop is deterministic given the requests submitted before each step, so a round of conversations is
too, wherever an abort falls. A request's seed mixes the sample's seed (`sampling_params["sampling_seed"]`, set
per sample as for plain generation) with the number of input tokens: each turn draws independently, and a turn
generated again after a resume draws the same.

What a function may return: one Sample whose `response_tokens`, `rollout_log_probs` and `loss_mask` have equal
lengths (model tokens loss_mask 1 with their log-probs, tool tokens 0 with a placeholder log-prob), within
`--rollout-max-turns` model turns and `--rollout-max-context-len` tokens, with status COMPLETED or TRUNCATED
(ABORTED only when its round was cut off). A list of Samples (vime's one-sample-per-turn form) is refused: GRPO
groups here hold `--n-samples-per-prompt` samples, and one multi-turn sample holds every turn.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vime_engine.plugins.loading import check_callable, import_function
from vime_engine.plugins.request_seeds import request_seed
from vime_engine.rollout.vllm_engine import Request, SamplingSettings, VLLMEngine
from vime_engine.sample import Sample, SampleStatus

FLAG = "--custom-generate-function-path"
WANTED = "`async (args, sample: Sample, sampling_params: dict) -> Sample`"
GenerateFunction = Callable[[Any, Sample, dict[str, Any]], Awaitable[Sample]]
# The sampling parameters a function may pass (SGLang's names); the trainer's log-probs assume the run's temperature.
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed")
_FINISH = {SampleStatus.COMPLETED: "stop", SampleStatus.TRUNCATED: "length", SampleStatus.ABORTED: "abort"}
# The metadata key a generate function may set to the number of tool calls in a sample; the driver then logs
# rollout/tool_call_share, the share of samples that called a tool.
TOOL_CALLS = "tool_calls"
_calling_sample: contextvars.ContextVar[str] = contextvars.ContextVar("calling_sample")


def load_generate_function(spec: str) -> GenerateFunction:
    fn = check_callable(import_function(spec, FLAG, WANTED), spec, FLAG, ("args", "sample", "sampling_params"),
                        WANTED, allow_async=True)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{FLAG} {spec!r}: the function is not async; it must be {WANTED}")
    return fn


@dataclass(frozen=True)
class GenerateOutput:
    """One generation call's tokens, their log-probs, and why it ended: "stop", "length" or "abort"."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    weight_version: int

    @property
    def meta_info(self) -> dict[str, Any]:
        """SGLang's `meta_info` of this output, for functions written against it."""
        return {
            "output_token_logprobs": [(lp, tok, None) for lp, tok in zip(self.log_probs, self.token_ids)],
            "finish_reason": {"type": self.finish_reason},
            "weight_version": self.weight_version,
            "completion_tokens": len(self.token_ids),
        }


class EngineClient:
    """`args.rollout_engine`: what a generate function calls. Requests wait in the client until `CustomRound`
    submits them between engine steps."""

    def __init__(self, engine: VLLMEngine, temperature: float, max_context_len: int | None, tokenizer: Any):
        self.engine, self.temperature, self.max_context_len = engine, temperature, max_context_len
        self.tokenizer = tokenizer  # the model's tokenizer, for rendering turns through its chat template
        self.waiting: dict[tuple[int, ...], tuple[Request, SamplingSettings, asyncio.Future]] = {}
        self.aborting = False
        self._calls = 0
        self.changed: asyncio.Event | None = None

    @property
    def weight_version(self) -> int:
        """The weights the engine holds (in server mode: the servers behind the router, all synced to it)."""
        return self.engine.weight_version

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> GenerateOutput:
        """Generate one continuation of `input_ids`: up to `max_new_tokens`, fewer if the context cap is near."""
        unknown = sorted(set(sampling_params) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"args.rollout_engine.generate: unsupported sampling parameters {unknown}; "
                             f"it takes {', '.join(SAMPLING_KEYS)}")
        temperature = float(sampling_params.get("temperature", self.temperature))
        if temperature != self.temperature:
            raise ValueError(f"args.rollout_engine.generate: temperature {temperature} differs from "
                             f"--rollout-temperature {self.temperature}, at which the trainer computes log-probs")
        budget = int(sampling_params["max_new_tokens"])
        limits = [self.max_model_len] + ([self.max_context_len] if self.max_context_len else [])
        budget = min(budget, *(limit - len(input_ids) for limit in limits))
        if self.aborting or budget <= 0:
            return GenerateOutput([], [], "abort" if self.aborting else "length", self.weight_version)
        key = (*map(int, _calling_sample.get().split("/")), self._calls)
        self._calls += 1
        seed = request_seed(int(sampling_params["sampling_seed"]), len(input_ids))
        request = Request("/".join(map(str, key)), list(input_ids), budget, seed)
        sampling = SamplingSettings(budget, temperature, float(sampling_params.get("top_p", 1.0)),
                                    int(sampling_params.get("top_k", -1)))
        future = asyncio.get_running_loop().create_future()
        self.waiting[key] = (request, sampling, future)
        self.changed.set()
        return await future


class CustomRound:
    """A round of samples generated by the custom function, driven step by step like the engine itself."""

    def __init__(self, fn: GenerateFunction, args: Any, client: EngineClient,
                 jobs: list[tuple[str, Sample, dict[str, Any]]], max_turns: int | None):
        self.fn, self.args, self.client, self.max_turns = fn, args, client, max_turns
        self.loop = asyncio.new_event_loop()
        self.client.changed = asyncio.Event()  # created outside the loop: bound to it on first use (3.10+)
        self.client.aborting = False
        self.submitted: dict[str, tuple[int, ...]] = {}  # engine request id -> client key
        self.tasks: dict[str, asyncio.Task] = {}
        for key, sample, params in jobs:
            context = contextvars.copy_context()
            context.run(_calling_sample.set, key)
            self.tasks[key] = self.loop.create_task(self._run(sample, params), context=context)
        self._settle()

    @property
    def running(self) -> bool:
        return bool(self.tasks)

    async def _run(self, sample: Sample, params: dict[str, Any]) -> Sample:
        try:
            return await self.fn(self.args, sample, dict(params))
        finally:
            self.client.changed.set()

    def step(self) -> list[tuple[str, Sample]]:
        """One engine step (if anything waits on it); the samples whose functions returned, by key."""
        if self.client.engine.running:
            for c in self.client.engine.step():
                self._resolve(c.key, c.token_ids, c.log_probs, _FINISH[c.status])
        self._settle()
        done = self._collect()
        if not self.tasks:
            self.loop.close()
        return done

    def abort(self) -> list[tuple[str, Sample]]:
        """Cut every conversation off: pending calls return "abort" with what they had; every sample, by key."""
        if not self.tasks:  # every function has returned (and the loop is closed)
            return []
        self.client.aborting = True
        for c in self.client.engine.abort():
            self._resolve(c.key, c.token_ids, c.log_probs, "abort")
        self._settle()
        done = self._collect()
        if self.tasks:
            raise RuntimeError(f"{FLAG}: samples {sorted(self.tasks)} did not return after their round was aborted")
        self.loop.close()
        return done

    def _resolve(self, request_id: str, tokens: list[int], log_probs: list[float], finish: str) -> None:
        key = tuple(map(int, request_id.split("/")))
        _, _, future = self.client.waiting.pop(key)
        future.set_result(GenerateOutput(list(tokens), list(log_probs), finish, self.client.weight_version))

    def _settle(self) -> None:
        """Run the tasks until each has returned or waits on an engine request; then submit those, in key order."""
        self.loop.run_until_complete(self._quiet())
        fresh = sorted(k for k in self.client.waiting if "/".join(map(str, k)) not in self.submitted)
        for key in fresh:  # none while aborting: calls made then are answered at once
            request, sampling, _ = self.client.waiting[key]
            self.client.engine.submit([request], sampling, join_running=True)
            self.submitted[request.key] = key

    async def _quiet(self) -> None:
        changed = self.client.changed
        while True:
            changed.clear()
            await asyncio.sleep(0)  # let every runnable task reach its next wait
            waiting_tasks = len({k[:2] for k, (_, _, f) in self.client.waiting.items() if not f.done()})
            if all(t.done() for t in self.tasks.values()) or waiting_tasks >= sum(
                    not t.done() for t in self.tasks.values()):
                return
            await changed.wait()

    def _collect(self) -> list[tuple[str, Sample]]:
        done = []
        for key in sorted((k for k, t in self.tasks.items() if t.done()), key=lambda k: tuple(map(int, k.split("/")))):
            task = self.tasks.pop(key)
            sample = task.result()  # a function's exception ends the round with its own traceback
            check_returned(sample, key, self.max_turns, self.client.max_context_len, self.client.aborting)
            done.append((key, sample))
        return done


def model_turns(loss_mask: list[int]) -> int:
    """The model's turns in a response: maximal runs of trained (loss_mask 1) tokens."""
    return sum(1 for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1]))


def check_returned(sample: Any, key: str, max_turns: int | None, max_context_len: int | None,
                   aborting: bool) -> None:
    """Raise ValueError, naming the sample and the rule, unless `sample` is a Sample the trainer can use."""
    where = f"{FLAG}: sample {key}"
    if isinstance(sample, list):
        raise ValueError(f"{where}: returned a list of {len(sample)} samples; return one Sample holding every turn "
                         "(GRPO groups here are --n-samples-per-prompt samples, one per conversation)")
    if not isinstance(sample, Sample):
        raise ValueError(f"{where}: returned {type(sample).__name__}, not a Sample")
    n = len(sample.response_tokens)
    if not len(sample.rollout_log_probs) == len(sample.loss_mask) == n:
        raise ValueError(f"{where}: {n} response tokens, {len(sample.rollout_log_probs)} rollout log-probs and "
                         f"{len(sample.loss_mask)} loss-mask values; they must be equal (tool tokens: mask 0)")
    if set(sample.loss_mask) - {0, 1}:
        raise ValueError(f"{where}: loss_mask holds {sorted(set(sample.loss_mask) - {0, 1})}; only 0 and 1")
    turns = model_turns(sample.loss_mask)
    if max_turns is not None and turns > max_turns:
        raise ValueError(f"{where}: {turns} model turns, more than --rollout-max-turns {max_turns}")
    if max_context_len is not None and sample.total_length > max_context_len:
        raise ValueError(f"{where}: {sample.total_length} tokens, more than --rollout-max-context-len "
                         f"{max_context_len}")
    if sample.status == SampleStatus.ABORTED and not aborting:
        raise ValueError(f"{where}: returned with status aborted though its round was not cut off; set "
                         "COMPLETED or TRUNCATED")
