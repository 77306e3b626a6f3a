"""Which keys each query may attend to, in the two forms the backends take, and the forget gate's bias.

A boolean mask (naive, hybrid, sdpa) is True where a query may attend to a key. Three rules
combine: causality (key position <= query position), an optional sliding window (query - key <
window) and optional document boundaries (query and key carry the same document id). A kernel with
a packed-sequence path (flash) takes the document boundaries as ``cu_seqlens`` instead.

The forget gate (model.gate=forget) adds c_i - c_j to the score of query i and key j, with c the
cumulative sum of the log gates g along the sequence. Within a document c_i - c_j is the same
whether c restarts at the document's first token or not, and scores across documents are masked,
so the backends with a mask take one cumulative sum along each row (float64, so c's own rounding
does not grow with T) and the bias of a (query, key) pair is the float64 difference, rounded once.
"""
from typing import Optional, Tuple

import torch


def allowed(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: Optional[int] = None,
    doc_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Mask of the (query, key) pairs that may attend.

    q_pos: (Tq,) and k_pos: (Tk,) absolute token positions; doc_ids: (B, T) document index of each
    position, or None. Returns (1, 1, Tq, Tk) without doc_ids, else (B, 1, Tq, Tk).
    """
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask = mask & (diff < window)
    mask = mask[None, None]
    if doc_ids is not None:
        same_doc = doc_ids[:, q_pos, None] == doc_ids[:, None, k_pos]
        mask = mask & same_doc[:, None]
    return mask


def group_queries(q: torch.Tensor, n_kv_head: int) -> torch.Tensor:
    """View queries by the key/value head they share (grouped-query attention, no copy of K/V).

    q: (B, T, H, D) -> (B, H_kv, G, T, D) where G = H // H_kv.
    """
    B, T, H, D = q.shape
    return q.view(B, T, n_kv_head, H // n_kv_head, D).permute(0, 2, 3, 1, 4)


def ungroup_output(o: torch.Tensor) -> torch.Tensor:
    """Inverse of ``group_queries`` for the output: (B, H_kv, G, T, D) -> (B, T, H, D)."""
    B, Hkv, G, T, D = o.shape
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * G, D)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, 1, T, D): keys/values laid out to broadcast over query groups."""
    return x.permute(0, 2, 1, 3).unsqueeze(2)


def cu_seqlens_from_doc_ids(doc_ids: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """doc_ids: (B, T) non-decreasing per row. Returns (cu_seqlens, max_seqlen) over the flattened
    (B * T) sequence, where a new row also starts a document: cu_seqlens (N + 1,) int32 on doc_ids'
    device holds the start of each of the N documents and then B * T. max_seqlen syncs with the device.
    """
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)  # (B, T)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    begin = torch.nonzero(starts.flatten()).flatten()
    end = torch.tensor([B * T], device=doc_ids.device)
    cu_seqlens = torch.cat([begin, end]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def gate_cumsum(g: torch.Tensor) -> torch.Tensor:
    """c = cumsum(g) along the sequence in float64. g: (B, T, H) log forget gates -> c: (B, T, H)."""
    return g.to(torch.float64).cumsum(dim=1)


def gate_bias(c_q: torch.Tensor, c_k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scores' bias c_i - c_j in ``dtype``: c_q (..., Tq) at the queries, c_k (..., Tk) at the keys
    (float64, the same leading dims) -> (..., Tq, Tk)."""
    return (c_q[..., :, None] - c_k[..., None, :]).to(dtype)
