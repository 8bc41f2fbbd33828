"""Test-only fault injection: SIGKILL this process inside the Nth call of a chosen function.

Active only when VIMEFLOW_TEST_FAULT="module:Qualified.name:N" is set (tests put this directory on
PYTHONPATH of a subprocess, so every process of the run — driver and Ray actors — loads it). Before dying
the process writes VIMEFLOW_TEST_FAULT_MARKER so the test knows the kill happened and where.
"""

import os

_SPEC = os.environ.get("VIMEFLOW_TEST_FAULT")

if _SPEC:
    import functools
    import importlib.abc
    import importlib.util
    import signal
    import sys

    _module, _qualname, _count = _SPEC.split(":")
    _calls = {"n": 0}

    def _die():
        with open(os.environ["VIMEFLOW_TEST_FAULT_MARKER"], "w") as f:
            f.write(f"{_SPEC} pid={os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    def _patch(module):
        owner, _, attr = _qualname.rpartition(".")
        target = module
        for part in filter(None, owner.split(".")):
            target = getattr(target, part)
        original = getattr(target, attr)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            _calls["n"] += 1
            if _calls["n"] == int(_count):
                _die()
            return original(*args, **kwargs)

        setattr(target, attr, wrapper)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _module:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                _patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _Finder())
