"""Our Triton flash-attention kernel as a model backend (kernels/flash_attention)."""
from typing import Optional

import torch

from kernels import flash_attn, flash_attn_qkvpacked
from model.attention.masks import cu_seqlens_from_doc_ids


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    dropout_p: float = 0.0,
    g: Optional[torch.Tensor] = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """q: (B, T, H, D); k, v: (B, T, H_kv, D); doc_ids: (B, T) or None. Returns o: (B, T, H, D).

    With document ids the batch is packed into one sequence of B*T tokens and the kernel's varlen
    path (cu_seqlens) keeps every document to itself. dropout_p: the kernel's dropout of the
    attention probabilities (Philox bits, seeded from torch's generator of q's device); pass 0
    outside training. g: (B, T, H) float32 log forget gates or None: the kernel adds c_i - c_j,
    c = cumsum(g) restarting at each document (kernels/flash_attention/gate.py). kernel: the forward
    kernel (attention.kernel: auto, tl or gluon).
    """
    if doc_ids is None:
        return flash_attn(q, k, v, causal=True, window_size=window, dropout_p=dropout_p, g=g, kernel=kernel)
    B, T, H, D = q.shape
    cu_seqlens, max_seqlen = cu_seqlens_from_doc_ids(doc_ids)
    packed = (x.reshape(1, B * T, x.shape[2], D) for x in (q, k, v))
    o = flash_attn(*packed, causal=True, window_size=window, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                   dropout_p=dropout_p, g=packed_gate(g), kernel=kernel)
    return o.view(B, T, H, D)


def attend_packed(
    qkv: torch.Tensor,
    n_head: int,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    dropout_p: float = 0.0,
    g: Optional[torch.Tensor] = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """``attend`` of the q, k, v packed in qkv: (B, T, n_head + 2 * H_kv, D), the fused projection's
    output. Returns o: (B, T, n_head, D); the backward writes qkv's gradient as one tensor, so
    nothing concatenates dq, dk and dv (see kernels/flash_attention/function.py)."""
    if doc_ids is None:
        return flash_attn_qkvpacked(qkv, n_head, causal=True, window_size=window, dropout_p=dropout_p, g=g,
                                    kernel=kernel)
    B, T, _, D = qkv.shape
    cu_seqlens, max_seqlen = cu_seqlens_from_doc_ids(doc_ids)
    packed = qkv.reshape(1, B * T, qkv.shape[2], D)
    o = flash_attn_qkvpacked(packed, n_head, causal=True, window_size=window, cu_seqlens=cu_seqlens,
                             max_seqlen=max_seqlen, dropout_p=dropout_p, g=packed_gate(g), kernel=kernel)
    return o.view(B, T, n_head, D)


def packed_gate(g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Log gates (B, T, H) as one packed row (1, B*T, H), the layout of the packed q, k, v; None stays None."""
    return None if g is None else g.reshape(1, -1, g.shape[2])


def forward_kernel(kernel: str, device: torch.device, dtype: torch.dtype, n_head: int, n_kv_head: int,
                   head_dim: int, seq_len: int, features: bool) -> str:
    """The forward that attention.kernel gives a model's calls of seq_len tokens: "gluon" (the Hopper
    kernel, kernels/flash_attention/hopper.py) or "tl". ``features``: a window, dropout, gate or document
    masks is in use (the Hopper forward has none yet)."""
    if kernel == "tl" or features or device.type != "cuda":
        return "tl"
    from kernels.flash_attention.function import kernel_choice

    q = torch.empty(1, 1, n_head, head_dim, device=device, dtype=dtype).expand(1, seq_len, n_head, head_dim)
    k = torch.empty(1, 1, n_kv_head, head_dim, device=device, dtype=dtype).expand(1, seq_len, n_kv_head, head_dim)
    return kernel_choice(kernel, q, k, k, 0, None, 0.0, None)


def kept_ops() -> tuple:
    """The kernel's forward op, whose output and lse activation checkpointing keeps (``Attention.kept_ops``)."""
    from kernels.flash_attention.function import flash_attn_fwd

    return (flash_attn_fwd,)
