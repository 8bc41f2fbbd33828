"""release_free_heap gives back free memory that glibc would keep: the gaps inside a fragmented heap; and
keep_freed_heap keeps a freed large block for reuse, where glibc would unmap it."""

import ctypes
import json
import subprocess
import sys

import psutil
import pytest

from vime_engine.devices.host_memory import _libc_function, release_free_heap

BLOCK = 64 * 1024  # below glibc's mmap threshold: served from the heap, not mapped on its own
GAPS = 1600  # 100 MiB freed between live blocks


@pytest.mark.skipif(_libc_function("malloc_trim") is None, reason="the C library has no malloc_trim (not glibc)")
def test_free_gaps_inside_the_heap_are_given_back():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    process = psutil.Process()
    gaps, live = [], []
    for _ in range(GAPS):  # every other block stays allocated, so the freed ones cannot merge into the heap's top
        for blocks in (gaps, live):
            block = libc.malloc(BLOCK)
            ctypes.memset(block, 1, BLOCK)  # touched: resident
            blocks.append(block)
    for block in gaps:
        libc.free(block)
    held = process.memory_info().rss
    try:
        assert release_free_heap()
        released = held - process.memory_info().rss
    finally:
        for block in live:
            libc.free(block)
    assert released > 0.8 * BLOCK * GAPS, f"only {released / 2**20:.1f} MiB of {BLOCK * GAPS / 2**20:.0f} given back"


# A fresh process (the settings are process-wide) allocates, touches and frees a 256 MiB block (glibc maps a block
# this large on its own) and then does it again: the page faults of the second touch.
_REUSE = """
import ctypes, json, resource, sys
from vime_engine.devices.host_memory import keep_freed_heap
kept = keep_freed_heap() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 256 * 2**20
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


@pytest.mark.skipif(_libc_function("mallopt") is None, reason="the C library has no mallopt (not glibc)")
def test_a_kept_heap_reuses_a_freed_large_block_without_faulting_its_pages_again():
    def run(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _REUSE, mode], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    pages = 256 * 2**20 // 4096
    default, kept = run("default"), run("keep")
    assert kept["kept"] is True
    assert default["faults"][1] > 0.5 * pages  # unmapped on free: every page faults (and is zeroed) again
    assert kept["faults"][1] < 0.05 * pages, kept
