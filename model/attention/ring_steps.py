"""One ring step's attention: a query block against one key/value block, returning its log-sum-exp.

Ring attention (model/attention/ring.py) sees every key/value block of the sequence in turn and
merges the partial results by their log-sum-exp; its backward recomputes each block's share of the
gradients from the whole attention's output and log-sum-exp. A ``StepAttention`` is that pair of
functions for one backend:

- ``forward(q, k, v, causal, scale) -> (o, lse)``: q: (B, Tq, H, D); k, v: (B, Tk, H_kv, D) with
  H % H_kv == 0 (grouped-query attention: query head h reads key/value head h // (H / H_kv));
  ``causal`` (only with Tq == Tk) hides key j from query i when j > i, otherwise every key is
  seen. Returns o: (B, Tq, H, D) in q's dtype or wider, and lse: (B, H, Tq), natural log, in
  float32 (float64 for float64 inputs).
- ``backward(do, q, k, v, o, lse, causal, scale) -> (dq, dk, dv)``: do, o: (B, Tq, H, D) and
  lse: (B, H, Tq) are those of the *whole* attention (all blocks merged), so the recomputed
  probabilities exp(s - lse) are final and delta = rowsum(do * o) is the FlashAttention-2 one.
  Returns this block's share of dq (B, Tq, H, D) and of dk, dv (B, Tk, H_kv, D).

Backends: ``naive`` (plain PyTorch, any device and float dtype; the reference the others are
tested against), ``sdpa`` (PyTorch's fused attention ops that return the log-sum-exp: the CPU flash
kernel, or the memory-efficient kernel on CUDA) and ``flash`` (our Triton kernel; CUDA, or CPU
under TRITON_INTERPRET=1). A backend's row in ``BACKENDS`` names its step.
"""
from dataclasses import dataclass
from typing import Callable, Tuple

import torch
import torch.nn.functional as F

from model.attention.masks import group_queries, heads_first, ungroup_output

Tensor = torch.Tensor


@dataclass(frozen=True)
class StepAttention:
    """The forward and backward of one ring step for one backend (see the module docstring)."""

    name: str
    forward: Callable[..., Tuple[Tensor, Tensor]]
    backward: Callable[..., Tuple[Tensor, Tensor, Tensor]]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where partial outputs, log-sum-exps and gradients add up: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# naive: the reference, plain PyTorch -----------------------------------------------------------

def _block_scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """Scaled scores (B, H_kv, G, Tq, Tk) in the accumulation dtype; -inf where causality hides a key."""
    acc = accumulation_dtype(q.dtype)
    scores = (group_queries(q, k.shape[2]).to(acc) @ heads_first(k).to(acc).transpose(-1, -2)) * scale
    if causal:
        Tq, Tk = q.shape[1], k.shape[1]
        hidden = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def reference_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """Block attention with its log-sum-exp, materialising the (Tq, Tk) scores of every head."""
    scores = _block_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H_kv, G, Tq)
    o = ungroup_output(torch.exp(scores - lse.unsqueeze(-1)) @ heads_first(v).to(scores.dtype))
    B, H_kv, G, Tq = lse.shape
    return o, lse.reshape(B, H_kv * G, Tq)


def reference_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                       scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """The block's gradients given the whole attention's o and lse (the module docstring's contract).

    P = exp(s - lse), dV = P^T dO, dP = dO V^T, dS = P (dP - delta), dQ = dS K scale,
    dK = dS^T Q scale; the query groups of a key/value head sum into its dK, dV.
    """
    H_kv = k.shape[2]
    scores = _block_scores(q, k, causal, scale)
    acc = scores.dtype
    B, _, G, Tq, _ = scores.shape
    probs = torch.exp(scores - lse.to(acc).reshape(B, H_kv, G, Tq, 1))
    do_g = group_queries(do, H_kv).to(acc)  # (B, H_kv, G, Tq, D)
    delta = (do_g * group_queries(o, H_kv).to(acc)).sum(-1, keepdim=True)
    dv = (probs.transpose(-1, -2) @ do_g).sum(2)  # (B, H_kv, Tk, D)
    ds = probs * (do_g @ heads_first(v).to(acc).transpose(-1, -2) - delta) * scale
    dq = ungroup_output(ds @ heads_first(k).to(acc))
    dk = (ds.transpose(-1, -2) @ group_queries(q, H_kv).to(acc)).sum(2)
    return dq, dk.transpose(1, 2), dv.transpose(1, 2)


