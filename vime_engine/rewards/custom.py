"""Loading a user's reward function from `--custom-rm-path`."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

RewardFn = Callable[[str, str], float]

FLAG = "--custom-rm-path"
_FORMS = "`package.module:function` or `path/to/file.py:function`"


def load_custom_reward(spec: str) -> RewardFn:
    """Import the function named by `spec` and check it can be called as `fn(response, label)`.

    `spec` is `package.module:function` (imported from `sys.path`) or `path/to/file.py:function`
    (a file, loaded under a module name derived from its absolute path so two files with the
    same name do not collide). Every failure is a ValueError naming the flag and the fix.
    """
    target, sep, function_name = spec.rpartition(":")
    if not sep or not target or not function_name.isidentifier():
        raise ValueError(f"{FLAG} {spec!r}: expected {_FORMS}")
    if target.endswith(".py"):
        module = _module_from_file(Path(target), spec)
    else:
        module = _module_from_import(target, spec)
    fn = getattr(module, function_name, None)
    if fn is None:
        raise ValueError(
            f"{FLAG} {spec!r}: {target} has no function {function_name!r}; "
            f"define `def {function_name}(response: str, label: str) -> float` there"
        )
    _check_signature(fn, spec)
    return fn


def _module_from_file(path: Path, spec: str):
    if not path.is_file():
        raise ValueError(f"{FLAG} {spec!r}: file {str(path)!r} does not exist; give an existing .py file")
    resolved = path.resolve()
    name = "vime_custom_rm_" + hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{FLAG} {spec!r}: executing {str(path)!r} failed: {exc!r}; fix the file") from exc
    return module


def _module_from_import(module_name: str, spec: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"{FLAG} {spec!r}: cannot import module {module_name!r} ({exc}); "
            f"make it importable (PYTHONPATH) or give {_FORMS}"
        ) from exc
    except Exception as exc:
        raise ValueError(f"{FLAG} {spec!r}: importing {module_name!r} failed: {exc!r}; fix the module") from exc


def _check_signature(fn: object, spec: str) -> None:
    wanted = "`(response: str, label: str) -> float`"
    if not callable(fn):
        raise ValueError(f"{FLAG} {spec!r}: {fn!r} is not callable; it must be a function {wanted}")
    if inspect.iscoroutinefunction(fn):
        raise ValueError(f"{FLAG} {spec!r}: the function is async; reward functions are plain functions {wanted}")
    try:
        inspect.signature(fn).bind("response", "label")
    except TypeError as exc:
        raise ValueError(
            f"{FLAG} {spec!r}: the function cannot be called with (response, label) ({exc}); "
            f"its signature must be {wanted}"
        ) from exc
    except ValueError:
        return  # builtins without an introspectable signature: trust the user
