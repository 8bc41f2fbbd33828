"""A fake ModelArts container's process view (tests/support/modelarts_server.py puts this directory first on the
PYTHONPATH of every job process, and so of everything they start).

A real container sees only its own processes, so the entrypoint's `ray stop` ends only the Ray node of its
task. The fake containers are local processes beside the rest of the suite (another test's Ray cluster, on
another pytest-xdist worker): here psutil lists only the processes of this container (the same MA_JOB_DIR and
VC_TASK_INDEX, as the server tells its containers apart), which is what `ray stop` walks.

A sitecustomize.py further on the path (tests/support/faults) still runs after this one.
"""

import os
import sys

_CONTAINER = (os.environ.get("MA_JOB_DIR"), os.environ.get("VC_TASK_INDEX"))

if all(_CONTAINER):
    import psutil

    _every_process = psutil.process_iter

    def _this_containers_processes(*args, **kwargs):
        for proc in _every_process(*args, **kwargs):
            try:
                env = proc.environ()
            except psutil.Error:
                continue
            if (env.get("MA_JOB_DIR"), env.get("VC_TASK_INDEX")) == _CONTAINER:
                yield proc

    psutil.process_iter = _this_containers_processes


def _run_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry, "sitecustomize.py")
        if entry and os.path.abspath(entry) != here and os.path.isfile(candidate):
            with open(candidate) as source:
                code = compile(source.read(), candidate, "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": candidate})
            return


_run_the_next_sitecustomize()