# sdpa: PyTorch's fused kernels that return the log-sum-exp -------------------------------------

_LSE_ROWS_ALIGN = 32  # the memory-efficient CUDA kernel pads its lse rows to a multiple of this


def _repeat_kv_heads(x: Tensor, groups: int) -> Tensor:
    """(B, T, H_kv, D) -> (B, T, H_kv * groups, D): head h reads key/value head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _sum_kv_heads(dx: Tensor, groups: int) -> Tensor:
    """Inverse of ``_repeat_kv_heads`` for gradients: the groups of each key/value head add up."""
    B, T, H, D = dx.shape
    return dx if groups == 1 else dx.float().view(B, T, H // groups, groups, D).sum(3)


def _heads_second(*xs: Tensor):
    """(B, T, H, D) views as (B, H, T, D), the layout of PyTorch's attention ops."""
    return (x.transpose(1, 2) for x in xs)


def sdpa_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """PyTorch's CPU flash kernel, or its memory-efficient kernel on CUDA."""
    if q.is_cuda:
        groups = q.shape[2] // k.shape[2]
        k, v = _repeat_kv_heads(k, groups), _repeat_kv_heads(v, groups)
        qh, kh, vh = _heads_second(q, k, v)
        o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            qh, kh, vh, None, True, 0.0, causal, scale=scale)
        return o.transpose(1, 2), lse[..., :q.shape[1]]
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_heads_second(q, k, v), 0.0, causal, scale=scale)
    return o.transpose(1, 2), lse


def sdpa_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                  scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """The fused kernels' own backward, fed the whole attention's o and lse."""
    if q.is_cuda:
        groups = q.shape[2] // k.shape[2]
        k, v = _repeat_kv_heads(k, groups), _repeat_kv_heads(v, groups)
        lse = F.pad(lse.float(), (0, -q.shape[1] % _LSE_ROWS_ALIGN))
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # dropout is off: never read
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            *_heads_second(do, q, k, v), None, o.transpose(1, 2), lse, no_rng, no_rng, 0.0,
            [True, True, True, False], causal, scale=scale)
        dq, dk, dv = _heads_second(dq, dk, dv)
        return dq, _sum_kv_heads(dk, groups), _sum_kv_heads(dv, groups)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_heads_second(do, q, k, v, o), lse.to(accumulation_dtype(q.dtype)), 0.0, causal, scale=scale)
    return tuple(_heads_second(*grads))


# flash: our Triton kernel ----------------------------------------------------------------------
# The kernel takes equal query and key lengths. A ring step's full blocks are 2:1 or 1:2, so the
# longer side is folded into the batch (a view) and the shorter one repeated to match.

def flash_kernel_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """The one call of our kernel's forward: o (B, T, H, D) in q's dtype, lse (B, H, T) float32."""
    from kernels import flash_attn

    return flash_attn(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)


def flash_kernel_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                          scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """The one call of our kernel's backward with an external lse (B, H, T)."""
    from kernels import flash_attn_backward

    return flash_attn_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=scale)


