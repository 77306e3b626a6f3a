"""Flash-attention backward: dQ (with the delta preprocess fused in) and dK/dV Triton kernels.

FlashAttention-2 style recompute: nothing of size T x T is saved. From q, k, v, the output o, its
gradient do and the saved log-sum-exp (natural log, converted to base 2 in the kernels):

* ``_attn_bwd_dq_kernel`` runs first. Each program first computes the usual "preprocess"
  delta_i = sum_d do_id * o_id (minus dlse_i when the lse output has a gradient) for its query
  rows and stores it (fp32, (B, H, T)) for the dK/dV kernel; fusing it saves a kernel launch,
  which is measurable CPU time on short sequences (docs/KERNEL.md). Then, looping over key
  blocks: dQ += dS K with dS = P * (dO V^T - delta).
* ``_attn_bwd_dkdv_kernel``: one program per block of ``BLOCK_N`` keys of one kv head; it loops
  over the ``G`` query heads sharing that kv head (GQA) and over their query blocks, recomputing
  P^T = exp2(K Q^T * scale - lse) and accumulating dV += P^T dO, dK += dS^T Q in fp32 registers.
  No atomics: each dK/dV row is written once by one program, so the result is deterministic.

P and dS are cast to the inputs' element type before their matmul. Key/query ranges are split
into unmasked and masked (causal diagonal, window edge, ragged end) loops as in the forward.

Dropout (``HAS_DROPOUT``): with Z = keep / (1 - p) (the forward's mask, regenerated per tile by
``dropout.dropout_keep``), dV = (P * Z)^T dO and dS = P * (dP * Z - delta) where dP = dO V^T;
delta = rowsum(dO * O) is unchanged (it equals rowsum(P * Z * dP)).

Forget gate (``HAS_GATE``): both kernels add (c_i - c_j) * log2(e) to their recomputed scores, as
the forward does (``gate.py``): the key's c_j per score (a fused multiply-add with the scale), the
query's c_i folded into the per-row lse. dL/dc_l is the row sum minus the column sum of dS at l.
The dQ kernel stores the row sums of the dS tiles it forms into DC (B, H, T); the dK/dV kernel then
subtracts the column sums of its dS tiles, per query head (under GQA it loops over the query heads
of its kv head, each with its own c), in place. Every element is written by one program of each
kernel: no atomics, deterministic. ``attn_bwd`` then takes the reverse cumulative sum: dg
(``gate.gate_grad``).

The row sum is dlse_l in exact arithmetic (adding a constant to a row of scores changes only its
lse), but not in the kernels' arithmetic: delta = rowsum(dO * O) uses the output rounded to the
input dtype, so the dS rows sum to dlse plus a rounding residue. Only row and column sums of the
same dS tiles cancel that residue in dg = sum of dS over pairs j < l <= i; with the exact row sum
instead, the residues of all later rows pile up in dg (measured 6x the low-precision reference's
error at T=200 in fp16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dropout import dropout_keep, dropout_threshold, load_rng
from .forward import LOG2E, _dot, _load_rows
from .gate import gate_cumsum, gate_grad, gate_offsets, gate_reference
from .tuning import Tuner, next_power_of_2


@triton.jit
def _query_rows(lse_base, delta_base, offs_m, seqlen, CHECK: tl.constexpr):
    """(lse * log2(e), delta) of query rows ``offs_m``; with ``CHECK``, 0 past ``seqlen``. Without
    a gate the dK/dV loop loads them one block ahead: small vector loads that Triton's pipeliner
    leaves in place stall every step (ahead: dK/dV 7-10% faster on the H100). With a gate it loads
    them in place, unmasked in full blocks: ahead, or always masked, the gated kernel ran 4-19%
    slower (docs/KERNEL.md)."""
    if CHECK:
        inside = offs_m < seqlen
        lse = tl.load(lse_base + offs_m, mask=inside, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=inside, other=0.0)
    else:
        lse = tl.load(lse_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    return lse * 1.4426950408889634, delta


@triton.jit
def _dkdv_inner(
    dk, dv, dc_col, k, v,
    q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
    start_n, offs_n, offs_d, d_mask,
    lo, hi, seqlen, qk_scale, window,
    seed, offset_lo, offset_hi, rng_row0, threshold, dropout_scale,
    c_hi, c_lo, ref_hi, ref_lo, gate_k,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_GATE: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m0 = tl.arange(0, BLOCK_M)
    if not HAS_GATE:
        lse2_next, delta_next = _query_rows(lse_base, delta_base, lo + offs_m0, seqlen, True)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        q = _load_rows(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], offs_m, seqlen,
                       d_mask, MASKED, EVEN_D)
        do = _load_rows(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], offs_m, seqlen,
                        d_mask, MASKED, EVEN_D)
        if HAS_GATE:
            lse2, delta = _query_rows(lse_base, delta_base, offs_m, seqlen, MASKED)
        else:  # one block ahead
            lse2 = lse2_next
            delta = delta_next
            lse2_next, delta_next = _query_rows(lse_base, delta_base, offs_m + BLOCK_M, seqlen, True)
        s_t = _dot(k, tl.trans(q), None, IEEE) * qk_scale  # [BLOCK_N, BLOCK_M], base 2
        if HAS_GATE:  # + (c_i - c_j) * log2(e): c_j per score, c_i with the query's lse
            s_t -= gate_k[:, None]
            lse2 -= gate_offsets(c_hi, c_lo, offs_m, seqlen, ref_hi, ref_lo, MASKED)
        p_t = tl.exp2(s_t - lse2[None, :])
        if MASKED:
            m_mask = offs_m < seqlen
            valid = m_mask[None, :]
            if IS_CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            if HAS_WINDOW:
                valid = valid & (offs_m[None, :] - offs_n[:, None] < window)
            p_t = tl.where(valid, p_t, 0.0)
        if HAS_DROPOUT:
            keep_t = dropout_keep(seed, offset_lo, offset_hi, rng_row0, offs_m, start_n, threshold,
                                  BLOCK_M, BLOCK_N, True)
            dv = _dot(tl.where(keep_t, p_t * dropout_scale, 0.0).to(do.dtype), do, dv, IEEE)
            dp_t = tl.where(keep_t, _dot(v, tl.trans(do), None, IEEE) * dropout_scale, 0.0)
        else:
            dv = _dot(p_t.to(do.dtype), do, dv, IEEE)
            dp_t = _dot(v, tl.trans(do), None, IEEE)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_GATE:
            dc_col += tl.sum(ds_t, 1)
        dk = _dot(ds_t.to(q.dtype), q, dk, IEEE)
    return dk, dv, dc_col


@triton.jit(do_not_specialize=["WINDOW", "DROPOUT_THRESHOLD"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS, RNG, C_HI, C_LO, DC,
    qk_scale, sm_scale, dropout_scale, T, H, G, WINDOW, DROPOUT_THRESHOLD,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_GATE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    i_b = tl.program_id(1)
    i_kvh = tl.program_id(2)
    if IS_VARLEN:
        bos = tl.load(CU_SEQLENS + i_b).to(tl.int64)
        seqlen = (tl.load(CU_SEQLENS + i_b + 1).to(tl.int64) - bos).to(tl.int32)
        q_off = bos * stride_qt
        k_off = bos * stride_kt
        v_off = bos * stride_vt
        do_off = bos * stride_dot
        dk_off = bos * stride_dkt
        dv_off = bos * stride_dvt
        lse_row = bos  # + h * T
        lse_b = 0
    else:
        seqlen = T
        q_off = i_b.to(tl.int64) * stride_qb
        k_off = i_b.to(tl.int64) * stride_kb
        v_off = i_b.to(tl.int64) * stride_vb
        do_off = i_b.to(tl.int64) * stride_dob
        dk_off = i_b.to(tl.int64) * stride_dkb
        dv_off = i_b.to(tl.int64) * stride_dvb
        lse_row = 0
        lse_b = i_b.to(tl.int64) * H

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    n_mask = offs_n < seqlen
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + k_off + i_kvh.to(tl.int64) * stride_kh
                + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + v_off + i_kvh.to(tl.int64) * stride_vh
                + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)

    # Query ranges: [lo, b) diagonal (masked), [b, c) full (unmasked), [c, hi) window edge /
    # ragged end (masked).
    if IS_CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        full_lo = 0
    hi = seqlen
    full_hi = (seqlen // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(seqlen, start_n + BLOCK_N - 1 + WINDOW)
        full_hi = tl.minimum(full_hi, ((start_n + WINDOW) // BLOCK_M) * BLOCK_M)
    hi = tl.where(start_n < seqlen, hi, lo)  # programs past a short document do nothing
    b = tl.minimum(tl.maximum(full_lo, lo), hi)
    c = tl.minimum(tl.maximum(full_hi, b), hi)

    if HAS_DROPOUT:
        seed, offset_lo, offset_hi = load_rng(RNG)
    else:
        seed, offset_lo, offset_hi = 0, 0, 0
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, G):  # the query heads that share this kv head
        i_h = i_kvh * G + g
        rng_row0 = (i_b * H + i_h) * T  # this (sequence, head) plane of the dropout mask
        q_base = Q + q_off + i_h.to(tl.int64) * stride_qh
        do_base = DO + do_off + i_h.to(tl.int64) * stride_doh
        lse_base = LSE + (lse_b + i_h) * T + lse_row
        delta_base = DELTA + (lse_b + i_h) * T + lse_row
        dc_col = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_GATE:  # this query head's c, relative to the block's first key row
            c_hi = C_HI + (lse_b + i_h) * T + lse_row
            c_lo = C_LO + (lse_b + i_h) * T + lse_row
            ref_hi, ref_lo = gate_reference(c_hi, c_lo, start_n, seqlen)
            gate_k = gate_offsets(c_hi, c_lo, offs_n, seqlen, ref_hi, ref_lo, True)
        else:
            c_hi = None
            c_lo = None
            ref_hi = None
            ref_lo = None
            gate_k = None
        dk, dv, dc_col = _dkdv_inner(dk, dv, dc_col, k, v, q_base, do_base, lse_base, delta_base,
                                     stride_qt, stride_dot, start_n, offs_n, offs_d, d_mask,
                                     lo, b, seqlen, qk_scale, WINDOW,
                                     seed, offset_lo, offset_hi, rng_row0, DROPOUT_THRESHOLD, dropout_scale,
                                     c_hi, c_lo, ref_hi, ref_lo, gate_k,
                                     True, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, HAS_GATE, EVEN_D, IEEE,
                                     BLOCK_M, BLOCK_N)
        dk, dv, dc_col = _dkdv_inner(dk, dv, dc_col, k, v, q_base, do_base, lse_base, delta_base,
                                     stride_qt, stride_dot, start_n, offs_n, offs_d, d_mask,
                                     b, c, seqlen, qk_scale, WINDOW,
                                     seed, offset_lo, offset_hi, rng_row0, DROPOUT_THRESHOLD, dropout_scale,
                                     c_hi, c_lo, ref_hi, ref_lo, gate_k,
                                     False, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, HAS_GATE, EVEN_D, IEEE,
                                     BLOCK_M, BLOCK_N)
        dk, dv, dc_col = _dkdv_inner(dk, dv, dc_col, k, v, q_base, do_base, lse_base, delta_base,
                                     stride_qt, stride_dot, start_n, offs_n, offs_d, d_mask,
                                     c, hi, seqlen, qk_scale, WINDOW,
                                     seed, offset_lo, offset_hi, rng_row0, DROPOUT_THRESHOLD, dropout_scale,
                                     c_hi, c_lo, ref_hi, ref_lo, gate_k,
                                     True, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, HAS_GATE, EVEN_D, IEEE,
                                     BLOCK_M, BLOCK_N)
        if HAS_GATE:  # dc = (row sums, stored by the dQ kernel) - column sums
            dc_ptrs = DC + (lse_b + i_h) * T + lse_row + offs_n
            tl.store(dc_ptrs, tl.load(dc_ptrs, mask=n_mask, other=0.0) - dc_col, mask=n_mask)
    dk = dk * sm_scale
    tl.store(DK + dk_off + i_kvh.to(tl.int64) * stride_dkh
             + offs_n[:, None] * stride_dkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + dv_off + i_kvh.to(tl.int64) * stride_dvh
             + offs_n[:, None] * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_inner(
    dq, dc_row, q, do, lse2, delta,
    k_base, v_base, stride_kt, stride_vt,
    offs_m, offs_d, d_mask,
    lo, hi, seqlen, qk_scale, window,
    seed, offset_lo, offset_hi, rng_row0, threshold, dropout_scale,
    c_hi, c_lo, ref_hi, ref_lo,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_GATE: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    if HAS_GATE:  # the first block's c_j, loaded ahead like every next block's
        gate_next = gate_offsets(c_hi, c_lo, lo + offs_n0, seqlen, ref_hi, ref_lo, True)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k = _load_rows(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], offs_n, seqlen,
                       d_mask, MASKED, EVEN_D)
        v = _load_rows(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], offs_n, seqlen,
                       d_mask, MASKED, EVEN_D)
        s = _dot(q, tl.trans(k), None, IEEE) * qk_scale  # [BLOCK_M, BLOCK_N], base 2
        if HAS_GATE:  # - c_j * log2(e); the query's c_i is in lse2
            gate_n = gate_next
            gate_next = gate_offsets(c_hi, c_lo, offs_n + BLOCK_N, seqlen, ref_hi, ref_lo, True)
            s -= gate_n[None, :]
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            valid = offs_n[None, :] < seqlen
            if IS_CAUSAL:
                valid = valid & (offs_m[:, None] >= offs_n[None, :])
            if HAS_WINDOW:
                valid = valid & (offs_m[:, None] - offs_n[None, :] < window)
            p = tl.where(valid, p, 0.0)
        dp = _dot(do, tl.trans(v), None, IEEE)
        if HAS_DROPOUT:
            keep = dropout_keep(seed, offset_lo, offset_hi, rng_row0, offs_m, start_n, threshold, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_GATE:
            dc_row += tl.sum(ds, 1)
        dq = _dot(ds.to(k.dtype), k, dq, IEEE)
    return dq, dc_row


@triton.jit(do_not_specialize=["WINDOW", "DROPOUT_THRESHOLD"])
def _attn_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DLSE, DELTA, DQ, CU_SEQLENS, RNG, C_HI, C_LO, DC,
    qk_scale, sm_scale, dropout_scale, T, H, G, WINDOW, DROPOUT_THRESHOLD,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_DLSE: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_GATE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    i_b = tl.program_id(1)
    i_h = tl.program_id(2)
    if IS_CAUSAL:  # longest query blocks first
        pid_m = tl.num_programs(0) - 1 - pid_m
    i_kvh = i_h // G
    if IS_VARLEN:
        bos = tl.load(CU_SEQLENS + i_b).to(tl.int64)
        seqlen = (tl.load(CU_SEQLENS + i_b + 1).to(tl.int64) - bos).to(tl.int32)
        q_off = bos * stride_qt
        k_off = bos * stride_kt
        v_off = bos * stride_vt
        o_off = bos * stride_ot
        do_off = bos * stride_dot
        dq_off = bos * stride_dqt
        lse_off = i_h.to(tl.int64) * T + bos
    else:
        seqlen = T
        q_off = i_b.to(tl.int64) * stride_qb
        k_off = i_b.to(tl.int64) * stride_kb
        v_off = i_b.to(tl.int64) * stride_vb
        o_off = i_b.to(tl.int64) * stride_ob
        do_off = i_b.to(tl.int64) * stride_dob
        dq_off = i_b.to(tl.int64) * stride_dqb
        lse_off = (i_b * H + i_h).to(tl.int64) * T

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < seqlen
    q = _load_rows(Q + q_off + i_h.to(tl.int64) * stride_qh
                   + offs_m[:, None] * stride_qt + offs_d[None, :], offs_m, seqlen, d_mask,
                   True, EVEN_D)
    do = _load_rows(DO + do_off + i_h.to(tl.int64) * stride_doh
                    + offs_m[:, None] * stride_dot + offs_d[None, :], offs_m, seqlen, d_mask,
                    True, EVEN_D)
    o = _load_rows(O + o_off + i_h.to(tl.int64) * stride_oh
                   + offs_m[:, None] * stride_ot + offs_d[None, :], offs_m, seqlen, d_mask,
                   True, EVEN_D)
    # fused preprocess: delta = rowsum(dO * O) (- dlse), stored for the dK/dV kernel
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + lse_off + offs_m, mask=m_mask, other=0.0)
    tl.store(DELTA + lse_off + offs_m, delta, mask=m_mask)
    lse2 = tl.load(LSE + lse_off + offs_m, mask=m_mask, other=0.0) * 1.4426950408889634
    k_base = K + k_off + i_kvh.to(tl.int64) * stride_kh
    v_base = V + v_off + i_kvh.to(tl.int64) * stride_vh

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
    hi = tl.where(start_m < seqlen, hi, lo)
    b = tl.minimum(tl.maximum(full_lo, lo), hi)
    c = tl.minimum(tl.maximum(full_hi, b), hi)

    if HAS_DROPOUT:
        seed, offset_lo, offset_hi = load_rng(RNG)
    else:
        seed, offset_lo, offset_hi = 0, 0, 0
    rng_row0 = (i_b * H + i_h) * T  # this (sequence, head) plane of the dropout mask
    if HAS_GATE:  # c of this (sequence, head), relative to the block's first query row
        c_hi = C_HI + lse_off
        c_lo = C_LO + lse_off
        ref_hi, ref_lo = gate_reference(c_hi, c_lo, start_m, seqlen)
        lse2 -= gate_offsets(c_hi, c_lo, offs_m, seqlen, ref_hi, ref_lo, True)  # the query's c_i
    else:
        c_hi = None
        c_lo = None
        ref_hi = None
        ref_lo = None
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dc_row = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_WINDOW:
        dq, dc_row = _dq_inner(dq, dc_row, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt,
                               offs_m, offs_d, d_mask, lo, b, seqlen, qk_scale, WINDOW,
                               seed, offset_lo, offset_hi, rng_row0, DROPOUT_THRESHOLD, dropout_scale,
                               c_hi, c_lo, ref_hi, ref_lo,
                               True, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, HAS_GATE, EVEN_D, IEEE,
                               BLOCK_M, BLOCK_N)
    dq, dc_row = _dq_inner(dq, dc_row, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt,
                           offs_m, offs_d, d_mask, b, c, seqlen, qk_scale, WINDOW,
                           seed, offset_lo, offset_hi, rng_row0, DROPOUT_THRESHOLD, dropout_scale,
                           c_hi, c_lo, ref_hi, ref_lo,
                           False, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, HAS_GATE, EVEN_D, IEEE,
                           BLOCK_M, BLOCK_N)
    dq, dc_row = _dq_inner(dq, dc_row, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt,
                           offs_m, offs_d, d_mask, c, hi, seqlen, qk_scale, WINDOW,
                           seed, offset_lo, offset_hi, rng_row0, DROPOUT_THRESHOLD, dropout_scale,
                           c_hi, c_lo, ref_hi, ref_lo,
                           True, IS_CAUSAL, HAS_WINDOW, HAS_DROPOUT, HAS_GATE, EVEN_D, IEEE,
                           BLOCK_M, BLOCK_N)
    if HAS_GATE:  # row sums of dS; the dK/dV kernel subtracts the column sums
        tl.store(DC + lse_off + offs_m, dc_row, mask=m_mask)
    dq = dq * sm_scale
    tl.store(DQ + dq_off + i_h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqt + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


DKDV = Tuner("dkdv", _attn_bwd_dkdv_kernel, resident="BLOCK_N")
DQ = Tuner("dq", _attn_bwd_dq_kernel, resident="BLOCK_M")


def attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
    dlse: torch.Tensor | None = None,
    rng: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    g: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    tiles: dict | None = None,
    dkdv_launch=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the dQ kernel, then the dK/dV kernel (and with a gate the scan that makes dg).

    do, q, o: (B, T, H, D); k, v: (B, T, H_kv, D); lse, dlse: (B, H, T) float32, natural log;
    last dims contiguous (a do whose last dim is not is copied: autograd may hand one over).
    cu_seqlens, max_seqlen, rng, dropout_p, g: the forward's (its dropout mask is regenerated).
    out: None (new contiguous dq like q, dk like k, dv like v), or (dq, dk, dv) to write in place
    (any T and H strides, last dim contiguous: the packed layout passes three views of one
    gradient buffer). tiles: None (the tuners' picks) or {"dq": TileConfig, "dkdv": TileConfig}.
    dkdv_launch: None, or ``f(q, k, v, do, lse, delta, dk, dv)`` launching another dK/dV kernel in
    place of this file's (the Hopper one, hopper.py), after the dQ kernel wrote delta.
    Returns dq, dk, dv and dg: (B, T, H) float32, or None without a gate.
    """
    if do.stride(-1) != 1:
        do = do.contiguous()
    B, T, H, D = q.shape
    H_kv = k.shape[2]
    dq, dk, dv = out if out is not None else (q.new_empty((B, T, H, D)), k.new_empty((B, T, H_kv, D)),
                                              v.new_empty((B, T, H_kv, D)))
    n_seq, max_len = (B, T) if cu_seqlens is None else (cu_seqlens.shape[0] - 1, max_seqlen)
    if n_seq == 0 or max_len == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), None if g is None else torch.zeros_like(g)
    delta = q.new_empty((B, H, T), dtype=torch.float32)  # written by the dQ kernel
    if g is not None:
        c_hi, c_lo = gate_cumsum(g)
        dc = q.new_empty((B, H, T), dtype=torch.float32)  # written by both kernels
    else:
        c_hi = c_lo = dc = None
    if dlse is not None:  # d lse_i / d s_ij = P_ij: dS gains P * dlse, i.e. delta -= dlse
        dlse = dlse.float().contiguous()
    block_d = max(16, next_power_of_2(D))
    scalars = (softmax_scale * LOG2E, softmax_scale, 1.0 / (1.0 - dropout_p), T, H, H // H_kv, window,
               dropout_threshold(dropout_p), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    # the constexprs: HEAD_DIM, BLOCK_D, EVEN_D, IS_CAUSAL, HAS_WINDOW, IS_VARLEN, (dQ: HAS_DLSE,)
    # HAS_DROPOUT, HAS_GATE, IEEE
    shape_flags = (D, block_d, D == block_d, causal, window > 0, cu_seqlens is not None)
    path_flags = (dropout_p > 0, g is not None, q.dtype == torch.float32)
    DQ.launch(max_len, (n_seq, H), (q, k, v, o, do, lse, dlse, delta, dq, cu_seqlens, rng, c_hi, c_lo, dc),
              (*scalars, *o.stride()[:3], *do.stride()[:3], *dq.stride()[:3], *shape_flags, dlse is not None,
               *path_flags), tiles["dq"] if tiles else None)
    if dkdv_launch is not None:
        dkdv_launch(q, k, v, do, lse, delta, dk, dv)
        return dq, dk, dv, None
    DKDV.launch(max_len, (n_seq, H_kv), (q, k, v, do, lse, delta, dk, dv, cu_seqlens, rng, c_hi, c_lo, dc),
                (*scalars, *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *shape_flags, *path_flags),
                tiles["dkdv"] if tiles else None)
    return dq, dk, dv, None if dc is None else gate_grad(dc, cu_seqlens)
