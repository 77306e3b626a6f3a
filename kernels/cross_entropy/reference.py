"""Plain PyTorch softmax cross-entropy with the kernel's contract: the math it must reproduce.

``capped_logits`` is the one definition of model.logit_softcap's capped logit, used by this
reference, by model/loss.py (the PyTorch path and evaluation) and by generation (model/gpt.py); the
kernel computes the same formula in Triton.
"""
from __future__ import annotations

from typing import Optional

import torch


def capped_logits(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """softcap * tanh(logits / softcap): logits squashed smoothly into (-softcap, softcap), unchanged
    with ``softcap`` None (Gemma 2's soft-cap; modded-nanogpt's 15 * (tanh(x / 15) + 1) differs by a
    constant per row, which softmax ignores)."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def softmax_cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor,
                              softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (n, V); targets: (n,) int64. Returns (loss_rows, grad).

    loss_rows: (n,) float32 (float64 for float64 logits), logsumexp(c_i) - c[i, targets_i] with
    c = capped_logits(logits, softcap), computed in float32 (or float64).
    grad: (n, V) in logits' dtype, the gradient of loss_rows.sum() with respect to the raw logits,
    taken by autograd in that precision, then cast: softmax(c) - onehot(targets) without a cap.
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)).detach().requires_grad_()
    with torch.enable_grad():
        c = capped_logits(x, softcap)
        loss_rows = torch.logsumexp(c, dim=-1) - c.gather(1, targets[:, None]).squeeze(1)
        (grad,) = torch.autograd.grad(loss_rows.sum(), x)
    return loss_rows.detach(), grad.to(logits.dtype)
