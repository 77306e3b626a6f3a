"""Triton's once-per-process start-up cost, begun on a background thread.

Before a process launches its first Triton kernel, compiled or loaded from Triton's cache, Triton
keys that cache by hashing its own sources and its shared library (``triton.runtime.cache.triton_key``,
read in 1 MB chunks): 0.43-0.45 s of ``scripts/sample.py``'s first decode step on an H100 host, warm
cache or cold (cProfile, torch 2.11 + triton 3.6, 2026-11-26). Reading and hashing release the GIL, so
a thread started early does it while the main thread reads a checkpoint and runs the prefill; the key
is cached per process, and the main thread uses it when it gets there.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional


def start_triton_key() -> Optional[threading.Thread]:
    """Start computing Triton's cache key on a daemon thread; the thread, or None where this Triton keys
    its cache otherwise (or is missing). A failure there is left to the main thread's own call."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return None

    def compute() -> None:
        with contextlib.suppress(Exception):
            triton_key()

    thread = threading.Thread(target=compute, name="triton-key", daemon=True)
    thread.start()
    return thread
