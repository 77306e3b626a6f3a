"""Flash attention: one ``torch.library`` op pair, one ``autograd.Function``, the public function.

``nanoflash::flash_attn_fwd`` and ``nanoflash::flash_attn_bwd`` are defined with
``torch.library.define`` + ``torch.library.impl`` (one implementation for every device: CUDA, or
CPU under ``TRITON_INTERPRET=1``) and have fake implementations, so ``torch.compile`` treats them
as opaque calls and a model that calls :func:`flash_attn` compiles with ``fullgraph=True`` and no
graph break. Autograd is one ``torch.autograd.Function`` around them (not the ops' own
``register_autograd``): eager calls and compiled graphs take the same path, without
``custom_op``'s Python autograd layer (FlashAttention's ``flash_attn_interface.py`` is built the
same way). :func:`define_op` returns a caller that enters the op while ``torch.compile`` traces
and, in eager, calls the op's one implementation itself: the dispatcher's boundary costs host
time on every call and changes nothing there (an eager call would reach the same function).

Saved for backward: q, k, v, o (B, T, H, D), lse (B, H, T) float32, cu_seqlens, with dropout
the (2,) int64 RNG state the forward drew (``dropout.py``) and with a forget gate g (B, T, H)
float32 (``gate.py``) -- O(T) memory, no T x T: the backward regenerates the dropout mask and
recomputes the gate's cumulative sum from them. The backward op returns dq, dk, dv and dg (an
empty float32 tensor when there is no gate: an op's outputs are tensors).
"""

from __future__ import annotations

import math
import os

import torch

