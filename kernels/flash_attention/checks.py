"""Input checks of the public functions: one ValueError per mistake, naming the argument.

They run on every call, before any work, so they stay plain comparisons; the only one that reads
the device is :func:`longest_document` (one sync), which callers skip by passing ``max_seqlen``.
"""

from __future__ import annotations

import math

import torch

from .configs import interpreting

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def check_inputs(name: str, q, k, v, causal, softmax_scale, window_size, cu_seqlens, dropout_p) -> None:
    """q: (B, T, H, D), k and v: (B, T, H_kv, D) of one float dtype and device, and the options."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must be 4-D (B, T, H, D), got shape {tuple(t.shape)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {q.dtype} not supported; use one of {DTYPES}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    if k.device != device or v.device != device:
        raise ValueError(f"{name}: q, k, v must be on one device, got {device}, {k.device}, {v.device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: tensors must be on a CUDA device (got {device}); on CPU set "
                         "TRITON_INTERPRET=1 (slow, for tests)")
    B, T, H, D = q.shape
    kv_shape = k.shape
    if kv_shape != v.shape:
        raise ValueError(f"{name}: k and v shapes differ: {tuple(kv_shape)} vs {tuple(v.shape)}")
    if kv_shape[0] != B or kv_shape[1] != T or kv_shape[3] != D:
        raise ValueError(f"{name}: k/v shape {tuple(kv_shape)} does not match q {tuple(q.shape)} in (B, T, ., D)")
    if kv_shape[2] == 0 or H % kv_shape[2] != 0:
        raise ValueError(f"{name}: query heads ({H}) must be a multiple of kv heads ({kv_shape[2]})")
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim {D} out of range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)):
        raise ValueError(f"{name}: softmax_scale must be a finite float, got {softmax_scale!r}")
    if window_size is not None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"{name}: window_size must be None or an int >= 1, got {window_size!r}")
        if not causal:
            raise ValueError(f"{name}: window_size (sliding-window attention) needs causal=True")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"{name}: cu_seqlens must be a 1-D tensor (N+1,) of cumulative document lengths")
        if cu_seqlens.dtype != torch.int32:
            raise ValueError(f"{name}: cu_seqlens must be int32, got {cu_seqlens.dtype}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"{name}: cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
        if B != 1:
            raise ValueError(f"{name}: with cu_seqlens pack the documents into batch 1 (q: (1, total_T, H, D)); "
                             f"got B={B}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"{name}: dropout_p must be a float in [0, 1), got {dropout_p!r}")


def check_gate(name: str, g, shape: tuple[int, int, int], device: torch.device) -> None:
    """g (not None) must be a float32 (B, T, H) tensor of log forget gates on the inputs' device."""
    if not (isinstance(g, torch.Tensor) and tuple(g.shape) == shape and g.dtype == torch.float32
            and g.device == device):
        got = type(g).__name__ if not isinstance(g, torch.Tensor) else f"{g.dtype} {tuple(g.shape)} on {g.device}"
        raise ValueError(f"{name}: g must be None or float32 log forget gates of shape (B, T, H) = {shape} on "
                         f"{device}; got {got}")


def longest_document(name: str, cu_seqlens: torch.Tensor, total_t: int) -> int:
    """The longest document of ``cu_seqlens`` after checking its values (start 0, end ``total_t``,
    non-decreasing): one read of the device."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total_t:
        raise ValueError(f"{name}: cu_seqlens must start at 0 and end at the packed length {total_t}; got "
                         f"first={cu[0]}, last={cu[-1]}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name}: cu_seqlens must be non-decreasing (cumulative document lengths)")
    return max(lengths)
