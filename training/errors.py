"""How a run stops early: the errors the loop raises, each carrying what was saved and what to try.

``TrainingStopped``, ``NonFiniteState`` and ``OutOfMemory`` are UserErrors (one line, exit status 2); ``Interrupted``
exits with 128 + the signal number (training/cli.py).
"""
from pathlib import Path
from typing import Optional

import torch

from errors import UserError

OUT_OF_MEMORY_ADVICE = (
    "Try a smaller trainer.batch_size with a larger trainer.grad_accum (same tokens per step), attention=flash "
    "or hybrid instead of naive, model.activation_checkpointing=true, or a shorter model.block_size "
    "(scripts/fit.py finds what fits)"
)


class TrainingStopped(UserError):
    """The run cannot go on (non-finite loss for too many steps); the last good checkpoint is kept."""


class NonFiniteState(UserError):
    """A checkpoint was due but the weights or the optimizer state are not finite: nothing was written."""

    def __init__(self, step: int):
        super().__init__(f"the weights or the optimizer state after step {step} are not finite, although its loss and "
                         "gradient were; no checkpoint was written")


class OutOfMemory(UserError):
    """The GPU ran out of memory: at ``step`` of the loop (the step before is saved in ``saved``), or
    outside the steps (step None: evaluation, sampling, trial batches), keeping the checkpoints written."""

    def __init__(self, step: Optional[int] = None, saved: Optional[Path] = None, budget_gb: Optional[float] = None):
        where = f" at step {step}" if step is not None else ""
        peak = ""
        if torch.cuda.is_available():
            limit = f" of the trainer.vram_budget_gb={budget_gb:g} GiB budget" if budget_gb else ""
            peak = f" (peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated{limit})"
        kept = f"; step {step - 1} is saved in {saved}" if saved else "; checkpoints written so far are kept"
        super().__init__(f"out of GPU memory{where}{peak}{kept}. {OUT_OF_MEMORY_ADVICE}")


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived; a checkpoint of the last finished step was saved."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
