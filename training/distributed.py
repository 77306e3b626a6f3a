"""Data-parallel training over several processes started by torchrun (one per GPU, or CPU processes).

    torchrun --nproc_per_node=2 train.py trainer.distributed=ddp ...

Every rank holds the whole model (DistributedDataParallel) and trains on its slice of one global
batch, so N ranks with batch_size B train exactly like one process with batch_size N*B. Rank 0
logs and writes checkpoints; the others only compute. CUDA ranks talk through NCCL, CPU ranks
through gloo. With trainer.distributed=none (the default) every function here is a no-op.
"""
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training.errors import UserError

KINDS = ("none", "ddp")


@dataclass
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(kind: str, device: torch.device):
    """Join the process group torchrun describes. Returns (Ranks, this rank's device)."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if kind == "none":
        if launched and int(os.environ["WORLD_SIZE"]) > 1:
            raise UserError("started by torchrun with several processes but trainer.distributed=none; "
                            "add trainer.distributed=ddp")
        return Ranks(), device
    if not launched:
        raise UserError(f"trainer.distributed={kind} runs under torchrun: "
                        f"torchrun --nproc_per_node=N train.py trainer.distributed={kind} ...")
    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        if ranks.local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {ranks.local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                            "use --nproc_per_node at most the number of GPUs")
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return ranks, device


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> torch.nn.Module:
    """The module the steps run through: DDP around ``model`` when distributed, else ``model``."""
    if not ranks.enabled:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def no_sync(step_model, last_micro_batch: bool):
    """Skip the gradient all-reduce on all micro-batches but the last of a step."""
    if last_micro_batch or not hasattr(step_model, "no_sync"):
        return nullcontext()
    return step_model.no_sync()


def mean(x: torch.Tensor) -> torch.Tensor:
    """Average of a tensor over ranks (the tensor itself when not distributed)."""
    if not dist.is_initialized():
        return x
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x / dist.get_world_size()


def maximum(value):
    """Largest value over ranks of a float or None (None stays None)."""
    if value is None or not dist.is_initialized():
        return value
    t = torch.tensor([float(value)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any (ranks agree to stop at the same step)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
