"""Flash attention's one host path: public function -> autograd.Function -> op -> launch function.

- Public: :func:`flash_attn` (q, k, v), :func:`flash_attn_qkvpacked` (q, k, v side by side in one
  tensor, as a fused projection makes them) and :func:`flash_attn_backward` (the gradients given
  an output and lse computed elsewhere: ring attention's step).
- Ops: ``nanoflash::flash_attn_fwd`` and ``nanoflash::flash_attn_bwd`` (``kernels.ops.define_op``:
  ``torch.library`` define + impl + fake, as the cross-entropy kernel's), so ``torch.compile`` sees
  opaque calls and traces with ``fullgraph=True``; eager calls go through the same ops. Each takes
  either q, k, v or, with ``k = v = None``, the packed qkv and ``n_head``; the packed backward
  returns qkv's gradient as one tensor (dk, dv None), so nothing concatenates dq, dk and dv.
- Autograd: one :class:`FlashAttnFunction` around the pair (FlashAttention's
  ``flash_attn_interface.py`` is built the same way).
- Kernels (``kernel=``): ``auto`` runs the Hopper kernels (``hopper.py``: the Gluon forward, and
  the backward of the ``tl`` dQ kernel and the Gluon dK/dV kernel) where they are the faster ones and
  take the call (an H100/H200, fp16/bf16, D 128, or D 64 from T = 4096: ``hopper.AUTO_FROM_T``; no
  window, documents, dropout or gate; for the backward also no gradient of lse) and the ``tl`` kernels
  everywhere else; both forwards write the o and lse either backward reads. ``gluon`` forces the Hopper
  kernels (D 64 or 128; it refuses a call they cannot take, and a backward with a gradient of lse runs
  on the ``tl`` kernels); ``tl`` forces the ``tl`` kernels.
- Launches: ``forward.attn_fwd`` and ``backward.attn_bwd`` build each kernel's arguments and hand
  them to its ``tuning.Tuner``, which picks the config and launches (``kernel[grid](...)``, or the
  binary Triton picked for an earlier call with the same arguments: ``launch.py``).

Saved for backward: q, k, v (or qkv), o (B, T, H, D), lse (B, H, T) float32, cu_seqlens, with
dropout the (2,) int64 RNG state the forward drew (``dropout.py``) and with a forget gate g
(B, T, H) float32 (``gate.py``): O(T) memory, no T x T.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..ops import define_op
from .backward import attn_bwd
from .checks import check_gate, check_inputs, longest_document
from .dropout import draw_dropout_rng
from .forward import attn_fwd, default_scale

Tensor = torch.Tensor
KERNELS = ("auto", "tl", "gluon")  # what kernel= picks from (module docstring)


def split_qkv(qkv: Tensor, n_head: int) -> tuple[Tensor, Tensor, Tensor]:
    """Views q (B, T, n_head, D), k and v (B, T, H_kv, D) of qkv (B, T, n_head + 2 * H_kv, D)."""
    n_kv_head = (qkv.shape[2] - n_head) // 2
    return qkv.split_with_sizes([n_head, n_kv_head, n_kv_head], 2)


def op_options(n_head: int, max_seqlen: int, softmax_scale: float, causal: bool, window: int,
               dropout_p: float, kernel: str = "auto") -> list[float]:
    """The ops' scalar arguments in one ``float[]``: the dispatcher converts and checks each argument
    of a call, and one list costs it a third of what separate scalars do (docs/KERNEL.md, the host
    path). n_head: query heads of a packed qkv (0 otherwise); max_seqlen: the longest document with
    cu_seqlens (0 otherwise); window: 0 for none; kernel: one of :data:`KERNELS`."""
    return [n_head, max_seqlen, softmax_scale, bool(causal), window, dropout_p, KERNELS.index(kernel)]


def unpack(options: list[float]) -> tuple[int, int, float, bool, int, float, str]:
    """(n_head, max_seqlen, softmax_scale, causal, window, dropout_p, kernel) of :func:`op_options`' list."""
    n_head, max_seqlen, softmax_scale, causal, window, dropout_p, kernel = options
    return int(n_head), int(max_seqlen), softmax_scale, bool(causal), int(window), dropout_p, KERNELS[int(kernel)]


@functools.lru_cache(maxsize=None)
def hopper_module():
    """(the Gluon forward's module, "") or (None, why this Triton cannot build it)."""
    try:
        from . import hopper
    except (ImportError, AttributeError) as error:
        import triton

        return None, f"is not built with triton {triton.__version__} ({type(error).__name__}: {error})"
    return hopper, ""


def hopper_refusal(q, k, v, window, cu_seqlens, dropout_p, g) -> str:
    """Why the Gluon forward cannot take this call; "" when it can."""
    if not q.is_cuda:
        return "needs an sm90 GPU (H100/H200)"
    hopper, missing = hopper_module()
    return missing or hopper.unsupported(q, k, v, window, cu_seqlens, dropout_p, g) or ""


