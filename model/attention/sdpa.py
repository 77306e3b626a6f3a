"""PyTorch's scaled_dot_product_attention: the reference backend.

PyTorch picks its own kernel (cuDNN, FlashAttention-2, memory-efficient or math) by device, dtype
and shape. With document boundaries or a window the causal rule is passed as an explicit mask,
which rules out the FlashAttention-2 kernel.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from model.attention.masks import allowed


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """q: (B, T, H, D); k, v: (B, T, H_kv, D); doc_ids: (B, T) or None. Returns o: (B, T, H, D).

    dropout_p: SDPA's dropout of the attention probabilities; pass 0 outside training.
    """
    T = q.shape[1]
    gqa = q.shape[2] != k.shape[2]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    if doc_ids is None and window is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    else:
        pos = torch.arange(T, device=q.device)
        mask = allowed(pos, pos, window, doc_ids)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
    return o.transpose(1, 2)
