"""Language-model loss without the (B*T, V) logits: the head matmul and cross-entropy fused in chunks.

For GPT-2's 50304-token vocabulary the logits of a 12 x 1024 batch are 1.2 GB in bf16 and 2.4 GB in
fp32, kept for the backward. Here rows are processed ``chunk`` at a time: each chunk's logits are
computed, turned into the loss and into the gradients of the hidden states and the head weight at
once, and dropped. The matmuls are the same three as the plain version (logits, dh, dW), so the
cost in FLOPs is unchanged; memory holds one chunk of logits instead of all of them. On a GPU each
chunk's loss and gradient come from one Triton kernel that overwrites the logits with their
gradient (kernels/cross_entropy); elsewhere from PyTorch. When nothing needs a gradient (evaluation
under torch.no_grad, generation) only the logits and the loss are computed: one matmul of three.

With model.logit_softcap = s, every logit x counts as s * tanh(x / s) (``capped_logits``): the kernel
and the PyTorch path cap as they read and put the cap's derivative into the gradient they return.
"""
from typing import Optional

import torch

from kernels.cross_entropy import capped_logits, fused_cross_entropy_available, softmax_cross_entropy_


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean_i CE(h_i @ W^T, y_i) with the gradients computed in the forward pass.

    h: (N, C) hidden states; weight: (V, C); targets: (N,) int64; softcap: None or the cap s of the
    logits. Saved for backward: dh (N, C) and dW (V, C, fp32 or fp64) for a unit upstream gradient,
    scaled in ``backward``.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                softcap: Optional[float]) -> torch.Tensor:
        N = h.shape[0]
        compute_dtype, acc_dtype = loss_dtypes(h)
        w = weight.to(compute_dtype)
        loss = torch.zeros((), dtype=acc_dtype, device=h.device)
        dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        dw = torch.zeros(weight.shape, dtype=acc_dtype, device=h.device)
        for start in range(0, N, chunk):
            h_c = h[start:start + chunk].to(compute_dtype)
            y_c = targets[start:start + chunk]
            logits = h_c @ w.t()  # (n, V) in the compute dtype
            if fused_cross_entropy_available(logits):
                loss += softmax_cross_entropy_(logits, y_c, softcap).sum()  # logits now hold their gradient
                grad = logits
            else:
                row_loss, grad = cross_entropy_and_grad(logits, y_c, acc_dtype, softcap)
                loss += row_loss.sum()
            dh[start:start + chunk] = (grad @ w).to(h.dtype)
            dw += (grad.t() @ h_c).to(acc_dtype)
        ctx.save_for_backward(dh, dw)
        ctx.n = N
        ctx.weight_dtype = weight.dtype
        return loss / N

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        dh, dw = ctx.saved_tensors
        scale = grad_loss / ctx.n
        return dh * scale.to(dh.dtype), (dw * scale).to(ctx.weight_dtype), None, None, None


def loss_dtypes(h: torch.Tensor):
    """(dtype of the logits, dtype the loss and dW accumulate in): autocast's dtype or h's; fp32 or fp64."""
    compute_dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
    return compute_dtype, torch.promote_types(compute_dtype, torch.float32)


def chunked_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                 softcap: Optional[float] = None) -> torch.Tensor:
    """The forward of ChunkedLinearCrossEntropy without its gradients (evaluation, generation): one
    matmul per chunk instead of three. Same shapes and the same value."""
    compute_dtype, acc_dtype = loss_dtypes(h)
    w = weight.to(compute_dtype)
    loss = torch.zeros((), dtype=acc_dtype, device=h.device)
    for start in range(0, h.shape[0], chunk):
        y_c = targets[start:start + chunk]
        logits = h[start:start + chunk].to(compute_dtype) @ w.t()
        if fused_cross_entropy_available(logits):
            loss += softmax_cross_entropy_(logits, y_c, softcap).sum()  # one pass; the gradient it leaves is dropped
        else:
            loss += cross_entropy_rows(capped_logits(logits.to(acc_dtype), softcap), y_c)[0].sum()
    return loss / h.shape[0]


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor):
    """(row losses, row log-sum-exps) of logits: (n, V), both (n,) in logits' dtype."""
    lse = torch.logsumexp(logits, dim=-1)
    return lse - logits.gather(1, targets[:, None]).squeeze(1), lse


def cross_entropy_and_grad(logits: torch.Tensor, targets: torch.Tensor, acc_dtype: torch.dtype,
                           softcap: Optional[float] = None):
    """PyTorch version of the kernel: (row losses in acc_dtype, d loss / d logits in logits' dtype):
    softmax - onehot, times the cap's derivative 1 - tanh(x / s)^2 with a soft-cap s."""
    capped = capped_logits(logits.to(acc_dtype), softcap)
    row_loss, lse = cross_entropy_rows(capped, targets)
    grad = torch.exp(capped - lse[:, None])  # softmax: d(sum CE)/d logits = softmax - onehot
    if softcap is not None:
        one_hot = torch.arange(logits.shape[1], device=logits.device) == targets[:, None]
        return row_loss, ((grad - one_hot.to(acc_dtype)) * (1 - (capped / softcap).square())).to(logits.dtype)
    if torch.compiler.is_compiling():
        # A pointwise one-hot fuses with the exp and the cast into one kernel: no (n, V) fp32 buffer is
        # written (an in-place scatter would make the compiler materialise grad in fp32 first).
        one_hot = torch.arange(logits.shape[1], device=logits.device) == targets[:, None]
        return row_loss, (grad - one_hot.to(acc_dtype)).to(logits.dtype)
    # Eager: in place, so no second (n, V) temporary.
    minus_one = torch.full_like(targets[:, None], -1, dtype=grad.dtype)
    return row_loss, grad.scatter_add_(1, targets[:, None], minus_one).to(logits.dtype)


def lm_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 4096,
            softcap: Optional[float] = None) -> torch.Tensor:
    """Mean next-token cross-entropy of hidden states h: (B, T, C) under head ``weight``: (V, C).

    targets: (B, T). Equal (up to rounding) to F.cross_entropy(capped_logits(h @ weight.T, softcap),
    targets). The gradients are computed with the loss only when autograd will want them.
    """
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(h, weight, targets, chunk, softcap)
    return chunked_loss(h, weight, targets, chunk, softcap)
