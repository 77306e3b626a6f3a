"""Flash-decoding: a few new queries against a KV cache, the cache split over programs (Triton).

``flash_decode(q, k_cache, v_cache, cache_seqlens, ...)`` (function.py: the op and the
public function), ``decode_launch`` (kernel.py: the kernels and their launch), ``decode_config``
(launch.py: the splits and tiles, from shapes and the GPU), and the plain PyTorch reference
``decode_ref`` (reference.py). ``flash_decode_available(t)`` says whether the kernel can run on a
tensor; the model runs the reference where it cannot.
"""
from __future__ import annotations

import torch

from .launch import DecodeConfig, decode_config
from .reference import decode_ref, visible_keys

try:
    from .function import flash_decode
    from .kernel import decode_launch
except ImportError:  # triton missing: the reference still imports
    flash_decode = decode_launch = None


def flash_decode_available(t: torch.Tensor) -> bool:
    """Triton is importable and ``t`` is on a CUDA GPU of compute capability 8.0 or newer (Triton
    3.3+ compiles nothing older). The kernel also runs on CPU tensors under Triton's interpreter
    (TRITON_INTERPRET=1), which the tests use; generation on a CPU takes the reference instead."""
    return flash_decode is not None and t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 0)


__all__ = ["flash_decode", "decode_launch", "DecodeConfig", "decode_config", "decode_ref", "visible_keys",
           "flash_decode_available"]
