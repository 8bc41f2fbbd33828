"""Test-only fault injection: SIGKILL this process inside the Nth call of a chosen function.

Active only when VIMEFLOW_TEST_FAULT="module:Qualified.name:N" is set (tests put this directory on
PYTHONPATH of a subprocess, so every process of the run — driver and Ray actors — loads it). Before dying
the process writes VIMEFLOW_TEST_FAULT_MARKER so the test knows the kill happened and where.

With VIMEFLOW_TEST_FAULT_VICTIM=raylet the process SIGKILLs the raylet among its own descendants instead
(the local Ray cluster a driver started), waits until it is gone and then makes the call: what an OOM kill
of the raylet looks like to the driver. A process without such a descendant is left alone.

With VIMEFLOW_TEST_FAULT_VICTIM=node (a Ray driver on a multi-node cluster) the process prints
"VIMEFLOW_TEST_FAULT: waiting for a node to leave", waits until one node of its cluster is dead (the test kills
it on seeing the line) and then makes the call. It fires once per marker file, so a retried run passes.

With VIMEFLOW_TEST_FAULT_VICTIM=pause the process writes the marker and waits (up to 120 s) until the file
MARKER.resume exists, then makes the call: the test acts on the run (say, on a server the call is about to use)
at a known point and lets it go on.
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

    def _wait_for_a_lost_node():
        import time

        import ray

        marker = os.environ["VIMEFLOW_TEST_FAULT_MARKER"]
        if os.path.exists(marker):
            return
        alive = lambda: sum(node["Alive"] for node in ray.nodes())  # noqa: E731
        before = alive()
        with open(marker, "w") as f:
            f.write(f"{_SPEC} waited for a node of {before}\n")
        print("VIMEFLOW_TEST_FAULT: waiting for a node to leave", flush=True)
        deadline = time.monotonic() + 120
        while alive() == before and time.monotonic() < deadline:
            time.sleep(0.2)

    def _pause():
        import time

        marker = os.environ["VIMEFLOW_TEST_FAULT_MARKER"]
        with open(marker, "w") as f:
            f.write(f"{_SPEC} paused pid={os.getpid()}\n")
        deadline = time.monotonic() + 120
        while not os.path.exists(marker + ".resume") and time.monotonic() < deadline:
            time.sleep(0.01)

    def _die():
        if os.environ.get("VIMEFLOW_TEST_FAULT_VICTIM") == "node":
            return _wait_for_a_lost_node()
        if os.environ.get("VIMEFLOW_TEST_FAULT_VICTIM") == "pause":
            return _pause()
        victims = None  # this process
        if os.environ.get("VIMEFLOW_TEST_FAULT_VICTIM") == "raylet":
            import psutil

            victims = [p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
            if not victims:
                return
        with open(os.environ["VIMEFLOW_TEST_FAULT_MARKER"], "w") as f:
            f.write(f"{_SPEC} pid={' '.join(str(p.pid) for p in victims) if victims else os.getpid()}\n")
        if victims is None:
            os.kill(os.getpid(), signal.SIGKILL)
        for victim in victims:
            victim.kill()
        psutil.wait_procs(victims, timeout=30)

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
