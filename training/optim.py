"""AdamW with weight decay on matmul weights only, clipping inside its fused step, and the learning-rate schedules."""
import math
from typing import Iterable

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


def apply_hyperparameters(optimizer: torch.optim.AdamW, cfg: OptimConfig) -> None:
    """Set ``cfg``'s betas, eps and weight decay (of the decaying group) on every group: loading a
    checkpoint's optimizer state brings back the values it was saved with. The learning rate is set
    every step (``set_lr``)."""
    for group in optimizer.param_groups:
        group["betas"], group["eps"] = tuple(cfg.betas), cfg.eps
    optimizer.param_groups[0]["weight_decay"] = cfg.weight_decay


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
    """Set every group's learning rate; a captured step's (a device tensor, see make_capturable) in place."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def clip_in_step(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The total gradient norm of ``params``; clipping to ``max_norm`` is left to the fused step.

    Sets ``optimizer.grad_scale`` to max(1, norm / max_norm): the fused AdamW divides every gradient
    by it as it reads it, which is what ``clip_grad_norm_`` does with a separate multiply over all
    gradients (one more read and write of each). max_norm=inf: no clipping. Returns the norm, a
    device tensor (no host sync).
    """
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    optimizer.grad_scale = None if math.isinf(max_norm) else torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    return norm


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Let a CUDA graph capture ``optimizer.step()``: each group's learning rate becomes a device
    tensor, read by the fused kernel at every replay and updated in place by ``set_lr``."""
    for group in optimizer.param_groups:
        group["capturable"] = True
        group["lr"] = torch.tensor(float(group["lr"]), device=group["params"][0].device)


def plain_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` as an uncaptured run saves it (float learning rates, capturable off),
    so a checkpoint resumes with or without CUDA graphs, on any device."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:  # copies of the live groups
        group["lr"] = float(group["lr"])
        group["capturable"] = False
    return state
