"""Triton's once-per-process start-up work, begun on a background thread.

Before a process launches its first Triton kernel, compiled or loaded from Triton's cache, Triton
keys that cache by hashing its own sources and its shared library (``triton.runtime.cache.triton_key``,
read in 1 MB chunks) and makes its CUDA driver object (which builds a small C module with gcc the
first time, then loads it from the cache). In ``scripts/sample.py`` both fell in the first decode
step: 0.42-0.52 s of it with Triton's cache warm, against 0.09-0.10 s once this thread does them (H100,
torch 2.11 + triton 3.6, 2026-11-26, docs/runs/2026-11-26-sample/). Reading, hashing and the compiler
release the GIL, so the thread runs while the main thread reads a checkpoint and runs the prefill;
both results are kept per process, and the main thread uses them when it gets there.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional


def start_triton_setup() -> Optional[threading.Thread]:
    """Start Triton's cache key and driver on a daemon thread; the thread, or None without Triton. A
    failure there is left to the main thread's own first call, which meets it again."""
    try:
        from triton.runtime import driver
        from triton.runtime.cache import triton_key
    except ImportError:
        return None

    def set_up() -> None:
        with contextlib.suppress(Exception):
            triton_key()
            driver.active  # noqa: B018 - the property builds the driver

    thread = threading.Thread(target=set_up, name="triton-setup", daemon=True)
    thread.start()
    return thread
