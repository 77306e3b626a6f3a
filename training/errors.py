"""How a run stops early: the errors the loop raises, each carrying what was saved and what to try.

``TrainingStopped``, ``NonFiniteState`` and ``OutOfMemory`` are UserErrors (one line, exit status 2); ``Interrupted``
exits with 128 + the signal number (training/cli.py).
"""
import re
from pathlib import Path
from typing import Optional

import torch

from errors import UserError

OUT_OF_MEMORY_ADVICE = (
    "Try a smaller trainer.batch_size with a larger trainer.grad_accum (same tokens per step), attention=flash "
    "or hybrid instead of naive, model.activation_checkpointing=true (then model.recompute_attention=true for less "
    "still), or a shorter model.block_size "
    "(python -m scripts.fit finds what fits)"
)
CPU_MEMORY_ADVICE = (
    "Try a smaller model (model.n_embd, model.n_layer; model=tiny), a smaller trainer.batch_size with a larger "
    "trainer.grad_accum (same tokens per step), or a shorter model.block_size"
)
CPU_ALLOCATION = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def memory_exhausted(err: BaseException) -> Optional[str]:
    """"GPU" or "CPU" when ``err`` says that memory ran out, else None. PyTorch's CPU allocator raises a
    plain RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(err, torch.OutOfMemoryError):
        return "GPU"
    if isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and "can't allocate memory" in str(err)):
        return "CPU"
    return None


class TrainingStopped(UserError):
    """The run cannot go on (non-finite loss for too many steps); the last good checkpoint is kept."""


class NonFiniteState(UserError):
    """A checkpoint was due but the weights or the optimizer state are not finite: nothing was written."""

    def __init__(self, step: int):
        super().__init__(f"the weights or the optimizer state after step {step} are not finite, although its loss and "
                         "gradient were; no checkpoint was written")


class OutOfMemory(UserError):
    """The GPU (or with ``memory="CPU"`` the machine) ran out of memory: at ``step`` of the loop (the step
    before is saved in ``saved``), or outside the steps (step None: building the model, evaluation,
    sampling, trial batches), keeping the checkpoints written. ``err`` is the allocator's error."""

    def __init__(self, step: Optional[int] = None, saved: Optional[Path] = None, budget_gb: Optional[float] = None,
                 memory: str = "GPU", err: Optional[BaseException] = None):
        where = f" at step {step}" if step is not None else ""
        if memory == "CPU":
            tried = CPU_ALLOCATION.search(str(err or ""))
            detail = f" (an allocation of {int(tried.group(1)) / 2**30:,.1f} GiB failed)" if tried else ""
            advice = CPU_MEMORY_ADVICE
        else:
            detail, advice = "", OUT_OF_MEMORY_ADVICE
            if torch.cuda.is_available():
                limit = f" of the trainer.vram_budget_gb={budget_gb:g} GiB budget" if budget_gb else ""
                detail = f" (peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated{limit})"
        super().__init__(f"out of {memory} memory{where}{detail}{kept_text(step, saved)}. {advice}")


def kept_text(step: Optional[int], saved: Optional[Path]) -> str:
    """What a run that stops at ``step`` keeps: the step before, saved in ``saved``, or the checkpoints so far."""
    return f"; step {step - 1} is saved in {saved}" if saved else "; checkpoints written so far are kept"


class Interrupted(Exception):
    """A stop signal (training/signals.py) arrived in the loop; a checkpoint of the last finished step was saved."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
