"""Forget gate (log-decay) for the flash kernels: score(q_i, k_j) = q_i·k_j·scale + (c_i - c_j).

``g`` is (B, T, H) float32, one log forget gate per token and query head (the Forgetting
Transformer's g_t = log f_t <= 0; the kernels assume no sign), and c is its cumulative sum along
the sequence, so c_i - c_j = g_{j+1} + ... + g_i for j < i. With ``cu_seqlens`` only pairs of one
document meet, and for those c_i - c_j is the same whether c restarts at the document's first
token or runs on from the previous documents: the difference cancels the offset. So c is one
cumulative sum along the whole (packed) sequence.

**Where c is computed, and in what precision.** By :func:`gate_cumsum`, one launch of a small
Triton scan kernel (one program per sequence and head, ``SCAN_BLOCK`` positions a step, a float64
carry between steps; times log2(e): the kernels' scores are base 2), exact to ~1e-16 relative. It
replaces a torch float64 cumsum, a transpose and two casts (five launches and their host time).
The kernels then need c_i - c_j in fp32. Storing c in fp32 would lose bits: |c| grows like
T * |g|, and fp32 c carries an absolute error of ~6e-8 * |c| (1e-3 at |c| = 16384), an error in
every probability, even between neighbours whose true difference is tiny. Instead c is stored as
an unevaluated sum of two fp32 numbers, hi = fp32(c) and lo = fp32(c - hi), and each program
subtracts a reference point of its own block (ref = c at its first query or key row):
c_x - ref = (hi_x - ref_hi) + (lo_x - ref_lo) (:func:`gate_offsets`), exact to fp32 rounding of
that block-relative value. A score's gate term thus carries an error of ~6e-8 * (|c_i - c_j| +
2 * block * max|g|), whatever T: the precision of a cumulative sum restarted every block (which
is what FLA's chunk-local cumsum buys), with no limit on T.

**Cost per score: none beyond a fused multiply-add.** c_i is the same for a whole row of scores,
so the forward runs its online softmax on q·k·scale - c_j only and adds c_i to the row's lse at
the end (the probabilities do not change); the backward kernels fold c_i into the per-row lse they
subtract anyway. What remains per block is a vector of BLOCK_N (or BLOCK_M) offsets.

**Saved for backward**: g itself (4 bytes per token and head); the backward recomputes hi/lo.

**Backward.** With dS_ij the gradient of the natural-log score (dS = P * (dP - delta), the tile the
dQ and dK/dV kernels form anyway), dc_l = sum_j dS_lj - sum_i dS_il: a row sum, which the dQ
kernel stores, minus a column sum, which the dK/dV kernel subtracts in place (``backward.py``).
:func:`gate_grad` turns dc into dg, the reverse cumulative sum of dc within each sequence (g_l
enters every c_i with i >= l of its sequence), with a second scan kernel that walks each sequence
from its end and accumulates in float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCAN_BLOCK = 1024  # positions per step of the scan kernels' loop along T
SCAN_WARPS = 4


@triton.jit(do_not_specialize=["T"])
def _gate_cumsum_kernel(G, C_HI, C_LO, T, H, stride_gb, stride_gt, stride_gh, BLOCK_T: tl.constexpr):
    """One program per (batch row, head): c = cumsum(g) * log2(e) along T, in float64, stored as the
    fp32 pair hi = fp32(c), lo = fp32(c - hi) at row (b * H + h) of C_HI / C_LO (B, H, T)."""
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    g_row = G + i_b.to(tl.int64) * stride_gb + i_h.to(tl.int64) * stride_gh
    out_row = (i_b * H + i_h).to(tl.int64) * T
    carry = tl.zeros([1], dtype=tl.float64)  # c at the last position of the steps before
    for start in range(0, T, BLOCK_T):
        offs = start + tl.arange(0, BLOCK_T)
        inside = offs < T
        x = tl.load(g_row + offs.to(tl.int64) * stride_gt, mask=inside, other=0.0).to(tl.float64)
        c = (tl.cumsum(x, 0) + carry) * 1.4426950408889634
        carry += tl.sum(x, 0)
        hi = c.to(tl.float32)
        tl.store(C_HI + out_row + offs, hi, mask=inside)
        tl.store(C_LO + out_row + offs, (c - hi.to(tl.float64)).to(tl.float32), mask=inside)


@triton.jit(do_not_specialize=["T"])
def _gate_grad_kernel(DC, DG, CU_SEQLENS, T, H, stride_gb, stride_gt, stride_gh,
                      IS_VARLEN: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program per (sequence, head): dg_t = sum of dc_s over s >= t in t's sequence (a batch
    row, or a document of ``CU_SEQLENS`` in the packed batch of one row), accumulated in float64
    from the sequence's end; dc (B, H, T) float32, dg (B, T, H) float32 at the given strides."""
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    if IS_VARLEN:
        bos = tl.load(CU_SEQLENS + i_b)
        eos = tl.load(CU_SEQLENS + i_b + 1)
        dc_row = DC + i_h.to(tl.int64) * T
        dg_row = DG + i_h.to(tl.int64) * stride_gh
    else:
        bos = 0
        eos = T
        dc_row = DC + (i_b * H + i_h).to(tl.int64) * T
        dg_row = DG + i_b.to(tl.int64) * stride_gb + i_h.to(tl.int64) * stride_gh
    carry = tl.zeros([1], dtype=tl.float64)  # the sum of dc over the steps after this one
    for step in range(0, tl.cdiv(eos - bos, BLOCK_T)):
        offs = eos - (step + 1) * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = offs >= bos
        x = tl.load(dc_row + offs, mask=inside, other=0.0).to(tl.float64)
        dg = tl.cumsum(x, 0, reverse=True) + carry
        carry += tl.sum(x, 0)
        tl.store(dg_row + offs.to(tl.int64) * stride_gt, dg.to(tl.float32), mask=inside)


