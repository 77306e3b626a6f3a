"""Softmax cross-entropy in one Triton kernel that writes the logits' gradient in place.

``softmax_cross_entropy_(logits, targets, softcap=None) -> loss_rows`` (an op, see kernel.py),
its plain PyTorch reference ``softmax_cross_entropy_ref`` and ``capped_logits``, the one definition
of a soft-capped logit. ``fused_cross_entropy_available(t)`` says
whether the kernel can run on a tensor; model/loss.py falls back to PyTorch where it cannot.
"""
from __future__ import annotations

import torch

from .reference import capped_logits, softmax_cross_entropy_ref

try:
    from .kernel import softmax_cross_entropy_, softmax_xent_launch
except ImportError:  # triton missing: the reference still imports
    softmax_cross_entropy_ = softmax_xent_launch = None


def fused_cross_entropy_available(logits: torch.Tensor) -> bool:
    """Triton is importable and ``logits`` (float32/16, bfloat16) are on a CUDA GPU.

    The kernel also runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which the
    tests use; training on a CPU takes PyTorch's path, as the interpreter is far slower."""
    return (softmax_cross_entropy_ is not None and logits.is_cuda
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16))


__all__ = ["softmax_cross_entropy_", "softmax_xent_launch", "softmax_cross_entropy_ref", "capped_logits",
           "fused_cross_entropy_available"]
