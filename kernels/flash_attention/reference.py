"""Plain PyTorch attention with the same interface as the kernel: the math it must reproduce.

Materialises the (T, T) score matrix, so use it for tests and small shapes only. The tests run it
in float64 as ground truth, and in the input's own dtype to measure how much error a
low-precision implementation makes anyway (that sets the kernel's tolerance).
"""

from __future__ import annotations

import math

import torch


def attention_mask(
    T: int,
    causal: bool,
    window_size: int | None,
    cu_seqlens: torch.Tensor | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean (T, T) mask, True where query i may attend key j.

    causal: j <= i; window W: i - W < j <= i; cu_seqlens: i and j in the same document.
    """
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    mask = torch.ones(T, T, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if window_size is not None:
        mask &= (i - j) < window_size
    if cu_seqlens is not None:
        doc = torch.bucketize(torch.arange(T, device=cu_seqlens.device), cu_seqlens[1:].long(),
                              right=True).to(device)
        mask &= doc[:, None] == doc[None, :]
    return mask


def gate_bias(g: torch.Tensor, cu_seqlens: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, T, T) bias c_i - c_j in ``dtype`` of log forget gates g (B, T, H), c = cumsum(g)
    along the sequence in ``dtype``, restarting at each document of ``cu_seqlens``. Differentiable
    in g."""
    gh = g.to(dtype).transpose(1, 2)  # (B, H, T)
    if cu_seqlens is None:
        c = gh.cumsum(-1)
    else:
        lengths = cu_seqlens.diff().tolist()
        c = torch.cat([doc.cumsum(-1) for doc in gh.split(lengths, dim=-1)], dim=-1)
    return c[..., :, None] - c[..., None, :]


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = torch.float64,
    dropout_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    g: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention.

    q: (B, T, H, D); k, v: (B, T, H_kv, D), H % H_kv == 0 (GQA: head h uses kv head h // G).
    compute_dtype: dtype of the matmuls (None: the inputs' dtype); the softmax runs in at least
    float32. dropout_p > 0: the probabilities are multiplied by keep / (1 - dropout_p), keep being
    ``dropout_mask`` (bool (B, H, T, T), e.g. the kernel's own from ``flash_dropout_mask``) or,
    without one, a fresh Bernoulli(1 - dropout_p) draw from torch's generator.
    g: None or (B, T, H) log forget gates: the scores gain c_i - c_j (``gate_bias``), computed in
    the softmax's dtype as a plain implementation would (in float32, c's own rounding grows with
    |c|, i.e. with T).
    Returns o: (B, T, H, D) in compute_dtype and lse: (B, H, T) (natural log, of the un-dropped
    scores) in at least float32. Differentiable (autograd through plain ops).
    """
    B, T, H, D = q.shape
    G = H // k.shape[2]
    dt = compute_dtype or q.dtype
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    soft_dt = torch.float64 if dt == torch.float64 else torch.float32
    qh = q.to(dt).transpose(1, 2)  # (B, H, T, D)
    kh = k.to(dt).transpose(1, 2).repeat_interleave(G, dim=1)
    vh = v.to(dt).transpose(1, 2).repeat_interleave(G, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)).to(soft_dt) * scale  # (B, H, T, T)
    if g is not None:
        scores = scores + gate_bias(g, cu_seqlens, soft_dt)
    mask = attention_mask(T, causal, window_size, cu_seqlens, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, T)
    p = torch.softmax(scores, dim=-1).to(dt)
    if dropout_p > 0:
        keep = dropout_mask if dropout_mask is not None else torch.rand(p.shape, device=p.device) >= dropout_p
        p = p.masked_fill(~keep, 0.0) * (1.0 / (1.0 - dropout_p))
    o = torch.matmul(p, vh).transpose(1, 2)  # (B, T, H, D)
    return o, lse
