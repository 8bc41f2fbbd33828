"""The libraries vLLM's CPU backend asks for in LD_PRELOAD, found where they are installed.

vLLM's CPU guide wants tcmalloc (the engine's many small host allocations) and Intel's OpenMP runtime (the threads
of its CPU kernels) preloaded into the engine's process. A preload acts only from a process's start, so the
actors that hold engines get it in the environment Ray starts them with; a library this machine lacks is left out
(the engine runs as without it, and vLLM says so in its log).
"""

from __future__ import annotations

import sys
from pathlib import Path

TCMALLOC = "libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4
INTEL_OPENMP = "libiomp5.so"  # PyPI's intel-openmp, which installs it into the environment's lib/

_SYSTEM_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def installed(name: str) -> str | None:
    """The path of library `name` in this Python environment's lib/ or the system's library directories."""
    for directory in (Path(sys.prefix) / "lib", *map(Path, _SYSTEM_DIRS)):
        if (directory / name).is_file():
            return str(directory / name)
    return None


def cpu_preload(names: tuple[str, ...] = (TCMALLOC, INTEL_OPENMP)) -> str:
    """LD_PRELOAD for a CPU engine's process: the installed ones of `names`, in order, joined by ':'."""
    return ":".join(path for path in map(installed, names) if path)
