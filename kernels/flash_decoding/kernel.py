"""Flash-decoding in Triton: a few new queries against a KV cache, the cache split over programs.

**Split kernel.** Grid (B * H_kv, S). Program (b, hk, s) takes every query head of KV head hk (the
G = H / H_kv heads that share it: GQA packed into one program, as FlashAttention's
``flash_attn_with_kvcache`` does) and every one of the Tq new queries of sequence b: G * Tq rows,
padded to ``BLOCK_M`` >= 16 for ``tl.dot``. Each row's keys are read once per program, whatever G.
The keys sequence b shows to any of its queries, [lo, length), are cut into S chunks (whole
multiples of ``BLOCK_N``); program s streams chunk s through an online softmax in fp32 (base 2:
``log2(e)`` is folded into the scale) and writes its rows' normalised partial output and their
log-sum-exp. A chunk is cut from the sequence's own length, read on the device, so one launch (and
one captured CUDA graph) serves every length up to the cache's capacity; programs past a short
sequence's keys find an empty chunk and write lse = -inf. The grid runs (b, hk) fastest, so
programs that start together read the same rows of the (B, T_max, H_kv, D) cache, side by side:
on an H100 (2026-11-26) GPT-2's heads at batch 2 read a 64k cache in 137.7 µs against 142.8 with
the splits fastest, and batch 16 a 16k cache in 270.0 against 280.4.

**Merge kernel.** Grid (B * H * Tq,): one program per output row folds the S partial outputs
together, each weighted by exp(lse_s - max lse) (the merge ring attention does across ranks), and
writes o and the row's lse. With S = 1 the split kernel writes o and lse itself and there is no
merge. On Hopper and newer the merge kernel is the split kernel's programmatic dependent launch: its
programs start while the split kernel runs and wait in ``gdc_wait`` for its end, which hides the launch
between the two (GPT-2 generation 1-2 % faster on an H200; a merge by the last split program to
arrive, on atomic counters, was slower: docs/KERNEL.md).

**Masks.** Query t of sequence b sits at position p = length_b - Tq + t: it sees keys j <= p
(causal among the new queries), and with a window W only those with p - j < W.

**Forget gate.** ``C`` holds c, the running sum of the log forget gates, float64 (B, T_max, H):
each score gains c_p - c_j for its query head, the difference taken in float64 and rounded once to
fp32, so its error does not grow with |c| (that is, with the length).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
MERGE_WARPS = 4


@triton.jit
def _decode_split_kernel(
    Q, K, V, C, LENGTHS, O, LSE, O_PART, LSE_PART,
    qk_scale, WINDOW, Tq, H, G, S,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    stride_ob, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr, SINGLE: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # the merge kernel's programs may start now; they wait for this grid's end
    i_bk = tl.program_id(0)
    i_s = tl.program_id(1)
    h_kv = H // G
    i_b = i_bk // h_kv
    i_hk = i_bk % h_kv
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G * Tq
    head = i_hk * G + rows // Tq  # each row's query head
    t = rows % Tq  # each row's new query
    length = tl.load(LENGTHS + i_b)
    pos = length - Tq + t  # each row's position in its sequence
    if HAS_WINDOW:
        lo = tl.maximum(length - Tq - WINDOW + 1, 0)  # the first key any of the new queries sees
    else:
        lo = 0
    chunk = tl.cdiv(tl.cdiv(length - lo, S), BLOCK_N) * BLOCK_N
    start = lo + i_s * chunk
    end = tl.minimum(start + chunk, length)

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + i_b.to(tl.int64) * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh
    v_base = V + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh
    if HAS_GATE:
        c_rows = C + i_b.to(tl.int64) * stride_cb + head * stride_ch  # (BLOCK_M,) pointers
        c_q = tl.load(c_rows + pos.to(tl.int64) * stride_ct, mask=row_ok, other=0.0)  # float64
    else:
        c_rows = None
        c_q = None

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_GATE:
            c_k = tl.load(c_rows[:, None] + cols[None, :].to(tl.int64) * stride_ct,
                          mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            s += (c_q[:, None] - c_k).to(tl.float32) * LOG2E
        visible = col_ok[None, :] & (cols[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[:, None] - cols[None, :] < WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no (-inf) - (-inf)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))  # base 2
    out_rows = (i_b * H + head).to(tl.int64) * Tq + t  # row of (b, head, t) in (B, H, Tq)
    if SINGLE:
        o_ptrs = O + i_b.to(tl.int64) * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + out_rows, lse2 * LN2, mask=row_ok)
    else:
        part = out_rows * S + i_s
        tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE_PART + part, lse2, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    O_PART, LSE_PART, O, LSE, Tq, H, S,
    stride_ob, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (programmatic dependent launch): the split kernel's writes are visible after this
    row = tl.program_id(0).to(tl.int64)  # (b * H + h) * Tq + t
    t = row % Tq
    h = (row // Tq) % H
    b = row // (Tq * H)
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < S
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(LSE_PART + row * S + splits, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)  # an empty split (lse = -inf) weighs 0
    parts = tl.load(O_PART + (row * S + splits[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / total
    tl.store(O + b * stride_ob + t * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + row, (m + tl.log2(total)) * LN2)


@functools.lru_cache(maxsize=None)
def dependent_launch(device: torch.device) -> bool:
    """Whether the merge kernel is launched as the split kernel's programmatic dependent (Hopper and
    newer: its programs start while the split kernel runs and wait for its end in ``gdc_wait``, so
    the launch gap between the two is hidden); not under the interpreter."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def decode_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    gate_cache: torch.Tensor | None,
    softmax_scale: float,
    window: int,
    num_splits: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the split kernel (and with ``num_splits`` > 1 the merge kernel); inputs as
    ``flash_decode`` takes them (checked there), window 0 = none. Returns o (B, Tq, H, D) in q's dtype
    and lse (B, H, Tq) float32, natural log. ``block_n``, ``num_warps``, ``num_stages``: the split
    kernel's keys per step and launch settings (launch.py picks them; scripts/bench_decode.py sweeps them)."""
    B, Tq, H, D = q.shape
    G = H // k_cache.shape[2]
    o = torch.empty((B, Tq, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    single = num_splits == 1
    o_part = None if single else torch.empty((B * H * Tq, num_splits, D), dtype=torch.float32, device=q.device)
    lse_part = None if single else torch.empty((B * H * Tq, num_splits), dtype=torch.float32, device=q.device)
    pdl = not single and (dependent_launch(q.device) if pdl is None else pdl)
    sc = gate_cache.stride() if gate_cache is not None else (0, 0, 0)
    block_d = triton.next_power_of_2(D)
    _decode_split_kernel[(B * k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, gate_cache, cache_seqlens, o, lse, o_part, lse_part,
        softmax_scale * 1.4426950408889634, window, Tq, H, G, num_splits,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *sc, *o.stride()[:3],
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=max(16, triton.next_power_of_2(G * Tq)),
        BLOCK_N=block_n, HAS_WINDOW=window > 0, HAS_GATE=gate_cache is not None,
        SINGLE=single, IEEE=q.dtype == torch.float32, PDL=pdl, num_warps=num_warps, num_stages=num_stages,
    )
    if not single:
        _decode_merge_kernel[(B * H * Tq,)](
            o_part, lse_part, o, lse, Tq, H, num_splits, *o.stride()[:3],
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits), PDL=pdl,
            num_warps=MERGE_WARPS, **({"launch_pdl": True} if pdl else {}),
        )
    return o, lse
