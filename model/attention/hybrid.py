"""Hybrid attention (seed 001): a loop over query blocks, each attending to all its visible keys at once.

Each block of queries scores against every key it can see in one matmul, takes a plain softmax and
multiplies by V, so the largest score tensor is one block's (B*H, rows, keys) instead of naive's
(B*H, T, T). Autograd does the backward; it keeps each block's probabilities, about half of naive's
T x T (the causal half, in q's dtype), and never holds more than one block's scores and their
gradients at a time.

What makes it fast in eager mode and quick to compile:
- few, large blocks: ``query_blocks`` sizes them so one block's scores fit a byte budget (32 MiB,
  L2-sized on an H100: 48 heads x 160 rows x 2048 keys in bf16 at (B*H, T) = (48, 2048)),
  cutting the causal triangle into pieces of about equal area, so there is one Python iteration
  per budget's worth of work rather than per 64 rows;
- one batched matmul per block with no broadcasting: keys and values are (B*H_kv, T, D) and the
  query heads sharing a key/value head are stacked as rows (blocks.py), so GQA repeats nothing;
- a mask only where one is needed: the block's diagonal and the window's edge (every key with
  document masks), written into the scores in place and outside autograd. That is exact: a
  masked score's probability is exactly 0, so the softmax's gradient there is exactly 0 with or
  without the mask in the graph, and the backward saves a pass over every block's scores;
- the softmax in q's dtype: PyTorch computes it in fp32 (max, exponentials and sum) and rounds
  its output once, which for bf16 equals (bitwise, on CPU) naive's
  ``softmax(scores.float()).to(bf16)``, while autograd keeps one 2-byte copy of the
  probabilities instead of fp32 and bf16 ones (the dtype is passed explicitly: CUDA autocast
  would otherwise run the softmax in and out of fp32);
- query blocks from one ``split`` (its backward is one concatenation) and block outputs joined by
  one ``cat`` straight into the (B, T, H, D) layout: one copy forward, views backward. Writing
  each block into a preallocated output would cost more, since autograd's backward of every such
  in-place write copies the whole output gradient.
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from model.attention.blocks import (
    block_gate_bias,
    block_output,
    first_visible_key,
    gate_by_head,
    join_blocks,
    keys_by_head,
    masked_key_ranges,
    scaled_query_rows,
    split_rows,
)
from model.attention.masks import allowed

SCORE_BUDGET_BYTES = 32 * 2**20  # one block's scores, all heads: about an H100's L2 (50 MB)
ROW_MULTIPLE = 16  # block heights are multiples of this (tensor-core friendly)
MIN_ROWS = 64  # never fewer rows per block than this, whatever the budget


def query_blocks(
    T: int,
    heads: int,
    itemsize: int,
    window: Optional[int] = None,
    block_size: Optional[int] = None,
    budget_bytes: Optional[int] = None,
) -> List[Tuple[int, int]]:
    """The query blocks [(start, end), ...] that cover [0, T) in order.

    heads: score matrices per position (B * H); itemsize: bytes per score (q's element size).
    ``block_size`` forces blocks of that many rows (the last one shorter). ``None`` sizes them:
    walking back from the last query, each block takes the most rows (a multiple of ROW_MULTIPLE,
    at least MIN_ROWS) whose scores, heads x rows x visible keys x itemsize, fit ``budget_bytes``
    (default SCORE_BUDGET_BYTES); the first block takes what is left once that fits the budget or
    is under MIN_ROWS. Later blocks see more keys, so they get fewer rows, and every block holds
    about the same number of scores: about half as many blocks as equal heights for the same peak.
    Examples in bf16: (B*H, T) = (48, 2048) gives 8 blocks, from 160 rows (the last) to 496;
    (12, 2048) gives 3 (672, 1008 and 368 rows); (192, 256), model=small's, one.
    """
    if block_size is not None:
        return [(start, min(start + block_size, T)) for start in range(0, T, block_size)]
    budget = SCORE_BUDGET_BYTES if budget_bytes is None else budget_bytes
    per_head = max(1, budget // (heads * itemsize))  # scores one block may hold per head
    blocks = []
    end = T
    while end > 0:
        rows = _rows_within(per_head, end, window)
        if end - rows < MIN_ROWS:
            rows = end
        blocks.append((end - rows, end))
        end -= rows
    return blocks[::-1]


def _rows_within(scores: int, end: int, window: Optional[int]) -> int:
    """Most rows ending at ``end`` whose rows x visible keys <= scores, rounded to the block rules.

    A block of r rows ending at ``end`` sees min(end, r + window - 1) keys: r <= scores // end
    bounds the first, r (r + window - 1) <= scores the second; the larger bound suffices.
    """
    rows = scores // end
    if window is not None:
        w = window - 1
        rows = max(rows, (math.isqrt(w * w + 4 * scores) - w) // 2)
    return min(end, max(MIN_ROWS, rows // ROW_MULTIPLE * ROW_MULTIPLE))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    block_size: Optional[int] = None,
    dropout_p: float = 0.0,
    g: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention computed one query block at a time.

    q: (B, T, H, D); k, v: (B, T, H_kv, D) with H % H_kv == 0; doc_ids: (B, T) or None.
    block_size: rows per query block, or None to size them from T, B*H and q's dtype
    (``query_blocks``). dropout_p: probability of dropping each attention probability (kept ones
    scaled by 1 / (1 - dropout_p)); pass 0 outside training. g: (B, T, H) float32 log forget gates
    or None: each block's scores gain c_i - c_j (masks.py) and then live, and take their softmax,
    in fp32 (fp64 for fp64 inputs). Returns o: (B, T, H, D) in q's dtype. Saved for backward: each
    block's probabilities in q's dtype (and its dropout mask), plus views of q, k and v.
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    queries = scaled_query_rows(q, Hkv)  # (B*Hkv, T, G, D)
    keys, values = keys_by_head(k), keys_by_head(v)  # (B*Hkv, T, D)
    pos = torch.arange(T, device=q.device)
    spans = query_blocks(T, B * H, q.element_size(), window, block_size)
    tallest = max(end - start for start, end in spans)
    future = torch.ones(tallest, tallest, dtype=torch.bool, device=q.device).triu_(1)  # key after query
    c = None if g is None else gate_by_head(g, Hkv)  # (B*Hkv, G, T)
    gated_dtype = torch.promote_types(q.dtype, torch.float32)
    blocks = []
    for (start, end), rows in zip(spans, split_rows(queries, spans)):
        first = first_visible_key(start, window)
        scores = torch.bmm(rows, keys[:, first:end].transpose(1, 2))  # (B*Hkv, rows*G, keys)
        if c is not None:
            scores = scores.to(gated_dtype) + block_gate_bias(c, (start, end), (first, end), gated_dtype)
        mask_scores_(scores, B, start, end, window, doc_ids, pos, future)
        probs = torch.softmax(scores, dim=-1, dtype=scores.dtype).to(q.dtype)  # (B*Hkv, rows*G, keys)
        if dropout_p > 0:
            probs = F.dropout(probs, dropout_p)
        blocks.append(block_output(torch.bmm(probs, values[:, first:end]), B, end - start))
    return join_blocks(blocks)


def mask_scores_(
    scores: torch.Tensor,
    B: int,
    start: int,
    end: int,
    window: Optional[int],
    doc_ids: Optional[torch.Tensor],
    pos: torch.Tensor,
    future: torch.Tensor,
) -> None:
    """Set to -inf, in place and outside autograd, the scores of keys the block's queries may not see.

    scores: (B*H_kv, rows*G, keys) of the queries [start, end) against the keys
    [first_visible_key(start, window), end); pos: (T,) token positions; future: (R, R) bool, True
    above the diagonal, R >= rows (the diagonal's mask, the same for every block). Only the key
    ranges of ``masked_key_ranges`` are touched. The gradient stays exact: every masked
    probability is exactly 0, so the softmax's backward writes exactly 0 there with or without
    the mask.
    """
    BHkv, _, n_keys = scores.shape
    rows, first = end - start, end - n_keys
    with torch.no_grad():
        by_row = scores.view(B, BHkv // B, rows, -1, n_keys)  # (B, Hkv, rows, G, keys)
        causal_only = doc_ids is None and (window is None or window >= rows)
        for lo, hi in masked_key_ranges(start, end, window, doc_ids is not None):
            if causal_only and (lo, hi) == (start, end):  # the diagonal, inside the window
                hidden = future[:rows, None, :rows]  # (rows, 1, rows)
            else:
                hidden = ~allowed(pos[start:end], pos[lo:hi], window, doc_ids).unsqueeze(3)  # (B|1, 1, rows, 1, hi-lo)
            by_row[..., lo - first:hi - first].masked_fill_(hidden, float("-inf"))
