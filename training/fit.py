"""What fits in GPU memory: the largest micro-batch and the longest sequence, found by trial.

Each trial builds the model, runs one full training step (forward, backward, optimizer step) on
random tokens and reports whether it ran out of memory. ``trainer.vram_budget_gb`` caps the process
first, so a large GPU answers for a smaller card.
"""
import dataclasses
import gc
from typing import Callable

import torch

from model import GPT, ModelConfig
from model.attention import build_attention
from model.config import AttentionConfig
from training.optim import build_optimizer
from training.config import OptimConfig
from training.precision import autocast


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class StepTrial:
    """One model and optimizer kept between trials of different batch sizes at one sequence length."""

    def __init__(self, model_cfg: ModelConfig, attn_cfg: AttentionConfig, device, dtype):
        attend, self.backend = build_attention(attn_cfg, device)
        self.model = GPT(model_cfg, attend).to(device)
        self.optimizer = build_optimizer(self.model, OptimConfig(), device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self.cfg, self.device, self.dtype = model_cfg, device, dtype

    def fits(self, batch: int) -> bool:
        """True when a training step at (batch, block_size) runs without running out of memory."""
        x = None
        try:
            x = torch.randint(0, self.cfg.vocab_size, (batch, self.cfg.block_size), device=self.device)
            with autocast(self.device, self.dtype):
                _, loss = self.model(x, x)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            del x
            self.optimizer.zero_grad(set_to_none=True)
            free_memory()

    def close(self) -> None:
        del self.model, self.optimizer
        free_memory()


def largest_passing(fits: Callable[[int], bool], start: int, limit: int, step: int = 1) -> int:
    """Largest n in [start, limit] (multiples of ``step``) with fits(n), assuming fits is monotone.

    Doubles from ``start`` until a failure, then bisects. Returns 0 when even ``start`` fails.
    """
    if not fits(start):
        return 0
    good, bad = start, None
    while bad is None:
        nxt = min(good * 2, limit)
        if nxt == good:
            return good
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def largest_batch(model_cfg: ModelConfig, attn_cfg: AttentionConfig, device, dtype, limit: int = 1024) -> int:
    """Largest micro-batch that trains at model_cfg.block_size (0 if batch 1 does not fit)."""
    trial = StepTrial(model_cfg, attn_cfg, device, dtype)
    try:
        return largest_passing(trial.fits, 1, limit)
    finally:
        trial.close()


def longest_sequence(model_cfg: ModelConfig, attn_cfg: AttentionConfig, device, dtype,
                     start: int = 256, limit: int = 131072, step: int = 256) -> int:
    """Longest sequence (a multiple of ``step``) that trains at batch 1 (0 if ``start`` does not fit)."""

    def fits(T: int) -> bool:
        try:
            trial = StepTrial(dataclasses.replace(model_cfg, block_size=T), attn_cfg, device, dtype)
        except torch.OutOfMemoryError:
            free_memory()
            return False
        try:
            return trial.fits(1)
        finally:
            trial.close()

    return largest_passing(fits, start, limit, step)


def auto_batch_size(model_cfg: ModelConfig, attn_cfg: AttentionConfig, device, dtype) -> int:
    """trainer.batch_size=auto: 90% of the largest micro-batch that fits (headroom for evaluation)."""
    from errors import UserError

    if device.type != "cuda":
        raise UserError("trainer.batch_size=auto measures GPU memory and needs a CUDA GPU; give a number instead")
    found = largest_batch(model_cfg, attn_cfg, device, dtype)
    if found == 0:
        raise UserError(
            f"not even one sequence of model.block_size={model_cfg.block_size} fits in GPU memory; try "
            "attention=flash, model.activation_checkpointing=true or a shorter model.block_size"
        )
    return max(1, int(found * 0.9))
