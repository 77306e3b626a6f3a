"""Our Triton flash-attention kernel as a model backend (kernels/flash_attention)."""
from typing import Optional

import torch

from kernels import flash_attn


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """q: (B, T, H, D); k, v: (B, T, H_kv, D); doc_ids: (B, T) or None. Returns o: (B, T, H, D).

    With document ids the batch is packed into one sequence of B*T tokens and the kernel's varlen
    path (cu_seqlens) keeps every document to itself.
    """
    if doc_ids is None:
        return flash_attn(q, k, v, causal=True, window_size=window)
    B, T, H, D = q.shape
    cu_seqlens = document_starts(doc_ids)
    packed = (x.reshape(1, B * T, x.shape[2], D) for x in (q, k, v))
    o = flash_attn(*packed, causal=True, window_size=window, cu_seqlens=cu_seqlens)
    return o.view(B, T, H, D)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative document boundaries of the flattened batch.

    doc_ids: (B, T) non-decreasing document index per row. Returns cu_seqlens: (N + 1,) int32 with
    0 first and B*T last; every row start is also a boundary.
    """
    B, T = doc_ids.shape
    new_doc = torch.ones_like(doc_ids, dtype=torch.bool)
    new_doc[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = new_doc.flatten().nonzero().flatten().to(torch.int32)
    end = torch.tensor([B * T], dtype=torch.int32, device=doc_ids.device)
    return torch.cat([starts, end])
