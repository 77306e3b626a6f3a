"""Layouts and key ranges shared by the backends that loop over blocks of queries (hybrid, tiled).

Both backends compute one batched matmul per block with every key/value head as a batch entry and
the query heads that share it stacked as rows, so grouped-query attention reads K and V once with
no copy per query head:

    queries (B*H_kv, T, G, D): a block of rows [start, end) is the view (B*H_kv, rows*G, D)
    keys, values (B*H_kv, T, D)

where G = H // H_kv and query head h = kv_head * G + g, as ``group_queries`` in masks.py.
"""
import math
from typing import List, Optional, Tuple

import torch

from model.attention.masks import gate_bias, gate_cumsum


def scaled_query_rows(q: torch.Tensor, n_kv_head: int) -> torch.Tensor:
    """q: (B, T, H, D) -> q / sqrt(D) laid out (B*H_kv, T, G, D), contiguous.

    The scale is applied once here instead of to every block of scores; for D = 64 (1/8) it is exact.
    """
    B, T, H, D = q.shape
    grouped = (q * (1.0 / math.sqrt(D))).view(B, T, n_kv_head, H // n_kv_head, D)
    return grouped.transpose(1, 2).contiguous().view(B * n_kv_head, T, H // n_kv_head, D)


def split_rows(queries: torch.Tensor, spans: List[Tuple[int, int]]) -> List[torch.Tensor]:
    """The query blocks [start, end) of ``spans`` (in order, covering T) as views (B*H_kv, rows*G, D).

    One ``split``, whose backward is one concatenation (slices would each add a zero-filled
    full-size gradient).
    """
    BHkv, _, G, D = queries.shape
    parts = queries.split([end - start for start, end in spans], dim=1)
    return [part.view(BHkv, part.shape[1] * G, D) for part in parts]


def keys_by_head(x: torch.Tensor) -> torch.Tensor:
    """Keys or values (B, T, H_kv, D) -> (B*H_kv, T, D), contiguous."""
    B, T, Hkv, D = x.shape
    return x.transpose(1, 2).reshape(B * Hkv, T, D)


def block_output(o: torch.Tensor, B: int, rows: int) -> torch.Tensor:
    """A block's output (B*H_kv, rows*G, D) -> (B, rows, H_kv, G, D), a view that ``join_blocks`` copies once."""
    BHkv, _, D = o.shape
    return o.view(B, BHkv // B, rows, -1, D).transpose(1, 2)


def join_blocks(blocks: List[torch.Tensor]) -> torch.Tensor:
    """Blocks of ``block_output`` in query order -> o: (B, T, H, D), contiguous (one copy)."""
    o = torch.cat(blocks, dim=1)
    B, T, Hkv, G, D = o.shape
    return o.view(B, T, Hkv * G, D)


def gate_by_head(g: torch.Tensor, n_kv_head: int) -> torch.Tensor:
    """Log forget gates g: (B, T, H) -> c = cumsum(g) (masks.py) laid out (B*H_kv, G, T), float64."""
    B, T, H = g.shape
    return gate_cumsum(g).transpose(1, 2).reshape(B * n_kv_head, H // n_kv_head, T)


def block_gate_bias(c: torch.Tensor, queries: Tuple[int, int], keys: Tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The gate's bias c_i - c_j of the queries [start, end) against the keys [k_start, k_end) in
    ``dtype``, laid out as a block's scores: c (B*H_kv, G, T) from ``gate_by_head`` ->
    (B*H_kv, rows*G, keys)."""
    bias = gate_bias(c[..., queries[0]:queries[1]], c[..., keys[0]:keys[1]], dtype)  # (B*Hkv, G, rows, keys)
    return bias.transpose(1, 2).reshape(c.shape[0], -1, keys[1] - keys[0])


def first_visible_key(start: int, window: Optional[int]) -> int:
    """The first key that any query at position >= start may see."""
    return 0 if window is None else max(0, start - window + 1)


def fully_visible_keys(start: int, end: int, window: Optional[int]) -> Tuple[int, int]:
    """Keys [lo, hi) that every query in [start, end) sees under causality and the window.

    Keys outside it (and inside the queries' visible range) need a mask; the range is empty
    (lo >= hi) when the window is shorter than the block.
    """
    lo = 0 if window is None else max(0, end - window)
    return lo, start + 1


def masked_key_ranges(start: int, end: int, window: Optional[int], documents: bool) -> List[Tuple[int, int]]:
    """The key ranges a query block [start, end) must mask: its diagonal [start, end) and the window's edge.

    With document masks every visible key may belong to another document: the whole visible range.
    """
    first = first_visible_key(start, window)
    lo, hi = fully_visible_keys(start, end, window)
    if documents or lo >= hi:
        return [(first, end)]
    return [(a, b) for a, b in ((first, lo), (start, end)) if a < b]
