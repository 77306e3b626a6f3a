"""Flash-decoding's op and public function: ``nanoflash::flash_decode`` and :func:`flash_decode`.

One ``torch.library`` op with a registered fake (``kernels/ops.py``: ``define_op``, as the flash and
cross-entropy kernels' ops), called in eager and while compiling alike:
``torch.compile`` sees an opaque node shaped by the fake (no graph break), and a CUDA graph
captures its launches, since nothing in it reads the device from the host: the sequence lengths
stay on the device, and the launch settings come from shapes and the GPU only (launch.py).
Inference only: there is no backward.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..ops import define_op
from .kernel import decode_launch
from .launch import MAX_SPLITS, decode_config

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_QUERIES = 16
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def _flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                  gate_cache: Optional[torch.Tensor], softmax_scale: float, window: int,
                  num_splits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """o (B, Tq, H, D) in q's dtype and lse (B, H, Tq) float32 (natural log); window 0 = none; num_splits 0 =
    chosen here (launch.py). Arguments as :func:`flash_decode` takes them, already checked. The launch is
    chosen inside the op, where torch.compile does not trace (it reads the GPU's properties)."""
    B, T_max, H_kv, D = k_cache.shape
    config = decode_config(B, H_kv, T_max, D, q.element_size(), q.device, num_splits or None)
    return decode_launch(q, k_cache, v_cache, cache_seqlens, gate_cache, softmax_scale, window, *config)


def _flash_decode_fake(q, k_cache, v_cache, cache_seqlens, gate_cache, softmax_scale, window, num_splits):
    B, Tq, H, D = q.shape
    return q.new_empty((B, Tq, H, D)), q.new_empty((B, H, Tq), dtype=torch.float32)


flash_decode_op = define_op(
    "nanoflash::flash_decode",
    "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? gate_cache, float softmax_scale,"
    " int window, int num_splits) -> (Tensor, Tensor)",
    _flash_decode, _flash_decode_fake)


def _validate(q, k_cache, v_cache, cache_seqlens, gate_cache, softmax_scale, window_size, num_splits) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"flash_decode: {name} must be a 4-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.stride(-1) != 1:
            raise ValueError(f"flash_decode: {name} must be contiguous in its last dimension (head dim)")
    B, Tq, H, D = q.shape
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"flash_decode: q, k_cache, v_cache must share one of {_DTYPES}; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"flash_decode: k_cache and v_cache must be (B, T_max, H_kv, D) = (B={B}, ., ., D={D}); "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if H % k_cache.shape[2]:
        raise ValueError(f"flash_decode: query heads ({H}) must be a multiple of the cache's heads ({k_cache.shape[2]})")
    if not 1 <= Tq <= MAX_QUERIES:
        raise ValueError(f"flash_decode: 1 to {MAX_QUERIES} new queries (q's dim 1), got {Tq}")
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"flash_decode: head dim {D} out of range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if not (isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32
            and tuple(cache_seqlens.shape) == (B,) and cache_seqlens.is_contiguous()):
        raise ValueError(f"flash_decode: cache_seqlens must be a contiguous int32 tensor of shape ({B},)")
    if gate_cache is not None and not (gate_cache.dtype == torch.float64
                                       and tuple(gate_cache.shape) == (B, k_cache.shape[1], H)):
        raise ValueError(f"flash_decode: gate_cache must be None or float64 (B, T_max, H) = "
                         f"{(B, k_cache.shape[1], H)}; got {gate_cache.dtype} {tuple(gate_cache.shape)}")
    tensors = (q, k_cache, v_cache, cache_seqlens) + ((gate_cache,) if gate_cache is not None else ())
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"flash_decode: every tensor must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if softmax_scale is not None and not math.isfinite(softmax_scale):
        raise ValueError(f"flash_decode: softmax_scale must be finite, got {softmax_scale!r}")
    if window_size is not None and (isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1):
        raise ValueError(f"flash_decode: window_size must be None or an int >= 1, got {window_size!r}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"flash_decode: num_splits must be None or in [1, {MAX_SPLITS}], got {num_splits!r}")


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float | None = None,
    window_size: int | None = None,
    gate_cache: torch.Tensor | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
):
    """Attention of a few new queries to a KV cache that already holds their own keys and values.

    Args:
        q: (B, Tq, H, D) float16 / bfloat16 / float32, 1 <= Tq <= 16, 16 <= D <= 256; any strides
            but a contiguous last dim.
        k_cache, v_cache: (B, T_max, H_kv, D), q's dtype and device; H % H_kv == 0 (GQA: query head
            h reads KV head h // (H / H_kv), all of a KV head's query heads in one program). Rows
            0 .. cache_seqlens[b] - 1 of sequence b are its keys and values so far, the Tq new
            tokens' last; rows past that are never read.
        cache_seqlens: (B,) int32, contiguous, on the device: each sequence's length, new tokens
            included, in [Tq, T_max] (not checked: that would read the device). Sequences of
            different lengths share one call.
        softmax_scale: defaults to 1 / sqrt(D).
        window_size: None or W >= 1: the query at position p sees keys p - W < j <= p only.
        gate_cache: None, or (B, T_max, H) float64: c, the running sum of the log forget gates
            of each query head (model.gate=forget), at every position the cache holds: each
            score gains c_p - c_j.
        num_splits: programs per (sequence, KV head) that share its cache; None picks from the
            shapes and the GPU (launch.py: ``decode_config``, which also picks the tiles). Nothing
            depends on the lengths, so a CUDA graph captured once replays at any length.
        return_lse: also return each row's log-sum-exp.

    The new query t of sequence b sits at position p = cache_seqlens[b] - Tq + t and sees the
    keys j <= p: causal among the new queries.

    Returns:
        o: (B, Tq, H, D) in q's dtype (contiguous); with return_lse also lse: (B, H, Tq) float32,
        the natural-log log-sum-exp of each row's scaled (and gated) scores.

    Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (tests). Not differentiable. Raises
    ValueError on invalid shapes, dtypes or devices.
    """
    _validate(q, k_cache, v_cache, cache_seqlens, gate_cache, softmax_scale, window_size, num_splits)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    o, lse = flash_decode_op(q, k_cache, v_cache, cache_seqlens, gate_cache, float(scale), int(window_size or 0),
                             int(num_splits or 0))
    return (o, lse) if return_lse else o
