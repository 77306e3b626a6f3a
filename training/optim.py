"""AdamW with weight decay on matmul weights only, and the learning-rate schedules."""
import math

import torch
import torch.nn as nn

from training.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over two groups: the weights of Linear layers decay, everything else does not.

    The tied token embedding is the language-model head's weight, so it decays with the matmuls;
    the learned position table, norms and biases do not. The fused implementation (CUDA and CPU)
    is required: it can skip a step on the device (``found_inf``) without a host sync.
    """
    matmul_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    params = dict(model.named_parameters())
    decay = [p for p in params.values() if id(p) in matmul_weights]
    no_decay = [p for p in params.values() if id(p) not in matmul_weights]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True
    )


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (1-based).

    Linear warmup over ``warmup_steps``, then: cosine from lr to min_lr at max_steps; wsd holds lr and
    decays linearly to min_lr over the last ``decay_fraction`` of the steps; constant holds lr.
    """
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay_start = max_steps - cfg.decay_fraction * max_steps
        if step <= decay_start:
            return cfg.lr
        frac = (step - decay_start) / max(1.0, max_steps - decay_start)
        return cfg.lr + (cfg.min_lr - cfg.lr) * min(1.0, frac)
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