def _fold(x: Tensor, m: int) -> Tensor:
    """(B, m * T, ...) -> (B * m, T, ...): m consecutive pieces of each sequence become batch rows."""
    return x.reshape(x.shape[0] * m, x.shape[1] // m, *x.shape[2:])


def _unfold(x: Tensor, m: int) -> Tensor:
    """Inverse of ``_fold``."""
    return x.reshape(x.shape[0] // m, x.shape[1] * m, *x.shape[2:])


def _repeat_batch(x: Tensor, m: int) -> Tensor:
    """(B, ...) -> (B * m, ...), each batch row m times in a row (matches ``_fold``)."""
    return x.unsqueeze(1).expand(x.shape[0], m, *x.shape[1:]).reshape(x.shape[0] * m, *x.shape[1:])


def _fold_lse(lse: Tensor, m: int) -> Tensor:
    """(B, H, m * T) -> (B * m, H, T) contiguous, the rows of ``_fold``."""
    B, H, T = lse.shape
    return lse.reshape(B, H, m, T // m).transpose(1, 2).reshape(B * m, H, T // m).contiguous()


def _unfold_lse(lse: Tensor, m: int) -> Tensor:
    """Inverse of ``_fold_lse``."""
    Bm, H, T = lse.shape
    return lse.reshape(Bm // m, m, H, T).transpose(1, 2).reshape(Bm // m, H, m * T)


def _merge_pieces(o: Tensor, lse: Tensor, m: int) -> Tuple[Tensor, Tensor]:
    """Merge the m partial results of each query row over m key pieces (the log-sum-exp rule).

    o: (B * m, T, H, D), lse: (B * m, H, T) -> o: (B, T, H, D) float32, lse: (B, H, T).
    """
    Bm, T, H, D = o.shape
    lse = lse.view(Bm // m, m, H, T)
    total = torch.logsumexp(lse, dim=1)
    weights = torch.exp(lse - total.unsqueeze(1)).transpose(2, 3).unsqueeze(-1)  # (B, m, T, H, 1)
    return (o.float().view(Bm // m, m, T, H, D) * weights).sum(1), total


def flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    Tq, Tk = q.shape[1], k.shape[1]
    if Tq == Tk:
        return flash_kernel_forward(q, k, v, causal, scale)
    if Tq > Tk:
        m = Tq // Tk
        o, lse = flash_kernel_forward(_fold(q, m), _repeat_batch(k, m), _repeat_batch(v, m), causal, scale)
        return _unfold(o, m), _unfold_lse(lse, m)
    m = Tk // Tq
    o, lse = flash_kernel_forward(_repeat_batch(q, m), _fold(k, m), _fold(v, m), causal, scale)
    return _merge_pieces(o, lse, m)


def flash_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                   scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    Tq, Tk = q.shape[1], k.shape[1]
    lse = lse.float()
    if Tq == Tk:
        return flash_kernel_backward(do, q, k, v, o, lse, causal, scale)
    if Tq > Tk:
        m = Tq // Tk
        dq, dk, dv = flash_kernel_backward(_fold(do, m), _fold(q, m), _repeat_batch(k, m), _repeat_batch(v, m),
                                           _fold(o, m), _fold_lse(lse, m), causal, scale)
        B = q.shape[0]
        return _unfold(dq, m), *(d.float().view(B, m, *d.shape[1:]).sum(1) for d in (dk, dv))
    m = Tk // Tq
    B, H = q.shape[0], q.shape[2]
    lse_rows = lse.unsqueeze(1).expand(B, m, H, Tq).reshape(B * m, H, Tq).contiguous()
    dq, dk, dv = flash_kernel_backward(_repeat_batch(do, m), _repeat_batch(q, m), _fold(k, m), _fold(v, m),
                                       _repeat_batch(o, m), lse_rows, causal, scale)
    return dq.float().view(B, m, *dq.shape[1:]).sum(1), _unfold(dk, m), _unfold(dv, m)


# the steps named by the rows of BACKENDS (model/attention/__init__.py) ----------------------------

NAIVE = StepAttention("naive", reference_forward, reference_backward)
SDPA = StepAttention("sdpa", sdpa_forward, sdpa_backward)
FLASH = StepAttention("flash", flash_forward, flash_backward)