def gate_cumsum(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c * log2(e), c = cumsum(g) along the sequence, as an (hi, lo) pair of float32 (B, H, T)
    tensors laid out like the kernels' lse (hi + lo exact to ~1e-16 relative). g: (B, T, H) float32,
    any strides. One kernel launch."""
    B, T, H = g.shape
    hi = g.new_empty((B, H, T))
    lo = g.new_empty((B, H, T))
    _gate_cumsum_kernel[(B, H, 1)](g, hi, lo, T, H, *g.stride(), BLOCK_T=SCAN_BLOCK, num_warps=SCAN_WARPS)
    return hi, lo


def gate_grad(dc: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """dg (B, T, H) float32 from dc (B, H, T) float32: dg_t = sum of dc_s over s >= t in t's
    sequence (batch row, or document of ``cu_seqlens``), accumulated in float64. One kernel launch."""
    B, H, T = dc.shape
    dg = dc.new_empty((B, T, H))
    n_seq = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _gate_grad_kernel[(n_seq, H, 1)](dc, dg, cu_seqlens, T, H, *dg.stride(), IS_VARLEN=cu_seqlens is not None,
                                     BLOCK_T=SCAN_BLOCK, num_warps=SCAN_WARPS)
    return dg


@triton.jit
def gate_offsets(c_hi, c_lo, offs, seqlen, ref_hi, ref_lo, CHECK: tl.constexpr):
    """(c[offs] - ref) * log2(e), float32, for rows ``offs`` of one (sequence, head) row of the
    hi/lo pair at ``c_hi`` / ``c_lo`` (already scaled by log2(e)); with ``CHECK``, rows past
    ``seqlen`` are not read and give 0 (the masked loads return ref itself)."""
    if CHECK:
        inside = offs < seqlen
        hi = tl.load(c_hi + offs, mask=inside, other=ref_hi)
        lo = tl.load(c_lo + offs, mask=inside, other=ref_lo)
    else:
        hi = tl.load(c_hi + offs)
        lo = tl.load(c_lo + offs)
    return (hi - ref_hi) + (lo - ref_lo)


@triton.jit
def gate_reference(c_hi, c_lo, row, seqlen):
    """(hi, lo) of c at ``row`` (0, 0 past ``seqlen``): a program's reference point."""
    inside = row < seqlen
    return tl.load(c_hi + row, mask=inside, other=0.0), tl.load(c_lo + row, mask=inside, other=0.0)
