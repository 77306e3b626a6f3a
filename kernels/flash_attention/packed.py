"""Flash attention on a fused QKV projection: one input tensor, one gradient tensor.

A GPT projects x to q, k and v with one matmul and splits the result along the heads axis. With
:func:`flash_attn` the backward returns dq, dk and dv as three tensors, and autograd (or Inductor,
under ``torch.compile``) concatenates them into the projection's gradient: one more read and write
of a (B, T, H + 2 * H_kv, D) tensor per layer. :func:`flash_attn_qkvpacked` takes the unsplit
tensor and its backward writes dq, dk and dv straight into one gradient buffer of the same shape
(the kernels take any T and H strides), so there is nothing to concatenate.

Same kernels and numerics as :func:`flash_attn`, and the same host path: one op pair,
``nanoflash::flash_attn_qkvpacked_fwd`` / ``_bwd`` (``torch.library.define`` + ``impl``, with fake
implementations; the ops take qkv whole, so a compiled graph hands the kernels the projection's
buffer as it is), called by one ``autograd.Function`` in eager calls and compiled graphs alike.

Saved for backward: qkv, o (B, T, n_head, D), lse (B, n_head, T) float32, cu_seqlens, with
dropout the (2,) int64 RNG state the forward drew, and with a forget gate g (B, T, n_head).
The backward op returns dqkv and dg (empty without a gate).
"""

from __future__ import annotations

import torch

from .backward import attn_bwd
from .forward import default_scale
from .dropout import draw_dropout_rng
from .function import _validate, checked_forward, define_op, gate_grad_fake, gate_grad_or_empty, validate_gate


def split_qkv(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q (B, T, n_head, D), k and v (B, T, H_kv, D) of qkv (B, T, n_head + 2 * H_kv, D)."""
    n_kv_head = (qkv.shape[2] - n_head) // 2
    return qkv.split([n_head, n_kv_head, n_kv_head], dim=2)


def _flash_attn_qkvpacked_fwd(qkv, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p, n_head):
    """o (B, T, n_head, D) in qkv.dtype, lse (B, n_head, T) float32 natural log; window 0 = none."""
    return checked_forward(*split_qkv(qkv, n_head), cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p)


def _flash_attn_qkvpacked_fwd_fake(qkv, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p, n_head):
    B, T, _, D = qkv.shape
    return qkv.new_empty((B, T, n_head, D)), qkv.new_empty((B, n_head, T), dtype=torch.float32)


def _flash_attn_qkvpacked_bwd(do, qkv, o, lse, dlse, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p,
                              n_head):
    """dqkv, contiguous, shaped like qkv: dq, dk and dv side by side along the heads axis; and dg."""
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    *_, dg = attn_bwd(do, *split_qkv(qkv, n_head), o, lse, softmax_scale, causal, window, cu_seqlens, dlse, rng,
                      dropout_p, out=split_qkv(dqkv, n_head), g=g)
    return dqkv, gate_grad_or_empty(dg, qkv)


def _flash_attn_qkvpacked_bwd_fake(do, qkv, o, lse, dlse, cu_seqlens, rng, g, *args):
    return qkv.new_empty(qkv.shape), gate_grad_fake(g, qkv)


flash_attn_qkvpacked_fwd = define_op(
    "flash_attn_qkvpacked_fwd",
    "(Tensor qkv, Tensor? cu_seqlens, Tensor? rng, Tensor? g, float softmax_scale, bool causal, int window,"
    " float dropout_p, int n_head) -> (Tensor, Tensor)",
    _flash_attn_qkvpacked_fwd, _flash_attn_qkvpacked_fwd_fake)
flash_attn_qkvpacked_bwd = define_op(
    "flash_attn_qkvpacked_bwd",
    "(Tensor do, Tensor qkv, Tensor o, Tensor lse, Tensor? dlse, Tensor? cu_seqlens, Tensor? rng, Tensor? g,"
    " float softmax_scale, bool causal, int window, float dropout_p, int n_head) -> (Tensor, Tensor)",
    _flash_attn_qkvpacked_bwd, _flash_attn_qkvpacked_bwd_fake)


class FlashAttnQKVPackedFunction(torch.autograd.Function):
    """Autograd of :func:`flash_attn_qkvpacked`: the forward op, then one gradient for qkv (and dg)."""

    @staticmethod
    def forward(ctx, qkv, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p, n_head):
        o, lse = flash_attn_qkvpacked_fwd(qkv, cu_seqlens, rng, g, softmax_scale, causal, window, dropout_p, n_head)
        ctx.save_for_backward(qkv, o, lse, cu_seqlens, rng, g)
        ctx.options = (softmax_scale, causal, window, dropout_p, n_head)
        ctx.set_materialize_grads(False)  # lse's grad stays None unless the caller used lse
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        qkv, o, lse, cu_seqlens, rng, g = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dqkv, dg = flash_attn_qkvpacked_bwd(do, qkv, o, lse, dlse, cu_seqlens, rng, g, *ctx.options)
        return dqkv, None, None, dg if g is not None else None, None, None, None, None, None


def flash_attn_qkvpacked(
    qkv: torch.Tensor,
    n_head: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    g: torch.Tensor | None = None,
):
    """:func:`flash_attn` of the q, k and v packed side by side in ``qkv``, differentiable in qkv (and g).

    Args:
        qkv: (B, T, n_head + 2 * H_kv, D): the query heads, then the key heads, then the value
            heads (a fused projection's output viewed with a heads axis); n_head % H_kv == 0.
        n_head: number of query heads.
        causal, softmax_scale, window_size, cu_seqlens, return_lse, dropout_p, g: as in
            :func:`flash_attn` (the same dropout mask for the same seed; g is (B, T, n_head)).

    Returns:
        o: (B, T, n_head, D), qkv's dtype; and, if return_lse, lse: (B, n_head, T) float32.
        The gradient of qkv is one tensor shaped like qkv. Raises ValueError on invalid inputs.
    """
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4:
        raise ValueError("flash_attn_qkvpacked: qkv must be a 4-D tensor (B, T, n_head + 2 * H_kv, D)")
    kv_heads = qkv.shape[2] - n_head if isinstance(n_head, int) and not isinstance(n_head, bool) else -1
    if kv_heads < 2 or kv_heads % 2 or n_head < 1:
        raise ValueError(
            f"flash_attn_qkvpacked: qkv's heads axis ({qkv.shape[2]}) must hold n_head ({n_head!r}) query "
            "heads followed by two equal groups of key and value heads")
    _validate(*split_qkv(qkv, n_head), causal, softmax_scale, window_size, cu_seqlens, dropout_p)
    validate_gate("flash_attn_qkvpacked", g, (*qkv.shape[:2], n_head), qkv.device)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    scale = default_scale(qkv.shape[-1]) if softmax_scale is None else float(softmax_scale)
    rng = draw_dropout_rng(qkv.device) if dropout_p > 0 else None
    o, lse = FlashAttnQKVPackedFunction.apply(qkv, cu_seqlens, rng, g, scale, bool(causal), int(window_size or 0),
                                              float(dropout_p), n_head)
    return (o, lse) if return_lse else o
