"""Loading a user's function from a flag value: `package.module:function` or `path/to/file.py:function`,
and calling it whether it is a plain function or a coroutine function (vime's rewards are `async def`).

A user's file may be written for vime and import vime's helpers (`from vime.utils.http_utils import post`): where
vime is not installed those imports reach our own (vime_engine/plugins/vime_modules/), installed before importing."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime_engine.plugins.vime_modules import install_vime_modules

_FORMS = "`package.module:function`, vime's `package.module.function`, or `path/to/file.py:function`"
FILE_MODULE_PREFIX = "vime_plugin_"  # the module name of a `path/to/file.py:function`: prefix + hash of the path


def load_function(
    spec: str, flag: str, arg_names: tuple[str, ...], wanted: str, allow_async: bool = False
) -> Callable:
    """Import the function named by `spec` and check it can be called with `arg_names` positionally.

    `spec` is `package.module:function` or vime's `package.module.function` (imported from `sys.path`), or
    `path/to/file.py:function`
    (a file, loaded under a module name derived from its absolute path so two files with the
    same name do not collide). Every failure is a ValueError naming `flag` and the fix; `wanted`
    describes the expected signature, e.g. "`(response: str, label: str) -> float`". A coroutine function
    is refused unless `allow_async` (its caller then runs it with `call_plugin`).
    """
    fn = import_function(spec, flag, wanted)
    return check_callable(fn, spec, flag, arg_names, wanted, allow_async)


def load_hook(spec: str | None, flag: str, arg_names: tuple[str, ...], wanted: str) -> Callable | None:
    """A vime hook named by an optional flag: None when the flag is unset, else `load_function` (async allowed)."""
    return None if spec is None else load_function(spec, flag, arg_names, wanted, allow_async=True)


def import_function(spec: str, flag: str, wanted: str) -> Callable:
    """The function named by `spec`, imported but not yet checked: for hooks whose form its signature decides."""
    # vime's own scripts name a function with dots (vime.utils.misc.load_function): package.module.function
    target, sep, function_name = spec.rpartition(":" if ":" in spec or spec.endswith(".py") else ".")
    if not sep or not target or not function_name.isidentifier():
        raise ValueError(f"{flag} {spec!r}: expected {_FORMS}")
    install_vime_modules()
    if target.endswith(".py"):
        module = _module_from_file(Path(target), spec, flag)
    else:
        module = _module_from_import(target, spec, flag)
    fn = getattr(module, function_name, None)
    if fn is None:
        raise ValueError(
            f"{flag} {spec!r}: {target} has no function {function_name!r}; "
            f"define `def {function_name}{wanted.strip('`')}` there"
        )
    return fn


def parameter_names(fn: Callable, required_only: bool = False) -> list[str]:
    """The names of the parameters `fn` takes positionally (only those without a default if `required_only`),
    in order; [] when its signature cannot be read."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters
            if p.kind in positional and not (required_only and p.default is not inspect.Parameter.empty)]


def call_plugin(fn: Callable, *args: Any) -> Any:
    """`fn(*args)`, awaited when it returns an awaitable: each call runs its own event loop."""
    result = fn(*args)
    if inspect.isawaitable(result):
        return asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _module_from_file(path: Path, spec: str, flag: str):
    if not path.is_file():
        raise ValueError(f"{flag} {spec!r}: file {str(path)!r} does not exist; give an existing .py file")
    resolved = path.resolve()
    name = FILE_MODULE_PREFIX + hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{flag} {spec!r}: executing {str(path)!r} failed: {exc!r}; fix the file") from exc
    return module


def _module_from_import(module_name: str, spec: str, flag: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"{flag} {spec!r}: cannot import module {module_name!r} ({exc}); "
            f"make it importable (PYTHONPATH) or give {_FORMS}"
        ) from exc
    except Exception as exc:
        raise ValueError(f"{flag} {spec!r}: importing {module_name!r} failed: {exc!r}; fix the module") from exc


def check_callable(fn: Any, spec: str, flag: str, arg_names: tuple[str, ...], wanted: str,
                   allow_async: bool = False) -> Callable:
    """`fn` (from `import_function`) checked to be callable with `arg_names` positionally; a ValueError naming
    `flag` otherwise."""
    if not callable(fn):
        raise ValueError(f"{flag} {spec!r}: {fn!r} is not callable; it must be a function {wanted}")
    if inspect.iscoroutinefunction(fn) and not allow_async:
        raise ValueError(f"{flag} {spec!r}: the function is async; it must be a plain function {wanted}")
    try:
        inspect.signature(fn).bind(*arg_names)
    except TypeError as exc:
        raise ValueError(
            f"{flag} {spec!r}: the function cannot be called with ({', '.join(arg_names)}) ({exc}); "
            f"its signature must be {wanted}"
        ) from exc
    except ValueError:
        pass  # builtins without an introspectable signature: trust the user
    return fn
