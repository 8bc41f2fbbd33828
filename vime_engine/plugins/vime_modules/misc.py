"""vime's `vime.utils.misc` helpers that plugins use: `load_function` and the `SingletonMeta` of GenerateState."""

from __future__ import annotations

import importlib
from typing import Any


def load_function(path: str) -> Any:
    """The attribute named by a dotted path, `package.module.function`, as vime's `load_function` reads it."""
    module_path, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module_path), name)


class SingletonMeta(type):
    """One instance per class, made by the first call and returned by every later one (whatever its arguments),
    as vime's GenerateState is; `clear_instances()` forgets them."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances = {}
