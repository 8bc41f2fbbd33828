"""An actor's start-up without Python's automatic garbage collections.

A trainer rank or an engine starts by importing torch, transformers and vLLM and loading a model: millions of
objects that live as long as the process. Python's collector runs a full collection each time the long-lived
objects have grown by a quarter, so the start-up paid for scanning the same objects again and again: a fresh
process imported vLLM in 8.6 s with the collector on and 6.7 s with it off, and a tiny run's colocated actor started
1.7 s sooner (bench/startup.py). Reference counting frees everything as before; only cycles wait for the single
collection at the end, after which what is left is frozen, as vLLM freezes its own start-up heap.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def start_up_without_collections() -> Iterator[None]:
    """The block runs with the automatic collections off; at its end one collection frees the cycles it left, the
    survivors are frozen (later collections skip them) and the collector is back on. Inside another such block (a
    colocated actor's trainer rank) it does nothing, so the outer block's end is the one collection."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()
