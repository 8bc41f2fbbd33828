"""The import hook that answers `import vime.utils.http_utils` (and the rest of finder.MODULES) with our modules.

It is appended to `sys.meta_path`, so it is asked only after every other finder has found nothing, and it serves
a top package (`vime`, `slime`) only when no real one could be found when it was installed: a real vime always
wins. A mapped name is the very module object of ours (`vime.utils.types.Sample is vime_engine.sample.Sample`),
so `isinstance` checks and monkeypatches agree under either name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

_OURS = "vime_engine.plugins.vime_modules"
# vime's (and slime's) module -> ours. vime keeps some of slime's names (its search-r1 example imports
# `slime.rollout.vllm_rollout`), and slime's plugins take GenerateState from `slime.rollout.sglang_rollout`.
MODULES: dict[str, str] = {
    f"{top}.{name}": f"{_OURS}.{ours}"
    for top in ("vime", "slime")
    for name, ours in (("utils.http_utils", "http_utils"), ("utils.types", "types"), ("utils.misc", "misc"),
                       ("rollout.vllm_rollout", "vllm_rollout"))
} | {"slime.rollout.sglang_rollout": f"{_OURS}.vllm_rollout"}
TOPS = frozenset(name.partition(".")[0] for name in MODULES)
# The packages above the mapped modules (`vime`, `vime.utils`, ...): empty, so nothing else is found under them.
PACKAGES = frozenset(name.rsplit(".", i)[0] for name in MODULES for i in range(1, name.count(".") + 1))


class _AliasLoader(importlib.abc.Loader):
    """Loads a mapped name as our module itself: imported (and run) once, under its own name, which it keeps."""

    def __init__(self, target: str):
        self.target = target
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran when imported under its own name); the import system has just given it
        the alias's spec, so it gets its own back, for `importlib.reload` and `find_spec` of its own name."""
        module.__spec__ = self._own_spec


class _PackageLoader(importlib.abc.Loader):
    """Loads a parent package (`vime`, `vime.utils`, ...) as an empty package."""

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = f"vimeflow's stand-in for {module.__name__} (vime_engine/plugins/vime_modules/)"


_PACKAGE_LOADER = _PackageLoader()


class VimeModuleFinder(importlib.abc.MetaPathFinder):
    """Finds finder.MODULES and their packages under the top packages `tops` (those with no real package)."""

    def __init__(self, tops: frozenset[str]):
        self.tops = tops

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        top = name.partition(".")[0]
        if top not in self.tops or (name != top and getattr(sys.modules.get(top), "__loader__", None)
                                    is not _PACKAGE_LOADER):
            return None  # not ours, or its top package is a real one after all
        if name in MODULES:
            return importlib.machinery.ModuleSpec(name, _AliasLoader(MODULES[name]))
        if name in PACKAGES:
            return importlib.machinery.ModuleSpec(name, _PACKAGE_LOADER, is_package=True)
        known = ", ".join(sorted(n for n in MODULES if n.startswith(top + ".")))
        raise ModuleNotFoundError(f"No module named {name!r}: {top} is not installed, and vimeflow stands in only "
                                  f"for {known} (vime_engine/plugins/vime_modules/); install {top} or import "
                                  "from those", name=name)


def install_vime_modules() -> frozenset[str]:
    """Put the finder on `sys.meta_path` (once) for each of vime and slime that is not installed; the top
    packages it serves (empty when both are installed, and then nothing is installed)."""
    for finder in sys.meta_path:
        if isinstance(finder, VimeModuleFinder):
            return finder.tops
    tops = frozenset(top for top in TOPS if top not in sys.modules and importlib.util.find_spec(top) is None)
    if tops:
        sys.meta_path.append(VimeModuleFinder(tops))
    return tops
