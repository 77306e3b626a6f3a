"""Attention backends: one file each, one registry.

Every backend is a function ``attend(q, k, v, doc_ids=None, window=None) -> o`` with
q: (B, T, H, D), k and v: (B, T, H_kv, D) (grouped-query attention when H_kv < H), causal, scaled
by 1/sqrt(D), and o: (B, T, H, D). ``build_attention`` turns an AttentionConfig into such a function
and says which backend actually runs.

A backend may also offer ``attend.packed(qkv, n_head, doc_ids=None) -> o`` taking q, k and v side by
side in qkv: (B, T, H + 2 * H_kv, D), as the fused projection makes them; the model uses it when
nothing (RoPE) changes q and k after the projection. flash does: its backward then returns qkv's
gradient as one tensor instead of three that autograd concatenates.
"""
import functools
import warnings
from typing import Callable, Tuple

import torch

from model.attention import hybrid, naive, sdpa
from model.config import AttentionConfig
from training.errors import UserError

Attend = Callable[..., torch.Tensor]


def flash_unavailable_reason(device: torch.device) -> str:
    """Why our Triton kernel cannot run on ``device``; empty when it can."""
    try:
        from kernels import flash_attn_available
    except ImportError as err:  # triton missing (Windows, macOS)
        return f"triton is not importable ({err})"
    ok, reason = flash_attn_available()
    if not ok:
        return reason
    if device.type != "cuda" and not _interpreting():
        return f"the kernel runs on CUDA GPUs and this run uses {device.type}"
    return ""


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def build_attention(cfg: AttentionConfig, device: torch.device) -> Tuple[Attend, str]:
    """The backend function for ``cfg`` on ``device`` and the name of the backend that will run.

    ``attention=flash`` on a machine where the kernel cannot run falls back to sdpa with one
    warning, or fails when ``attention.strict=true``.
    """
    if cfg.name == "naive":
        return functools.partial(naive.attend, window=cfg.window), "naive"
    if cfg.name == "hybrid":
        return functools.partial(hybrid.attend, window=cfg.window, block_size=cfg.block_size), "hybrid"
    if cfg.name == "sdpa":
        return functools.partial(sdpa.attend, window=cfg.window), "sdpa"
    if cfg.name == "flash":
        reason = flash_unavailable_reason(device)
        if not reason:
            from model.attention import flash

            attend = functools.partial(flash.attend, window=cfg.window)
            attend.packed = functools.partial(flash.attend_packed, window=cfg.window)
            return attend, "flash"
        if cfg.strict:
            raise UserError(f"attention=flash cannot run: {reason}; drop attention.strict=true to fall back to sdpa")
        warnings.warn(f"attention=flash cannot run ({reason}); using attention=sdpa instead", stacklevel=2)
        return functools.partial(sdpa.attend, window=cfg.window), "sdpa"
    raise UserError(f"attention={cfg.name!r} is not a backend; choose one of naive, hybrid, sdpa, flash")