def kernel_choice(kernel: str, q, k, v, window, cu_seqlens, dropout_p, g) -> str:
    """The kernels ``kernel=`` gives this call, forward and backward alike: "gluon" or "tl" (module
    docstring)."""
    if kernel == "tl" or hopper_refusal(q, k, v, window, cu_seqlens, dropout_p, g):
        return "tl"
    return "gluon" if kernel == "gluon" or q.shape[1] >= hopper_module()[0].AUTO_FROM_T[q.shape[-1]] else "tl"


def _flash_attn_fwd(q, k, v, cu_seqlens, rng, g, options):
    """o (B, T, H, D) in q's dtype and lse (B, H, T) float32; q is the packed qkv when k is None."""
    n_head, max_seqlen, softmax_scale, causal, window, dropout_p, kernel = unpack(options)
    if k is None:
        q, k, v = split_qkv(q, n_head)
    if kernel_choice(kernel, q, k, v, window, cu_seqlens, dropout_p, g) == "gluon":
        return hopper_module()[0].attn_fwd_sm90(q, k, v, softmax_scale, causal)
    return attn_fwd(q, k, v, softmax_scale, causal, window, cu_seqlens, max_seqlen, rng, dropout_p, g)


def _flash_attn_fwd_fake(q, k, v, cu_seqlens, rng, g, options):
    B, T, H, D = q.shape
    H = int(options[0]) if k is None else H
    return q.new_empty((B, T, H, D)), q.new_empty((B, H, T), dtype=torch.float32)


def _flash_attn_bwd(do, q, k, v, o, lse, dlse, cu_seqlens, rng, g, options):
    """dq, dk, dv (contiguous) and dg (None without a gate); packed (k is None): dqkv shaped like
    qkv, None, None and dg, written in place through three views (nothing concatenates them)."""
    n_head, max_seqlen, softmax_scale, causal, window, dropout_p, kernel = unpack(options)
    packed = k is None
    if packed:
        dqkv = q.new_empty(q.shape)
        q, k, v = split_qkv(q, n_head)
    out = split_qkv(dqkv, n_head) if packed else None
    if dlse is None and kernel_choice(kernel, q, k, v, window, cu_seqlens, dropout_p, g) == "gluon":
        dq, dk, dv = hopper_module()[0].attn_bwd_sm90(do, q, k, v, o, lse, softmax_scale, causal, out=out)
        dg = None
    else:
        dq, dk, dv, dg = attn_bwd(do, q, k, v, o, lse, softmax_scale, causal, window, cu_seqlens, max_seqlen, dlse,
                                  rng, dropout_p, g, out=out)
    return (dqkv, None, None, dg) if packed else (dq, dk, dv, dg)


def _flash_attn_bwd_fake(do, q, k, v, o, lse, dlse, cu_seqlens, rng, g, options):
    dg = None if g is None else g.new_empty(g.shape)
    if k is None:
        return q.new_empty(q.shape), None, None, dg
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dg


flash_attn_fwd = define_op(
    "nanoflash::flash_attn_fwd",
    "(Tensor q, Tensor? k, Tensor? v, Tensor? cu_seqlens, Tensor? rng, Tensor? g, float[] options) -> (Tensor, Tensor)",
    _flash_attn_fwd, _flash_attn_fwd_fake)
flash_attn_bwd = define_op(
    "nanoflash::flash_attn_bwd",
    "(Tensor do, Tensor q, Tensor? k, Tensor? v, Tensor o, Tensor lse, Tensor? dlse, Tensor? cu_seqlens, Tensor? rng,"
    " Tensor? g, float[] options) -> (Tensor, Tensor?, Tensor?, Tensor?)",
    _flash_attn_bwd, _flash_attn_bwd_fake)


