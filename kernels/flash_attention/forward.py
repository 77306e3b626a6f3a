"""Flash-attention forward: Triton kernel and its launch function.

One program computes one block of ``BLOCK_M`` query rows of one (batch or document, query head)
pair. It streams key/value blocks of ``BLOCK_N`` rows through an online softmax kept in fp32
(base 2: ``log2(e)`` is folded into the scale and ``exp2`` is used), and writes the output rows and
their log-sum-exp (natural log, float32) for the backward pass.

The key loop is split into three ranges so only blocks that need a mask pay for it:

1. window-edge blocks (sliding window only; masked),
2. blocks every query row of the block sees in full (no mask, no bounds checks),
3. the diagonal / ragged-end blocks (masked: causal, window, sequence end).

GQA: query head ``h`` reads key/value head ``h // G``. Varlen: ``cu_seqlens`` (N+1,) gives
document boundaries in a packed (1, total_T, H, D) batch; grid axis 1 runs over documents.

Dropout (``HAS_DROPOUT``, a constexpr: off, the plain kernel runs): the row sums and the lse use
the un-dropped probabilities; each tile's probabilities are masked with the keep bits of
``dropout.dropout_keep`` before the P V product, and the output is scaled by 1 / (1 - p).

Forget gate (``HAS_GATE``, a constexpr: off, the plain kernel runs): each score gains
(c_i - c_j) * log2(e), from the hi/lo pair of c * log2(e), c = cumsum(g) (``gate.py``), relative to
the program's first query row. The online softmax runs on the scores minus the key's c_j only: the
query's c_i is the same for a whole row, so it changes no probability and is added to the lse
at the end. Per score the gate then costs nothing beyond the scale's multiply (now a fused
multiply-add); per key block, a few operations on a vector of BLOCK_N.

Pointer arithmetic only (no block pointers / tensor descriptors) so Triton 3.6-3.9 all work.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .dropout import dropout_keep, dropout_threshold, load_rng
from .gate import gate_cumsum, gate_offsets, gate_reference
from .tuning import Tuner, next_power_of_2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """tl.dot with full fp32 precision for fp32 inputs (Triton defaults to tf32)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_rows(ptrs, offs_rows, seqlen, d_mask, CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows, BLOCK_D) tile, masking rows past ``seqlen`` and padded head-dim columns."""
    if CHECK_ROWS:
        return tl.load(ptrs, mask=(offs_rows[:, None] < seqlen) & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,
    k_base, v_base, stride_kt, stride_vt,
    offs_m, offs_d, d_mask,
    lo, hi, seqlen, qk_scale, window, seed, offset_lo, offset_hi, rng_row0, threshold,
    c_hi, c_lo, ref_hi, ref_lo,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_GATE: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    if HAS_GATE:  # the first block's c_j, loaded ahead like every next block's (see gate_offsets)
        gate_next = gate_offsets(c_hi, c_lo, lo + offs_n0, seqlen, ref_hi, ref_lo, True)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k = _load_rows(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], offs_n, seqlen,
                       d_mask, MASKED, EVEN_D)
        v = _load_rows(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], offs_n, seqlen,
                       d_mask, MASKED, EVEN_D)
        s = _dot(q, tl.trans(k), None, IEEE) * qk_scale  # [BLOCK_M, BLOCK_N], base-2 logits
        if HAS_GATE:  # - c_j * log2(e), relative to the block's first query row (c_i joins the lse)
            gate_n = gate_next
            gate_next = gate_offsets(c_hi, c_lo, offs_n + BLOCK_N, seqlen, ref_hi, ref_lo, True)
            s -= gate_n[None, :]
        if MASKED:
            valid = offs_n[None, :] < seqlen
            if IS_CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            if HAS_WINDOW:
                valid = valid & (offs_m[:, None] - offs_n[None, :] < window)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row may see no key of this block yet: keep exp2 away from (-inf) - (-inf).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = dropout_keep(seed, offset_lo, offset_hi, rng_row0, offs_m, start_n, threshold, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        acc = _dot(p.to(v.dtype), v, acc, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["WINDOW", "DROPOUT_THRESHOLD"])
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS, RNG, C_HI, C_LO,
    qk_scale, dropout_scale, T, H, G, WINDOW, DROPOUT_THRESHOLD,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_GATE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    i_b = tl.program_id(1)
    i_h = tl.program_id(2)
    if IS_CAUSAL:  # longest query blocks (most key blocks) first
        pid_m = tl.num_programs(0) - 1 - pid_m
    i_kvh = i_h // G
    if HAS_DROPOUT:
        seed, offset_lo, offset_hi = load_rng(RNG)
    else:
        seed, offset_lo, offset_hi = 0, 0, 0
    rng_row0 = (i_b * H + i_h) * T  # this (sequence, head) plane of the dropout mask
    if IS_VARLEN:  # grid axis 1 runs over documents of the packed (1, total_T) batch
        bos = tl.load(CU_SEQLENS + i_b).to(tl.int64)
        seqlen = (tl.load(CU_SEQLENS + i_b + 1).to(tl.int64) - bos).to(tl.int32)
        q_off = bos * stride_qt
        k_off = bos * stride_kt
        v_off = bos * stride_vt
        o_off = bos * stride_ot
        lse_off = i_h.to(tl.int64) * T + bos
    else:
        seqlen = T
        q_off = i_b.to(tl.int64) * stride_qb
        k_off = i_b.to(tl.int64) * stride_kb
        v_off = i_b.to(tl.int64) * stride_vb
        o_off = i_b.to(tl.int64) * stride_ob
        lse_off = (i_b * H + i_h).to(tl.int64) * T

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    q_base = Q + q_off + i_h.to(tl.int64) * stride_qh
    k_base = K + k_off + i_kvh.to(tl.int64) * stride_kh
    v_base = V + v_off + i_kvh.to(tl.int64) * stride_vh
    q = _load_rows(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], offs_m, seqlen,
                   d_mask, True, EVEN_D)
    if HAS_GATE:  # c of this (sequence, head), relative to the block's first query row
        c_hi = C_HI + lse_off
        c_lo = C_LO + lse_off
        ref_hi, ref_lo = gate_reference(c_hi, c_lo, start_m, seqlen)
    else:
        c_hi = None
        c_lo = None
        ref_hi = None
        ref_lo = None

    # Key ranges: [lo, b) window edge (masked), [b, c) full (unmasked), [c, hi) diagonal/ragged.
    if IS_CAUSAL:
        hi = tl.minimum(seqlen, start_m + BLOCK_M)
        full_hi = ((start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = seqlen
        full_hi = (seqlen // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        lo = (tl.maximum(start_m - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - WINDOW, 0), BLOCK_N) * BLOCK_N
    else:
        lo = 0
        full_lo = 0
    hi = tl.where(start_m < seqlen, hi, lo)  # programs past a short document do nothing
    b = tl.minimum(tl.maximum(full_lo, lo), hi)
    c = tl.minimum(tl.maximum(full_hi, b), hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_WINDOW:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                   offs_m, offs_d, d_mask, lo, b, seqlen, qk_scale, WINDOW,
                                   seed, offset_lo, offset_hi, rng_row0, DROPOUT_THRESHOLD,
                                   c_hi, c_lo, ref_hi, ref_lo,
                                   True, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, HAS_GATE, EVEN_D, IEEE,
                                   BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                               offs_m, offs_d, d_mask, b, c, seqlen, qk_scale, WINDOW,
                               seed, offset_lo, offset_hi, rng_row0, DROPOUT_THRESHOLD,
                               c_hi, c_lo, ref_hi, ref_lo,
                               False, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, HAS_GATE, EVEN_D, IEEE,
                               BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                               offs_m, offs_d, d_mask, c, hi, seqlen, qk_scale, WINDOW,
                               seed, offset_lo, offset_hi, rng_row0, DROPOUT_THRESHOLD,
                               c_hi, c_lo, ref_hi, ref_lo,
                               True, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, HAS_GATE, EVEN_D, IEEE,
                               BLOCK_M, BLOCK_N)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    if HAS_DROPOUT:
        o = acc * (dropout_scale / l_safe)[:, None]
    else:
        o = acc / l_safe[:, None]
    if HAS_GATE:  # the row's own c_i * log2(e) (relative to the reference), left out of the softmax
        m_i += gate_offsets(c_hi, c_lo, offs_m, seqlen, ref_hi, ref_lo, True)
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # natural log
    m_mask = offs_m < seqlen
    o_ptrs = (O + o_off + i_h.to(tl.int64) * stride_oh
              + offs_m[:, None] * stride_ot + offs_d[None, :])
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    lse_ptrs = LSE + lse_off + offs_m
    tl.store(lse_ptrs, lse, mask=m_mask)


FWD = Tuner("fwd", _attn_fwd_kernel, resident="BLOCK_M")


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
    rng: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    g: torch.Tensor | None = None,
    tiles: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    q: (B, T, H, D); k, v: (B, T, H_kv, D), last dims contiguous; window 0 means none;
    cu_seqlens: None, or (N+1,) int32 document boundaries with ``max_seqlen`` the longest document;
    rng: the (2,) int64 dropout RNG state (``dropout.draw_dropout_rng``), used when dropout_p > 0;
    g: None or (B, T, H) float32 log forget gates (``gate.py``); tiles: None (the tuner's pick),
    or {"fwd": TileConfig} to launch that config.
    Returns o: (B, T, H, D) contiguous, q.dtype; lse: (B, H, T) float32, natural log (un-dropped).
    """
    B, T, H, D = q.shape
    o = q.new_empty((B, T, H, D))
    lse = q.new_empty((B, H, T), dtype=torch.float32)
    n_seq, max_len = (B, T) if cu_seqlens is None else (cu_seqlens.shape[0] - 1, max_seqlen)
    if n_seq == 0 or max_len == 0:
        return o, lse
    c_hi, c_lo = gate_cumsum(g) if g is not None else (None, None)
    block_d = max(16, next_power_of_2(D))
    values = (softmax_scale * LOG2E, 1.0 / (1.0 - dropout_p), T, H, H // k.shape[2], window,
              dropout_threshold(dropout_p), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
              # the constexprs: HEAD_DIM, BLOCK_D, EVEN_D, IS_CAUSAL, HAS_WINDOW, IS_VARLEN, HAS_DROPOUT, HAS_GATE, IEEE
              D, block_d, D == block_d, causal, window > 0, cu_seqlens is not None, dropout_p > 0, g is not None,
              q.dtype == torch.float32)
    FWD.launch(max_len, (n_seq, H), (q, k, v, o, lse, cu_seqlens, rng, c_hi, c_lo), values,
               tiles["fwd"] if tiles else None)
    return o, lse


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
