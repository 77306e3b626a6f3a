"""Whether training is healthy: steps in a row that were not finite, and a loss within its recent range.

Both are followed on the device, step by step, without a host sync; the loop reads them (one
``.tolist()``) only at the steps where it logs, evaluates or saves anyway.

The loss of step s is computed with the weights after step s - 1, so a loss far above its recent
range says that the update before it went wrong, and the checkpoint of step s - 1 already holds
those weights. A checkpoint is therefore good when the loss of the step after it was still in range:
"the last good checkpoint" is the newest one of a step before the last in-range step, and a step is
saved only while its own loss is in range (its weights are confirmed by the next one).

The range: a running mean of the in-range losses (each new one weighs 0.1); a loss is in range when
it is finite and at most 1.5 x that mean + 0.5 (half as high again and half a nat more: noise and
ordinary spikes stay inside, a divergence leaves by orders of magnitude). The first loss after the
start or a resume sets the mean.
"""
from pathlib import Path
from typing import Optional

import torch

from training.checkpoint import list_checkpoints, step_of
from training.errors import TrainingStopped

RANGE_FACTOR, RANGE_SLACK = 1.5, 0.5
MEAN_WEIGHT = 0.1


class LossWatch:
    """Consecutive non-finite steps and the last step whose loss was in its recent range, on the device."""

    def __init__(self, device: torch.device, limit: int, start_step: int, run_dir: Path, lr: float):
        self.limit, self.run_dir, self.lr = limit, run_dir, lr
        self.streak = torch.zeros((), dtype=torch.int64, device=device)  # consecutive bad steps, up to now
        self.worst = torch.zeros_like(self.streak)  # longest streak since the last check
        self.mean = torch.full((), float("nan"), device=device)  # running mean of in-range losses
        self.last_in_range = torch.full((), start_step, dtype=torch.int64, device=device)
        self.last_in_range_seen = start_step  # its value at the last check

    def count(self, step: int, loss: torch.Tensor, good: torch.Tensor) -> None:
        """Step ``step`` gave ``loss`` and counted (``good``) or was skipped; queued, no sync."""
        self.streak = (self.streak + 1) * (~good)
        self.worst = torch.maximum(self.worst, self.streak)
        first = torch.isnan(self.mean)
        in_range = torch.isfinite(loss) & (first | (loss <= RANGE_FACTOR * self.mean + RANGE_SLACK))
        self.mean = torch.where(in_range, torch.where(first, loss, torch.lerp(self.mean, loss, MEAN_WEIGHT)), self.mean)
        self.last_in_range = torch.where(in_range, step, self.last_in_range)

    def check(self, step: int) -> str:
        """Why step ``step`` (the latest) may not be saved, "" when it may; TrainingStopped once a streak
        of non-finite steps reached the limit."""
        worst, streak, last_in_range = torch.stack([self.worst, self.streak, self.last_in_range]).tolist()
        self.worst = self.streak.clone()
        self.last_in_range_seen = last_in_range
        if worst >= self.limit:
            raise self.stopped(f"loss or gradients were not finite for {worst} steps in a row (seen at step {step}); "
                               "those steps changed nothing (trainer.max_bad_steps sets the limit)")
        if streak:
            return "its loss or gradient is not finite"
        if last_in_range != step:
            return f"its loss is above its recent range (since step {last_in_range + 1})"
        return ""

    def last_good_checkpoint(self) -> Optional[Path]:
        """The newest checkpoint whose weights gave a loss within its recent range at the next step."""
        good = [p for p in list_checkpoints(self.run_dir) if step_of(p) < self.last_in_range_seen]
        return good[-1] if good else None

    def stopped(self, why: str) -> TrainingStopped:
        """The stop after ``why``, naming the checkpoint to resume and how."""
        good = self.last_good_checkpoint()
        if good is None:
            advice = ("no checkpoint kept holds weights whose loss was within its recent range: start over with "
                      f"trainer.resume=none and a lower optim.lr (this run: {self.lr:g})")
        else:
            advice = (f"the last good checkpoint is {good} (the newest whose weights still gave a loss within its "
                      f"recent range): resume it with a lower learning rate, trainer.resume={good} optim.lr=<below "
                      f"{self.lr:g}>")
        return TrainingStopped(f"{why}; {advice}. A longer optim.warmup_steps, trainer.grad_clip on, or "
                               "trainer.dtype=bf16/fp32 help too")
