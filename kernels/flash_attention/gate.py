"""Forget gate (log-decay) for the flash kernels: score(q_i, k_j) = q_i·k_j·scale + (c_i - c_j).

``g`` is (B, T, H) float32, one log forget gate per token and query head (the Forgetting
Transformer's g_t = log f_t <= 0; the kernels assume no sign), and c is its cumulative sum along
the sequence, so c_i - c_j = g_{j+1} + ... + g_i for j < i. With ``cu_seqlens`` only pairs of one
document meet, and for those c_i - c_j is the same whether c restarts at the document's first
token or runs on from the previous documents: the difference cancels the offset. So c is one
cumulative sum along the whole (packed) sequence.

**Where c is computed, and in what precision.** On the host side of the op, with
``torch.cumsum(..., dtype=float64)`` (times log2(e): the kernels' scores are base 2): one
memory-bound scan over B*T*H numbers (not timed apart from the kernels), exact to ~1e-16 relative.
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
enters every c_i with i >= l of its sequence), in float64 on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


LOG2E = 1.4426950408889634


def gate_cumsum(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c * log2(e), c = cumsum(g) along the sequence, as an (hi, lo) pair of float32 (B, H, T)
    tensors laid out like the kernels' lse (hi + lo exact to ~1e-16 relative). g: (B, T, H) float32."""
    c = torch.cumsum(g, dim=1, dtype=torch.float64).mul_(LOG2E).transpose(1, 2)
    hi = c.to(torch.float32, memory_format=torch.contiguous_format)
    lo = torch.empty_like(hi)
    torch.sub(c, hi, out=lo)
    return hi, lo


def gate_grad(dc: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """dg (B, T, H) float32 from dc (B, H, T) float32: dg_t = sum of dc_s over s >= t in t's
    sequence (batch row, or document of ``cu_seqlens``), accumulated in float64."""
    prefix = torch.cumsum(dc, dim=2, dtype=torch.float64)
    if cu_seqlens is None:
        total = prefix[..., -1:]
    else:  # the prefix at each token's document end
        ends = torch.repeat_interleave(cu_seqlens[1:].long() - 1, cu_seqlens.diff(), output_size=dc.shape[2])
        total = prefix.index_select(2, ends)
    dg = (total - prefix).add_(dc)
    return dg.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)


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
