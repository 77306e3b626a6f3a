"""Plain PyTorch softmax cross-entropy with the kernel's contract: the math it must reproduce."""
from __future__ import annotations

import torch


def softmax_cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (n, V); targets: (n,) int64. Returns (loss_rows, grad).

    loss_rows: (n,) float32, logsumexp(logits_i) - logits[i, targets_i], computed in float32.
    grad: (n, V) in logits' dtype, softmax(logits) - onehot(targets) in float32, then cast: the
    gradient of loss_rows.sum() with respect to the logits.
    """
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    loss_rows = lse - x.gather(1, targets[:, None]).squeeze(1)
    grad = torch.exp(x - lse[:, None])
    grad[torch.arange(len(targets), device=logits.device), targets] -= 1.0
    return loss_rows, grad.to(logits.dtype)
