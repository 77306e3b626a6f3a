"""The whole optimizer step as one CUDA graph (``trainer.cuda_graph``: auto, the default, or true).

A step launches several hundred kernels: forward and backward for each micro-batch, the gradient
norm, AdamW. Launched one by one from Python, the GPU idles between some of them; replayed from a
graph, it does not. After ``WARMUP_STEPS`` ordinary steps (compilation, autotuning, the optimizer's
state), the next step is captured: its micro-batches are read from fixed device buffers, the
learning rate from a device tensor, and the gradients land in buffers the graph owns. Every later
step copies its batches into those buffers, sets the learning rate and replays.

What a captured step cannot do is anything that needs the host inside the step: the document mask
(its boundaries are read on the host), several processes (their collectives) and the fp16 grad
scaler's skip-and-rescale are refused up front (``use_cuda_graph``); ``trainer.cuda_graph=auto``
(the default) captures where it can and runs uncaptured elsewhere, saying why on a GPU and nothing
on a CPU, where there is nothing to capture.
"""
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from errors import UserError
from training.optim import make_capturable

WARMUP_STEPS = 2  # ordinary steps before the capture: compile, autotune, create AdamW's state

Batch = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]
StepOutputs = Tuple[torch.Tensor, ...]


def unsupported_reason(device: torch.device, dtype: torch.dtype, distributed: str, document_mask: bool) -> Optional[str]:
    """Why a run with these settings cannot be captured; None when it can."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU and this run uses {device.type}"
    if dtype == torch.float16:
        return "fp16's grad scaler decides on the host whether a step counts; use trainer.dtype=bf16 or fp32"
    if distributed != "none":
        return f"trainer.distributed={distributed} synchronises the ranks from the host"
    if document_mask:
        return "data.document_mask=true reads each batch's document boundaries on the host"
    return None


def use_cuda_graph(setting, device: torch.device, dtype: torch.dtype, distributed: str, document_mask: bool) -> bool:
    """Whether to capture, for ``trainer.cuda_graph`` = true, false or auto.

    true where it cannot be done raises UserError naming the way out; auto captures where it can
    and otherwise runs uncaptured, saying why unless the device is not a GPU at all.
    """
    if not setting:
        return False
    reason = unsupported_reason(device, dtype, distributed, document_mask)
    if reason is None:
        return True
    if setting == "auto" and device.type != "cuda":
        return False
    if setting == "auto":
        print(f"trainer.cuda_graph=auto: steps run uncaptured, as {reason}")
        return False
    raise UserError(f"trainer.cuda_graph=true cannot be used here: {reason} (or set trainer.cuda_graph=false)")


class StaticBatches:
    """The loader a captured step reads: the same device tensors every step, refilled before each replay."""

    def __init__(self, batches: List[Batch]):
        self.batches = batches
        self.drawn = 0

    def next_batch(self) -> Batch:
        batch = self.batches[self.drawn % len(self.batches)]
        self.drawn += 1
        return batch

    def refill(self, loader) -> None:
        """Copy the next ``len(self.batches)`` batches of ``loader`` into the buffers."""
        for static in self.batches:
            for buffer, fresh in zip(static, loader.next_batch()):
                if buffer is not None:
                    buffer.copy_(fresh, non_blocking=True)


class CapturedStep:
    """``step(loader) -> outputs`` run eagerly ``WARMUP_STEPS`` times, then captured once and replayed.

    ``step`` is one optimizer step that draws ``grad_accum`` batches from ``loader`` and returns
    device tensors (loss, grad norm, good). The replayed outputs are copied out, so a caller may
    keep them across steps.
    """

    def __init__(self, step: Callable, optimizer: torch.optim.Optimizer, grad_accum: int):
        self.step = step
        self.optimizer = optimizer
        self.grad_accum = grad_accum
        self.eager_steps = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static: Optional[StaticBatches] = None
        self.outputs: Sequence[torch.Tensor] = ()

    def __call__(self, loader) -> StepOutputs:
        if self.graph is None and self.eager_steps < WARMUP_STEPS:
            self.eager_steps += 1
            return self.step(loader)
        if self.graph is None:
            self._capture(loader)
        else:
            self.static.refill(loader)
        self.graph.replay()
        return tuple(out.clone() for out in self.outputs)

    def _capture(self, loader) -> None:
        """Record one step on fresh buffers holding the loader's next batches (capturing runs nothing)."""
        self.static = StaticBatches([loader.next_batch() for _ in range(self.grad_accum)])
        make_capturable(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates the gradients it writes
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the graph gets a memory pool of its own: give back what eager steps cached
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs = self.step(self.static)
        self.graph = graph
