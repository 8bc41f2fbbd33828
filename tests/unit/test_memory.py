"""release_free_heap gives back free memory that glibc would keep: the gaps inside a fragmented heap."""

import ctypes

import psutil
import pytest

from vime_engine.devices.host_memory import _malloc_trim, release_free_heap

BLOCK = 64 * 1024  # below glibc's mmap threshold: served from the heap, not mapped on its own
GAPS = 1600  # 100 MiB freed between live blocks


@pytest.mark.skipif(_malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
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