from .backward import attn_bwd
from .dropout import draw_dropout_rng
from .forward import attn_fwd

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total_t: int) -> None:
    """Value checks that need the host (run inside the op, so compile tracing never sees them)."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total_t:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the packed length {total_t}; got "
            f"first={cu[0]}, last={cu[-1]}"
        )
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_seqlens must be non-decreasing (cumulative document lengths)")


def define_op(name: str, schema: str, impl, fake):
    """Define ``nanoflash::<name>`` with ``schema``, ``impl`` as its implementation for every device
    (CUDA, or CPU under the interpreter) and ``fake`` for tracing. Returns the function to call:
    the op's overload while ``torch.compile`` traces (an opaque node, shaped by ``fake``), ``impl``
    itself in eager (what the dispatcher would run, without its boundary's host time); ``.op`` is
    the overload."""
    qualname = f"nanoflash::{name}"
    torch.library.define(qualname, schema)
    torch.library.impl(qualname, "default", impl)
    torch.library.register_fake(qualname)(fake)
    op = getattr(torch.ops.nanoflash, name).default  # the overload: no packet lookup per call

    def call(*args):
        return op(*args) if torch.compiler.is_compiling() else impl(*args)

    call.op = op
    return call


def checked_forward(q, k, v, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p):
    """``attn_fwd`` after the cu_seqlens value checks: o (B, T, H, D) in q.dtype, lse (B, H, T)
    float32 natural log; window 0 = none. The implementation of both forward ops."""
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, q.shape[1])
    return attn_fwd(q, k, v, softmax_scale, causal, window, cu_seqlens, rng, dropout_p, g)


def _flash_attn_fwd_fake(q, k, v, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p):
    B, T, H, D = q.shape
    return q.new_empty((B, T, H, D)), q.new_empty((B, H, T), dtype=torch.float32)


def gate_grad_or_empty(dg: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The backward ops' dg output: ``dg``, or an empty float32 tensor when there is no gate."""
    return dg if dg is not None else like.new_empty((0,), dtype=torch.float32)


def gate_grad_fake(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return g.new_empty(g.shape) if g is not None else like.new_empty((0,), dtype=torch.float32)


def _flash_attn_bwd(do, q, k, v, o, lse, dlse, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p):
    """dq, dk, dv (contiguous, dtypes of q, k, v) and dg from do (B, T, H, D) and optional dlse."""
    dq, dk, dv, dg = attn_bwd(do, q, k, v, o, lse, softmax_scale, causal, window, cu_seqlens, dlse, rng, dropout_p,
                              g=g)
    return dq, dk, dv, gate_grad_or_empty(dg, q)


def _flash_attn_bwd_fake(do, q, k, v, o, lse, dlse, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), gate_grad_fake(g, q)


flash_attn_fwd = define_op(
    "flash_attn_fwd",
    "(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens, Tensor? rng, Tensor? g, float softmax_scale, bool causal,"
    " int window, float dropout_p) -> (Tensor, Tensor)",
    checked_forward, _flash_attn_fwd_fake)
flash_attn_bwd = define_op(
    "flash_attn_bwd",
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? dlse, Tensor? cu_seqlens,"
    " Tensor? rng, Tensor? g, float softmax_scale, bool causal, int window, float dropout_p)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    _flash_attn_bwd, _flash_attn_bwd_fake)


class FlashAttnFunction(torch.autograd.Function):
    """Autograd of :func:`flash_attn`: the forward op, then the backward op on the saved tensors."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p):
        o, lse = flash_attn_fwd(q, k, v, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, rng, g)
        ctx.options = (softmax_scale, causal, window, dropout_p)
        ctx.set_materialize_grads(False)  # lse's grad stays None unless the caller used lse
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, cu_seqlens, rng, g = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv, dg = flash_attn_bwd(do, q, k, v, o, lse, dlse, cu_seqlens, rng, g, *ctx.options)
        return dq, dk, dv, None, None, dg if g is not None else None, None, None, None, None


def validate_gate(name: str, g, shape: tuple[int, int, int], device: torch.device) -> None:
    """g must be None or a float32 (B, T, H) tensor of log forget gates on the inputs' device."""
    if g is None:
        return
    if not (isinstance(g, torch.Tensor) and tuple(g.shape) == shape and g.dtype == torch.float32
            and g.device == device):
        got = (f"{type(g).__name__}" if not isinstance(g, torch.Tensor)
               else f"{g.dtype} {tuple(g.shape)} on {g.device}")
        raise ValueError(f"{name}: g must be None or float32 log forget gates of shape (B, T, H) = {shape} on "
                         f"{device}; got {got}")


def _validate(q, k, v, causal, softmax_scale, window_size, cu_seqlens, dropout_p) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"flash_attn: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"flash_attn: {name} must be 4-D (B, T, H, D), got shape {tuple(t.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"flash_attn: dtype {q.dtype} not supported; use one of {_DTYPES}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"flash_attn: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"flash_attn: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"flash_attn: tensors must be on a CUDA device (got {q.device}); on CPU set "
            "TRITON_INTERPRET=1 (slow, for tests)")
    B, T, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"flash_attn: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(
            f"flash_attn: k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in "
            "(B, T, ., D)")
    H_kv = k.shape[2]
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"flash_attn: query heads ({H}) must be a multiple of kv heads ({H_kv})")
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(
            f"flash_attn: head dim {D} out of range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and math.isfinite(softmax_scale)):
        raise ValueError(f"flash_attn: softmax_scale must be a finite float, got {softmax_scale!r}")
    if window_size is not None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"flash_attn: window_size must be None or an int >= 1, got "
                             f"{window_size!r}")
        if not causal:
            raise ValueError("flash_attn: window_size (sliding-window attention) needs causal=True")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
                or cu_seqlens.numel() < 2:
            raise ValueError("flash_attn: cu_seqlens must be a 1-D tensor (N+1,) of cumulative "
                             "document lengths")
        if cu_seqlens.dtype != torch.int32:
            raise ValueError(f"flash_attn: cu_seqlens must be int32, got {cu_seqlens.dtype}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"flash_attn: cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
        if B != 1:
            raise ValueError(
                f"flash_attn: with cu_seqlens pack the documents into batch 1 "
                f"(q: (1, total_T, H, D)); got B={B}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"flash_attn: dropout_p must be a float in [0, 1), got {dropout_p!r}")


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    g: torch.Tensor | None = None,
):
    """Flash attention (Triton), differentiable in q, k, v (and g).

    Args:
        q: (B, T, H, D) float16 / bfloat16 / float32, 16 <= D <= 256 (any D; padded inside).
        k, v: (B, T, H_kv, D), same dtype and device; H % H_kv == 0 (GQA: query head h uses
            kv head h // (H / H_kv); no repeat_interleave).
        causal: query i sees keys j <= i; False gives full (bidirectional) attention.
        softmax_scale: defaults to 1 / sqrt(D).
        window_size: None or W >= 1 (needs causal): query i sees keys i - W < j <= i.
        cu_seqlens: None or int32 (N+1,) cumulative document lengths of a packed batch
            (B must be 1, cu_seqlens[-1] == T); attention never crosses a document boundary.
        return_lse: also return the log-sum-exp of each row's scaled scores.
        dropout_p: probability in [0, 1) of dropping each attention probability (the kept ones
            are scaled by 1 / (1 - p); the lse stays that of the un-dropped scores). The mask is
            drawn from torch's generator of q's device (``torch.manual_seed`` repeats it; each
            replay of a captured CUDA graph draws a new one) and regenerated in the backward.
            Apply it in training only: this function does not know the module's mode. 0 runs the
            plain kernels.
        g: None, or (B, T, H) float32 log forget gates, one per token and query head (under GQA
            each query head has its own): every score gains c_i - c_j with c = cumsum(g) along the
            sequence (restarting at each document of ``cu_seqlens``), i.e. the sum of g over
            j < l <= i (the Forgetting Transformer's decay; g <= 0 there, any finite value works).
            None runs the plain kernels. Differentiable: g's gradient is returned too.

    Returns:
        o: (B, T, H, D), q's dtype (contiguous); and, if return_lse, lse: (B, H, T) float32 in
        natural-log units (differentiable too).

    T and H strides may be arbitrary; a non-contiguous last dim is copied. Runs on CUDA, or on CPU
    under TRITON_INTERPRET=1. Raises ValueError on invalid inputs.
    """
    _validate(q, k, v, causal, softmax_scale, window_size, cu_seqlens, dropout_p)
    validate_gate("flash_attn", g, tuple(q.shape[:3]), q.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    rng = draw_dropout_rng(q.device) if dropout_p > 0 else None
    o, lse = FlashAttnFunction.apply(q, k, v, cu_seqlens, rng, g, float(softmax_scale), bool(causal),
                                     int(window_size or 0), float(dropout_p))
    return (o, lse) if return_lse else o
