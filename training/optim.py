"""The optimizer (AdamW, or Muon with AdamW), clipping inside its fused step, and the learning-rate schedules."""
import contextlib
import math
from typing import Dict, Iterable, Tuple

import torch
import torch.nn as nn

from training.config import OptimConfig
from training.muon import MuonAdamW


def parameter_roles(model: nn.Module) -> Dict[int, str]:
    """{id(parameter): role}: ``matrix`` (the blocks' weight matrices, ``GPT.weight_matrices``), ``head``
    (the head's weight, the token embedding when tied), ``table`` (other embeddings, only looked up)
    or ``other`` (norms, biases, gates, mixing and skip weights)."""
    roles = {id(p): "other" for p in model.parameters()}
    roles.update({id(m.weight): "table" for m in model.modules() if isinstance(m, nn.Embedding)})
    roles.update({id(p): "matrix" for p, _ in model.weight_matrices()})
    roles[id(model.lm_head.weight)] = "head"
    return roles


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """optim=adamw: fused AdamW; optim=muon: ``MuonAdamW``, Muon for the blocks' weight matrices.

    The weights of Linear layers decay (optim.weight_decay), everything else does not: the tied token
    embedding is the head's weight, so it decays with the matmuls; position and value tables, norms,
    biases and scalars do not. Learning rates by role: optim.head_lr, embed_lr (tables), scalar_lr
    (the rest), each null for optim.lr; the blocks' matrices take optim.lr under AdamW, optim.muon_lr
    under Muon. Parameters that share an lr setting and a decay share a group, in the model's order,
    so the groups depend on which settings are set, not on their values (with every role's lr null,
    AdamW has two groups: decay, no decay). Each group's ``lr_scale`` is its lr over optim.lr: the
    schedule sets lr_at(step) * lr_scale (``set_lr``). The fused implementation (CUDA and CPU) is
    required: it can skip a step on the device (``found_inf``) without a host sync.
    """
    roles = parameter_roles(model)
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    row_splits = {id(p): splits for p, splits in model.weight_matrices()}
    role_lr = {"matrix": "muon_lr" if cfg.name == "muon" else "lr", "head": "head_lr", "table": "embed_lr",
               "other": "scalar_lr"}
    groups: Dict[Tuple, dict] = {}
    for p in model.parameters():
        source = role_lr[roles[id(p)]] if getattr(cfg, role_lr[roles[id(p)]]) is not None else "lr"
        muon = source == "muon_lr"
        decay = (cfg.muon_weight_decay if muon else cfg.weight_decay) if id(p) in linear_weights else 0.0
        group = groups.setdefault((source, decay, row_splits.get(id(p)) if muon else None),
                                  {"params": [], **group_settings(cfg, source, decay, row_splits.get(id(p)))})
        group["params"].append(p)
    optimizer = MuonAdamW if cfg.name == "muon" else torch.optim.AdamW
    return optimizer(list(groups.values()), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


def group_settings(cfg: OptimConfig, source: str, weight_decay: float, row_splits) -> dict:
    """A group's settings: its lr (optim.<source>) and lr_scale, its decay, and Muon's (source muon_lr)."""
    lr = getattr(cfg, source)
    settings = {"lr": lr, "lr_scale": lr / cfg.lr, "weight_decay": weight_decay, "muon": source == "muon_lr"}
    if settings["muon"]:
        settings.update(momentum=cfg.muon_momentum, coefficients=cfg.muon_coefficients, lr_scale_kind=cfg.muon_lr_scale,
                        cautious=cfg.muon_cautious, row_splits=row_splits)
    return settings


@contextlib.contextmanager
def settings_kept(optimizer: torch.optim.Optimizer):
    """Around loading a checkpoint's optimizer state (moments, momenta, step counts): this run's
    settings (learning rates, decays, betas, Muon's) win over the ones saved with it."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    yield
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)


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
    """Set every group's learning rate to lr times its ``lr_scale``; a captured step's (a device tensor,
    see make_capturable) in place."""
    for group in optimizer.param_groups:
        group_lr = lr * group.get("lr_scale", 1.0)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(group_lr)
        else:
            group["lr"] = group_lr


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
