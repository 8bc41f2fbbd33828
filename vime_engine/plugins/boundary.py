"""The boundary between the engine and a user's function (a `--custom-rm-path` reward, a dynamic-sampling filter,
a reward post-process, an advantage function, vime's other hooks): what comes back is checked before the engine
uses it, and an exception inside is reported as the function's, not the engine's.

Without the check a reward of NaN ended the run far from its cause (in the advantages' statistics), and the
string "1.0" trained in silence as 1.0 (`float("1.0")`); an exception surfaced bare, naming neither the function
nor the sample. Here each becomes one `UserFunctionError` naming the flag, the function (`module:qualname`), the
rollout, the sample and the value; an exception's traceback goes to the run's log (`_to_log`). It is a
`RunStoppedError`: exit 2, the run's files kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vime_engine.config.errors import RunStoppedError
from vime_engine.plugins.loading import FILE_MODULE_PREFIX, call_plugin, load_hook


class UserFunctionError(RunStoppedError):
    """A user's function raised, or returned what the engine cannot use. `where` says in which rollout and
    `sample` for which sample, as far as the raiser knew them (`at` adds what a caller knows)."""

    def __init__(self, flag: str, function: str, problem: str, sample: str | None = None, where: str | None = None):
        super().__init__(flag, function, problem, sample, where)  # the args rebuild it when Ray pickles it
        self.flag, self.function, self.problem, self.sample, self.where = flag, function, problem, sample, where

    def __str__(self) -> str:
        place = ", ".join(p for p in (self.where, self.sample) if p)
        return f"{self.flag} {self.function} {self.problem}" + (f" ({place})" if place else "")

    def at(self, where: str) -> UserFunctionError:
        """The same error, placed in `where` (e.g. "rollout 3") unless the raiser already knew where it was."""
        return UserFunctionError(self.flag, self.function, self.problem, self.sample, self.where or where)


@contextlib.contextmanager
def user_functions_in(where: str) -> Iterator[None]:
    """A UserFunctionError raised in the block (here or in a Ray worker: Ray's wrapper is an instance of it and
    carries it as `cause`) leaves it placed in `where`: the driver knows the rollout, the trainer does not. One from
    a worker is logged here with the worker's traceback."""
    try:
        yield
    except UserFunctionError as exc:
        original = getattr(exc, "cause", exc)
        if original is not exc:  # from a Ray worker, whose output may not reach the run's log before the run ends
            _to_log(f"{original.at(where)}; as the Ray worker raised it:\n{exc}")  # the user's frames included
        raise original.at(where) from original.__cause__ or exc  # the user's exception, else Ray's remote traceback


def _to_log(text: str) -> None:
    """A user function's traceback into the run's log: this process's stderr, which is engine.log under `vimeflow
    train`, the job's log in the pipeline and the worker's log under Ray (forwarded to the driver's). Not the
    `vime_engine` logger: `vimeflow train` shows its records on the terminal, where the run's one message goes."""
    print(text.rstrip("\n"), file=sys.stderr, flush=True)


def function_name(fn: Callable) -> str:
    """`module:qualname` of a user's function (a file given as `path.py:function` by its path), through the
    `functools.partial` that binds vime's `args` to it."""
    target = getattr(fn, "func", fn)
    module = getattr(target, "__module__", None) or "?"
    if module.startswith(FILE_MODULE_PREFIX):
        module = getattr(sys.modules.get(module), "__file__", None) or module
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{qualname}"


def number_problem(value: Any) -> str | None:
    """Why `value` cannot be used as a number (None: it can). Anything `float()` converts by its `__float__` is a
    number (int, bool, numpy and 0-d torch scalars); a str is not, though `float("1.0")` would parse it."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return f"returned {value!r} ({type(value).__name__}), not a number"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return f"returned {value!r} ({type(value).__name__}), not a single number"
    if not math.isfinite(number):
        return f"returned {number!r}, not a finite number"
    return None


def sample_labels(group_indices: Sequence[int]) -> list[str]:
    """How a message names each of these samples: "sample j of group g", j counted within its group."""
    seen: dict[int, int] = {}
    labels = []
    for g in group_indices:
        labels.append(f"sample {seen.get(g, 0)} of group {g}")
        seen[g] = seen.get(g, 0) + 1
    return labels


@dataclass(frozen=True)
class UserFunction:
    """A user's function as the engine calls it (plain or async, as `call_plugin` runs it), named by its flag."""

    fn: Callable
    flag: str

    @property
    def name(self) -> str:
        return function_name(self.fn)

    def error(self, problem: str, sample: str | None = None) -> UserFunctionError:
        return UserFunctionError(self.flag, self.name, problem, sample)

    def call(self, *args: Any, sample: str | None = None) -> Any:
        """`fn(*args)`; an exception inside goes to the run's log with its traceback, and up as a UserFunctionError."""
        try:
            return call_plugin(self.fn, *args)
        except Exception as exc:  # noqa: BLE001  (whatever the user's code raised, named as theirs)
            raise self._raised(exc, sample) from exc

    def gather(self, calls: list[tuple[Any, ...]], samples: Sequence[str]) -> list[Any]:
        """`fn(*c)` for every call, concurrently on one event loop when `fn` is a coroutine function; an exception
        names the sample of its call (`samples[i]` for `calls[i]`)."""
        if not inspect.iscoroutinefunction(self.fn):
            return [self.call(*c, sample=s) for c, s in zip(calls, samples, strict=True)]

        async def one(c: tuple[Any, ...], sample: str) -> Any:
            try:
                return await self.fn(*c)
            except Exception as exc:  # noqa: BLE001
                raise self._raised(exc, sample) from exc

        async def run_all() -> list[Any]:
            return list(await asyncio.gather(*(one(c, s) for c, s in zip(calls, samples, strict=True))))

        return asyncio.run(run_all())

    def number(self, value: Any, sample: str | None, what: str) -> float:
        """`value` as a float, or a UserFunctionError naming the sample and the value."""
        problem = number_problem(value)
        if problem is not None:
            raise self.error(f"{problem}; return a finite number as the {what}", sample)
        return float(value)

    def numbers(self, values: Any, samples: Sequence[str], what: str, call: str | None = None) -> list[float]:
        """`values`, one finite number per sample, in order; else a UserFunctionError naming the count (and `call`,
        e.g. the group it was given) or the first sample whose value is unusable."""
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
            raise self.error(f"returned {values!r} ({type(values).__name__}); return a list of one {what} per "
                             f"sample ({len(samples)}), in order", call)
        if len(values) != len(samples):
            raise self.error(f"returned {len(values)} {what}s for {len(samples)} samples; return one per sample, "
                             "in order", call)
        return [self.number(v, s, what) for v, s in zip(values, samples)]

    def _raised(self, exc: Exception, sample: str | None) -> UserFunctionError:
        if isinstance(exc, UserFunctionError):  # a nested user function, already named
            return exc
        _to_log(f"{self.flag} {self.name} raised" + (f" ({sample})" if sample else "") + ":\n"
                + "".join(traceback.format_exception(exc)))
        return self.error(f"raised {type(exc).__name__}: {exc} (its traceback is in the log); fix the function",
                          sample)


def load_user_hook(spec: str | None, flag: str, arg_names: tuple[str, ...], wanted: str) -> UserFunction | None:
    """A vime hook named by an optional flag (`load_hook`), to be called through the boundary."""
    fn = load_hook(spec, flag, arg_names, wanted)
    return None if fn is None else UserFunction(fn, flag)
