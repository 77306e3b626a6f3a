"""Softmax cross-entropy over rows of logits in one Triton kernel, the gradient written in place.

One program per row. Pass 1 streams the row in BLOCK_V tiles and keeps, per lane, a running max
and a running sum of exponentials rescaled to it (online softmax), so the row is read once for
its log-sum-exp. Pass 2 streams the row again (much of it from L2: a GPT-2 row is 100 KB) and
overwrites it with softmax - onehot(target). Per row: two reads and one write of V elements,
against the four passes of the compiled PyTorch version (max, sum, then read and write).

With a soft-cap (``softcap`` = s > 0, model.logit_softcap) each logit x is read as c = s * tanh(x / s)
in both passes (reference.py: ``capped_logits``, the one definition), so the loss is that of the
capped logits and the gradient written is d loss / d x = (softmax(c) - onehot) * (1 - (c / s)^2).
Capped logits lie in [-s, s], so for s <= FIXED_SHIFT_MAX_CAP pass 1 needs no running max: it sums
exp(c - s), which neither overflows nor underflows (exp(-2s) stays a normal float32). Per element
that is two exponentials and one division in each pass, near the memory bound, where a running max's
rescale made the cap cost the time of a second kernel. A larger cap takes the running max.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..ops import define_op

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))
BLOCK_V = 8192  # with 16 warps the fastest of scripts/bench_cross_entropy.py's sweep on the H100
NUM_WARPS = 16
FIXED_SHIFT_MAX_CAP = 40.0  # exp(-80) > float32's smallest normal (about exp(-87.3))


@triton.jit
def _tanh(x):
    """tanh(x) = 2 / (1 + exp(-2x)) - 1, from exp2 (no tanh in every Triton version, nor in its
    interpreter): +-1 at +-inf."""
    return 2.0 / (1.0 + tl.exp2(x * (-2.0 * LOG2E))) - 1.0


@triton.jit
def _softmax_xent_kernel(logits_ptr, targets_ptr, loss_ptr, V, stride_row, softcap,
                         BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, FIXED_SHIFT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    inv_softcap = 1.0 / softcap
    target = tl.load(targets_ptr + row)
    target_logit = tl.load(base + target).to(tl.float32)
    if FIXED_SHIFT:
        s = tl.zeros([BLOCK_V], tl.float32)  # per-lane sum of exp(c - softcap)
        for start in range(0, V, BLOCK_V):
            mask = start + offs < V
            x = tl.load(base + start + offs, mask=mask, other=0.0).to(tl.float32)
            c = softcap * _tanh(x * inv_softcap)
            s += tl.where(mask, tl.exp2((c - softcap) * LOG2E), 0.0)
        lse = softcap + tl.log(tl.sum(s, axis=0))
    else:
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per-lane running max
        s = tl.zeros([BLOCK_V], tl.float32)  # per-lane sum of exp(x - m)
        for start in range(0, V, BLOCK_V):
            mask = start + offs < V
            x = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
            if SOFTCAP:
                x = tl.where(mask, softcap * _tanh(x * inv_softcap), float("-inf"))
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with nothing yet: no -inf - -inf
            s = s * tl.exp2((m - m_safe) * LOG2E) + tl.exp2((x - m_safe) * LOG2E)
            m = m_new
        row_max = tl.max(m, axis=0)
        lse = row_max + tl.log(tl.sum(s * tl.exp2((m - row_max) * LOG2E), axis=0))
    if SOFTCAP:
        target_logit = softcap * _tanh(target_logit * inv_softcap)
    tl.store(loss_ptr + row, lse - target_logit)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            t = _tanh(x * inv_softcap)
            grad = (tl.exp2((softcap * t - lse) * LOG2E) - tl.where(cols == target, 1.0, 0.0)) * (1.0 - t * t)
        else:
            grad = tl.exp2((x - lse) * LOG2E) - tl.where(cols == target, 1.0, 0.0)
        tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _check(logits: torch.Tensor, targets: torch.Tensor, softcap: Optional[float] = None) -> None:
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be (n, V) float32, float16 or bfloat16; got {tuple(logits.shape)} {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary (stride 1 in dim 1)")
    if targets.shape != logits.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"targets must be ({logits.shape[0]},) int64; got {tuple(targets.shape)} {targets.dtype}")
    if targets.device != logits.device:
        raise ValueError(f"targets are on {targets.device} and logits on {logits.device}; put them on one device")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None; got {softcap}")


def softmax_xent_launch(logits: torch.Tensor, targets: torch.Tensor, softcap: Optional[float] = None,
                        block_v: int = BLOCK_V, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Loss rows (n,) float32; logits (n, V) become softmax(logits) - onehot(targets) in place, or with
    ``softcap`` the gradient of the loss of the capped logits with respect to the raw ones.

    Targets must lie in [0, V) (not checked on the device: that would need a host sync).
    """
    _check(logits, targets, softcap)
    n, V = logits.shape
    loss_rows = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _softmax_xent_kernel[(n,)](logits, targets, loss_rows, V, logits.stride(0), float(softcap or 1.0),
                                   BLOCK_V=block_v, SOFTCAP=softcap is not None,
                                   FIXED_SHIFT=softcap is not None and softcap <= FIXED_SHIFT_MAX_CAP, num_warps=num_warps)
    return loss_rows


def _softmax_cross_entropy_(logits: torch.Tensor, targets: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
    """Per-row cross-entropy (n,) float32 of logits (n, V) against targets (n,) int64; logits are
    overwritten with the gradient of the rows' sum, softmax - onehot, in their own dtype. With
    ``softcap`` = s the logits are read as s * tanh(logits / s) and the gradient is the raw logits'.

    The implementation of the op ``softmax_cross_entropy_`` (``kernels/ops.py``): opaque to
    ``torch.compile`` (no graph break), run as the Triton kernel."""
    loss_rows = softmax_xent_launch(logits, targets, softcap)
    torch.autograd.graph.increment_version(logits)  # written by the kernel, unseen by autograd (kernels/ops.py)
    return loss_rows


def _softmax_cross_entropy_fake(logits: torch.Tensor, targets: torch.Tensor,
                                softcap: Optional[float] = None) -> torch.Tensor:
    _check(logits, targets, softcap)
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


softmax_cross_entropy_ = define_op(
    "nanoflash::softmax_cross_entropy_", "(Tensor(a!) logits, Tensor targets, float? softcap=None) -> Tensor",
    _softmax_cross_entropy_, _softmax_cross_entropy_fake)
