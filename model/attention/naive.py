"""Naive attention: the textbook version with the full (T x T) score matrix in memory."""
import math
from typing import Optional

import torch
import torch.nn.functional as F

from model.attention.masks import allowed, gate_bias, gate_cumsum, group_queries, heads_first, ungroup_output


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    dropout_p: float = 0.0,
    g: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v, materialising every score.

    q: (B, T, H, D); k, v: (B, T, H_kv, D) with H % H_kv == 0; doc_ids: (B, T) or None.
    dropout_p: probability of dropping each attention probability (kept ones scaled by
    1 / (1 - dropout_p)); pass 0 outside training. g: (B, T, H) float32 log forget gates or None;
    the scores gain c_i - c_j, c = cumsum(g) (masks.py), in the softmax's dtype. Returns
    o: (B, T, H, D) in q's dtype. Scores live as (B, H_kv, G, T, T); the softmax runs in fp32
    (fp64 for fp64 inputs).
    """
    T, D = q.shape[1], q.shape[3]
    qg = group_queries(q, k.shape[2])  # (B, Hkv, G, T, D)
    scores = (qg @ heads_first(k).transpose(-1, -2)) * (1.0 / math.sqrt(D))  # (B, Hkv, G, T, T)
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    if g is not None:
        c = gate_cumsum(g).transpose(1, 2).reshape(qg.shape[:4])  # (B, Hkv, G, T)
        scores = scores.to(softmax_dtype) + gate_bias(c, c, softmax_dtype)
    pos = torch.arange(T, device=q.device)
    mask = allowed(pos, pos, window, doc_ids).unsqueeze(1)  # (B|1, 1, 1, T, T)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.to(softmax_dtype), dim=-1).to(v.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return ungroup_output(probs @ heads_first(v))
