"""Plain PyTorch decoding attention with the kernel's contract: the math it must reproduce.

Scores every query against every row of the cache and masks what it may not see, so it costs
O(B * H * Tq * T_max) memory: the tests run it in float64 as ground truth and in the inputs' own
dtype to measure the error a low-precision implementation makes anyway; the model runs it where
the kernel cannot (CPU, or no Triton).
"""

from __future__ import annotations

import math

import torch


def visible_keys(cache_seqlens: torch.Tensor, n_queries: int, capacity: int, window_size: int | None) -> torch.Tensor:
    """Boolean (B, Tq, T_max), True where new query t of sequence b may see cache row j.

    Query t sits at position p = cache_seqlens[b] - Tq + t and sees j <= p, with a window W only
    p - j < W."""
    pos = cache_seqlens.long()[:, None] - n_queries + torch.arange(n_queries, device=cache_seqlens.device)  # (B, Tq)
    keys = torch.arange(capacity, device=cache_seqlens.device)
    visible = keys[None, None, :] <= pos[:, :, None]
    if window_size is not None:
        visible &= pos[:, :, None] - keys[None, None, :] < window_size
    return visible


def decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float | None = None,
    window_size: int | None = None,
    gate_cache: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``flash_decode`` (its docstring has the shapes and the masks).

    q: (B, Tq, H, D); k_cache, v_cache: (B, T_max, H_kv, D) whose rows past a sequence's length hold
    finite values (they are masked, and 0 * inf would still be NaN); cache_seqlens: (B,) integers;
    gate_cache: None or (B, T_max, H) float64 c. compute_dtype: dtype of the matmuls (None: the
    inputs' dtype); the softmax runs in at least float32, the gate's c_p - c_j in float64 rounded
    once to the softmax's dtype. Returns o: (B, Tq, H, D) in compute_dtype and lse: (B, H, Tq),
    natural log, in the softmax's dtype.
    """
    B, Tq, H, D = q.shape
    T_max, H_kv = k_cache.shape[1], k_cache.shape[2]
    G = H // H_kv
    dt = compute_dtype or q.dtype
    soft_dt = torch.float64 if dt == torch.float64 else torch.float32
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    qg = q.to(dt).view(B, Tq, H_kv, G, D).permute(0, 2, 3, 1, 4)  # (B, H_kv, G, Tq, D)
    kh = k_cache.to(dt).permute(0, 2, 1, 3).unsqueeze(2)  # (B, H_kv, 1, T_max, D)
    vh = v_cache.to(dt).permute(0, 2, 1, 3).unsqueeze(2)
    scores = (qg @ kh.transpose(-1, -2)).to(soft_dt) * scale  # (B, H_kv, G, Tq, T_max)
    visible = visible_keys(cache_seqlens, Tq, T_max, window_size)  # (B, Tq, T_max)
    if gate_cache is not None:
        pos = (cache_seqlens.long()[:, None] - Tq + torch.arange(Tq, device=q.device)).clamp_min(0)  # (B, Tq)
        c_q = gate_cache.gather(1, pos[:, :, None].expand(B, Tq, H))  # (B, Tq, H)
        c_q = c_q.permute(0, 2, 1).reshape(B, H_kv, G, Tq, 1)
        c_k = gate_cache.permute(0, 2, 1).reshape(B, H_kv, G, 1, T_max)
        scores = scores + (c_q.to(torch.float64) - c_k.to(torch.float64)).to(soft_dt)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H_kv, G, Tq)
    p = torch.softmax(scores, dim=-1).to(dt)
    o = (p @ vh).permute(0, 3, 1, 2, 4).reshape(B, Tq, H, D)
    return o, lse.reshape(B, H, Tq)
