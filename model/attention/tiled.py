"""Tiled attention (seed 001's "vanilla" flash attention): the flash kernel's algorithm in PyTorch.

An outer loop over query blocks and an inner loop over key blocks; each query block keeps the
online softmax's running state (seed 003) over the key blocks it sees:

    m: running row max of the scores        (detached: o does not depend on it)
    l: running sum of exp(scores - m)
    acc: running sum of exp(scores - m) @ V

and rescales l and acc by exp(m_old - m_new) whenever the max grows; o = acc / l at the end. Key
blocks that no query of the block may see (after it, causally, or before the window) are
skipped; blocks entirely inside what every query sees get no mask. Autograd does the backward.

Slow: two Python loops and about twenty small kernels per pair of blocks in the forward (about
5,000 per forward+backward at (B, H, T, D) = (4, 12, 2048, 64) with 128-row blocks). Its forward
holds one pair's scores at a time, but autograd keeps the probabilities of every pair it visits
(fp32, and a copy in q's dtype) for the backward: in training it needs the causal half of what
naive keeps. It exists to be read beside kernels/flash_attention and as a second reference in
tests.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from model.attention.blocks import (
    block_gate_bias,
    block_output,
    first_visible_key,
    fully_visible_keys,
    gate_by_head,
    join_blocks,
    keys_by_head,
    scaled_query_rows,
    split_rows,
)
from model.attention.masks import allowed


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    dropout_p: float = 0.0,
    g: Optional[torch.Tensor] = None,
    block_q: int = 128,
    block_k: int = 128,
) -> torch.Tensor:
    """Causal attention block by block with the online softmax.

    q: (B, T, H, D); k, v: (B, T, H_kv, D) with H % H_kv == 0; doc_ids: (B, T) or None.
    dropout_p: probability of dropping each attention probability; applied to the unnormalised
    block probabilities that multiply V and not to the running sum l, which makes it dropout of
    the normalised probabilities (kept ones scaled by 1 / (1 - dropout_p)). g: (B, T, H) float32 log
    forget gates or None: each pair of blocks' scores gain c_i - c_j (masks.py). block_q, block_k: rows
    of queries and keys per block. Returns o: (B, T, H, D) in q's dtype. Scores and the running
    state are fp32 for fp16/bf16/fp32 inputs (fp64 for fp64); matmuls take q's dtype, as the
    kernel's do.
    """
    B, T, H, D = q.shape
    queries = scaled_query_rows(q, k.shape[2])  # (B*Hkv, T, G, D)
    keys, values = keys_by_head(k), keys_by_head(v)  # (B*Hkv, T, D)
    c = None if g is None else gate_by_head(g, k.shape[2])  # (B*Hkv, G, T)
    spans = [(start, min(start + block_q, T)) for start in range(0, T, block_q)]
    blocks = []
    for (start, end), rows in zip(spans, split_rows(queries, spans)):
        o = attend_query_block(rows, keys, values, start, end, window, doc_ids, dropout_p, block_k, c)
        blocks.append(block_output(o.to(q.dtype), B, end - start))
    return join_blocks(blocks)


def attend_query_block(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    end: int,
    window: Optional[int],
    doc_ids: Optional[torch.Tensor],
    dropout_p: float,
    block_k: int,
    c: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The inner loop: o for the queries [start, end), rows: (B*H_kv, rows*G, D), scaled.

    keys, values: (B*H_kv, T, D); c: the forget gate's cumulative sums (B*H_kv, G, T) float64
    (blocks.gate_by_head) or None. Returns o: (B*H_kv, rows*G, D) in the accumulation dtype.
    """
    acc_dtype = torch.promote_types(rows.dtype, torch.float32)
    m = rows.new_full((*rows.shape[:2], 1), float("-inf"), dtype=acc_dtype)  # running max
    l = torch.zeros_like(m)  # running sum of exp(s - m)
    acc = rows.new_zeros(rows.shape, dtype=acc_dtype)  # running exp(s - m) @ V
    lo, hi = fully_visible_keys(start, end, window)
    first_block = first_visible_key(start, window) // block_k * block_k
    for k_start in range(first_block, end, block_k):  # later key blocks are in every query's future
        k_end = min(k_start + block_k, keys.shape[1])
        s = torch.bmm(rows, keys[:, k_start:k_end].transpose(1, 2)).to(acc_dtype)  # (B*Hkv, rows*G, cols)
        if c is not None:
            s = s + block_gate_bias(c, (start, end), (k_start, k_end), acc_dtype)
        if doc_ids is not None or k_start < lo or k_end > hi:
            s = masked(s, start, end, k_start, k_end, window, doc_ids)
        with torch.no_grad():
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that have seen no key yet
            rescale = torch.exp(m - m_safe)  # exp(m_old - m_new); 0 while m_old = -inf
        p = torch.exp(s - m_safe)  # unnormalised probabilities of this block
        l = l * rescale + p.sum(dim=-1, keepdim=True)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p)
        acc = acc * rescale + torch.bmm(p.to(values.dtype), values[:, k_start:k_end]).to(acc_dtype)
        m = m_new
    return acc / l


def masked(
    s: torch.Tensor,
    start: int,
    end: int,
    k_start: int,
    k_end: int,
    window: Optional[int],
    doc_ids: Optional[torch.Tensor],
) -> torch.Tensor:
    """s: (B*H_kv, rows*G, cols) scores of queries [start, end) against keys [k_start, k_end), with
    -inf where a query may not see the key (causality, window, documents)."""
    B = 1 if doc_ids is None else doc_ids.shape[0]
    BHkv, n_rows, cols = s.shape
    pos = torch.arange(max(end, k_end), device=s.device)
    hidden = ~allowed(pos[start:end], pos[k_start:k_end], window, doc_ids).unsqueeze(3)  # (B|1, 1, rows, 1, cols)
    by_row = s.view(B, BHkv // B, end - start, -1, cols)
    return by_row.masked_fill(hidden, float("-inf")).view(BHkv, n_rows, cols)
