"""PyTorch's scaled_dot_product_attention: the reference backend.

PyTorch picks its own kernel (cuDNN, FlashAttention-2, memory-efficient or math) by device, dtype
and shape. With document boundaries or a window the causal rule is passed as an explicit mask,
which rules out the FlashAttention-2 kernel. With a forget gate the mask is a float one (the gate's
bias c_i - c_j, -inf where a key is hidden) and q, k, v go in as fp32 so the bias keeps fp32's
precision: a slow path, the reference for the gate beside naive.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from model.attention.masks import allowed, gate_bias, gate_cumsum


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    dropout_p: float = 0.0,
    g: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q: (B, T, H, D); k, v: (B, T, H_kv, D); doc_ids: (B, T) or None. Returns o: (B, T, H, D).

    dropout_p: SDPA's dropout of the attention probabilities; pass 0 outside training.
    g: (B, T, H) float32 log forget gates or None (the scores gain c_i - c_j, masks.py).
    """
    T = q.shape[1]
    gqa = q.shape[2] != k.shape[2]
    if g is not None:
        return gated(q, k, v, g, doc_ids, window, dropout_p)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    if doc_ids is None and window is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    else:
        pos = torch.arange(T, device=q.device)
        mask = allowed(pos, pos, window, doc_ids)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
    return o.transpose(1, 2)


def gated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, doc_ids: Optional[torch.Tensor],
          window: Optional[int], dropout_p: float) -> torch.Tensor:
    """``attend`` with the forget gate: a float (B, H, T, T) mask of c_i - c_j and -inf, in fp32 (fp64
    for fp64 inputs), outside autocast. Returns o: (B, T, H, D) in q's dtype."""
    T = q.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    c = gate_cumsum(g).transpose(1, 2)  # (B, H, T)
    pos = torch.arange(T, device=q.device)
    bias = gate_bias(c, c, dtype).masked_fill(~allowed(pos, pos, window, doc_ids), float("-inf"))
    qh, kh, vh = (x.transpose(1, 2).to(dtype) for x in (q, k, v))  # (B, H, T, D)
    with torch.autocast(q.device.type, enabled=False):  # autocast would run SDPA in bf16/fp16
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, dropout_p=dropout_p,
                                           enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2).to(q.dtype)


def kept_ops() -> tuple:
    """SDPA's fused kernels as aten ops (those this torch has), whose outputs activation checkpointing keeps
    (``Attention.kept_ops``); its math path is a composite of matmuls and is recomputed."""
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable")
    return tuple(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))
