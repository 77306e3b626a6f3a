"""Hybrid attention: a loop over query blocks, each attending to all its visible keys at once.

Each block of ``block_size`` queries scores against every causally visible key in one matmul with a
plain softmax, so the largest score tensor is (B, H, block_size, T) rather than (B, H, T, T).
Only the keys that can be masked for the block (the diagonal part, the window edge, document
boundaries) get a mask; autograd does the backward.
"""
import math
from typing import Optional

import torch

from model.attention.masks import allowed, group_queries, heads_first, ungroup_output


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    block_size: int = 64,
) -> torch.Tensor:
    """Causal attention computed one query block at a time.

    q: (B, T, H, D); k, v: (B, T, H_kv, D) with H % H_kv == 0; doc_ids: (B, T) or None.
    Returns o: (B, T, H, D) in q's dtype.
    """
    T, D = q.shape[1], q.shape[3]
    scale = 1.0 / math.sqrt(D)
    qg = group_queries(q, k.shape[2])  # (B, Hkv, G, T, D)
    kh, vh = heads_first(k), heads_first(v)  # (B, Hkv, 1, T, D)
    pos = torch.arange(T, device=q.device)
    blocks = []
    for start in range(0, T, block_size):
        end = min(start + block_size, T)
        first_key = 0 if window is None else max(0, start - window + 1)
        scores = (qg[:, :, :, start:end] @ kh[:, :, :, first_key:end].transpose(-1, -2)) * scale
        mask = allowed(pos[start:end], pos[first_key:end], window, doc_ids).unsqueeze(1)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        blocks.append(probs @ vh[:, :, :, first_key:end])
    return ungroup_output(torch.cat(blocks, dim=3))
