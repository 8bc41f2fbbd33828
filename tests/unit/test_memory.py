"""release_free_heap gives back free memory that glibc would keep: the gaps inside a fragmented heap; and
keep_freed_heap keeps a freed large block for reuse, where glibc would unmap it, and keeps it from the trim. Each
case runs in a fresh process: glibc's settings are the process's."""

import json
import subprocess
import sys

import pytest

from vime_engine.devices.host_memory import _libc_function

BLOCK = 64 * 1024  # below glibc's mmap threshold: served from the heap, not mapped on its own
GAPS = 1600  # 100 MiB freed between live blocks
LARGE = 256 * 2**20  # above it: mapped on its own

_PRELUDE = """
import ctypes, json, resource, sys
import psutil
from vime_engine.devices.host_memory import keep_freed_heap, release_free_heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
"""

# Every other block stays allocated, so the freed ones cannot merge into the heap's top: what the trim gives back.
_GAPS = _PRELUDE + f"""
process = psutil.Process()
gaps, live = [], []
for _ in range({GAPS}):
    for blocks in (gaps, live):
        block = libc.malloc({BLOCK})
        ctypes.memset(block, 1, {BLOCK})  # touched: resident
        blocks.append(block)
for block in gaps:
    libc.free(block)
held = process.memory_info().rss
trimmed = release_free_heap()
print(json.dumps({{"trimmed": trimmed, "released": held - process.memory_info().rss}}))
"""

# A large block allocated, touched and freed, twice: the page faults of the second touch.
_REUSE = _PRELUDE + f"""
kept = keep_freed_heap() if sys.argv[1] == "keep" else None
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc({LARGE})
    ctypes.memset(block, 1, {LARGE})
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"kept": kept, "faults": faults, "trimmed": release_free_heap()}}))
"""


def _run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(_libc_function("malloc_trim") is None, reason="the C library has no malloc_trim (not glibc)")
def test_free_gaps_inside_the_heap_are_given_back():
    result = _run(_GAPS)
    assert result["trimmed"] is True
    released = result["released"]
    assert released > 0.8 * BLOCK * GAPS, f"only {released / 2**20:.1f} MiB of {BLOCK * GAPS / 2**20:.0f} given back"


@pytest.mark.skipif(_libc_function("mallopt") is None, reason="the C library has no mallopt (not glibc)")
def test_a_kept_heap_reuses_a_freed_large_block_without_faulting_its_pages_again_and_is_not_trimmed():
    pages = LARGE // 4096
    default, kept = _run(_REUSE, "default"), _run(_REUSE, "keep")
    assert kept["kept"] is True
    assert default["faults"][1] > 0.5 * pages  # unmapped on free: every page faults (and is zeroed) again
    assert kept["faults"][1] < 0.05 * pages, kept
    assert kept["trimmed"] is False  # an engine in the same process (colocated) leaves the kept heap alone