class FlashAttnFunction(torch.autograd.Function):
    """Autograd of the public functions: the forward op, then the backward op on what it saved.
    ``apply(q, k, v, cu_seqlens, rng, g, options, return_lse)`` with the ops' :func:`op_options`; q is
    the packed qkv and k = v = None for the packed layout. It returns (o, lse) with ``return_lse``, else
    o alone: a graph torch.compile traced would hand the backward a dlse of zeros for an lse nobody
    used, which costs the tl kernels a read and keeps the Hopper backward out."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, rng, g, options, return_lse):
        o, lse = flash_attn_fwd(q, k, v, cu_seqlens, rng, g, options)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, rng, g)
        ctx.options = options
        ctx.set_materialize_grads(False)  # lse's grad stays None unless the caller used lse
        return (o, lse) if return_lse else o

    @staticmethod
    def backward(ctx, do, dlse=None):
        q, k, v, o, lse, cu_seqlens, rng, g = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv, dg = flash_attn_bwd(do, q, k, v, o, lse, dlse, cu_seqlens, rng, g, ctx.options)
        return dq, dk, dv, None, None, dg, None, None


def _attend(name, q, k, v, qkv, n_head, causal, softmax_scale, window_size, cu_seqlens, max_seqlen, return_lse,
            dropout_p, g, kernel):
    """The two public functions after their own checks: q, k, v are views of qkv when it is given."""
    check_inputs(name, q, k, v, causal, softmax_scale, window_size, cu_seqlens, dropout_p)
    if g is not None:
        check_gate(name, g, (*q.shape[:3],), q.device)
    if kernel not in KERNELS:
        raise ValueError(f"{name}: kernel={kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "gluon":
        refusal = hopper_refusal(q, k, v, window_size or 0, cu_seqlens, dropout_p, g)
        if refusal:
            raise ValueError(f"{name}: kernel='gluon': the Hopper forward {refusal}; kernel='auto' runs the tl kernel")
    if cu_seqlens is not None and max_seqlen is None:
        max_seqlen = longest_document(name, cu_seqlens, q.shape[1])
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    rng = draw_dropout_rng(q.device) if dropout_p > 0 else None
    if qkv is not None:
        q, k, v = qkv if qkv.stride(-1) == 1 else qkv.contiguous(), None, None
    elif q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return FlashAttnFunction.apply(q, k, v, cu_seqlens, rng, g,
                                   op_options(n_head, max_seqlen or 0, scale, causal, window_size or 0, dropout_p,
                                              kernel), return_lse)


def flash_attn(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, softmax_scale: float | None = None,
               window_size: int | None = None, cu_seqlens: Tensor | None = None, max_seqlen: int | None = None,
               return_lse: bool = False, dropout_p: float = 0.0, g: Tensor | None = None, kernel: str = "auto"):
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
        max_seqlen: with cu_seqlens, the longest document's length if the caller knows it; None
            reads it from cu_seqlens and checks cu_seqlens' values (one device sync).
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
        kernel: the forward kernel: "auto" (the Gluon forward on an sm90 GPU where it applies, else
            the tl kernel), "tl" or "gluon" (module docstring).

    Returns:
        o: (B, T, H, D), q's dtype (contiguous); and, if return_lse, lse: (B, H, T) float32 in
        natural-log units (differentiable too).

    T and H strides may be arbitrary; a non-contiguous last dim is copied. Runs on CUDA, or on CPU
    under TRITON_INTERPRET=1. Raises ValueError on invalid inputs.
    """
    return _attend("flash_attn", q, k, v, None, 0, causal, softmax_scale, window_size, cu_seqlens, max_seqlen,
                   return_lse, dropout_p, g, kernel)


def flash_attn_qkvpacked(qkv: Tensor, n_head: int, causal: bool = True, softmax_scale: float | None = None,
                         window_size: int | None = None, cu_seqlens: Tensor | None = None,
                         max_seqlen: int | None = None, return_lse: bool = False, dropout_p: float = 0.0,
                         g: Tensor | None = None, kernel: str = "auto"):
    """:func:`flash_attn` of the q, k and v packed side by side in ``qkv``, differentiable in qkv (and g).

    qkv: (B, T, n_head + 2 * H_kv, D): the query heads, then the key heads, then the value heads
    (a fused projection's output viewed with a heads axis); n_head % H_kv == 0. The other options
    are :func:`flash_attn`'s (the same dropout mask for the same seed; g is (B, T, n_head)).
    Returns o: (B, T, n_head, D) (and lse: (B, n_head, T) float32). The backward writes qkv's
    gradient as one tensor shaped like qkv. Raises ValueError on invalid inputs.
    """
    name = "flash_attn_qkvpacked"
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4:
        raise ValueError(f"{name}: qkv must be a 4-D tensor (B, T, n_head + 2 * H_kv, D)")
    kv_heads = qkv.shape[2] - n_head if isinstance(n_head, int) and not isinstance(n_head, bool) else -1
    if kv_heads < 2 or kv_heads % 2 or n_head < 1:
        raise ValueError(f"{name}: qkv's heads axis ({qkv.shape[2]}) must hold n_head ({n_head!r}) query heads "
                         "followed by two equal groups of key and value heads")
    return _attend(name, *split_qkv(qkv, n_head), qkv, n_head, causal, softmax_scale, window_size, cu_seqlens,
                   max_seqlen, return_lse, dropout_p, g, kernel)


def flash_attn_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True,
                        softmax_scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of attention over q, k, v, given an output ``o`` and its ``lse`` computed elsewhere.

    Ring attention's step: o (B, T, H, D) (any float dtype) and lse (B, H, T) (natural log) are
    those of the whole attention, of which q, k, v are one block, so the recomputed probabilities
    exp(s - lse) are final and each call returns this block's share of the gradients. do: (B, T, H,
    D). q, k, v and the options as in :func:`flash_attn`. Not differentiable itself.
    """
    name = "flash_attn_backward"
    check_inputs(name, q, k, v, causal, softmax_scale, None, None, 0.0)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    q, k, v, o, do = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, o, do))
    dq, dk, dv, _ = flash_attn_bwd(do, q, k, v, o, lse.float().contiguous(), None, None, None, None,
                                   op_options(0, 0, scale, causal, 0, 0.0))
    return dq, dk, dv
