"""Data-parallel training over several processes started by torchrun (one per GPU, or CPU processes).

    torchrun --nproc_per_node=2 train.py trainer.distributed=ddp|fsdp ...

Each rank trains on its slice of one global batch, so N ranks with batch_size B train exactly like
one process with batch_size N*B. With ``ddp`` every rank holds the whole model
(DistributedDataParallel); with ``fsdp`` (FSDP2, ``fully_shard`` per transformer block and once
more for the embeddings and head) each rank holds 1/N of the weights, gradients and optimizer state
and gathers a block's weights just before using it. Rank 0 logs; the others only compute. CUDA
ranks talk through NCCL, CPU ranks through gloo. With trainer.distributed=none (the default) every
function here is a no-op.

With ``trainer.context_parallel=N`` the world is a 2-D ``DeviceMesh`` (data parallel x context
parallel, N consecutive ranks per context group): the N ranks of a group share each sequence
(training/context_parallel.py) and read the same slice of the global batch, that of their data
parallel rank. DDP and FSDP still span the whole world (FSDP shards over the flattened dp x cp
mesh), so weight gradients are averaged over every rank.

FSDP, DTensor, DeviceMesh and DDP are imported where a run uses them: torch.distributed.tensor alone
takes seconds to import (it loads sympy), which every single-process run would otherwise pay.
"""
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from errors import UserError

KINDS = ("none", "ddp", "fsdp")


@dataclass
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    kind: str = "none"
    control: Optional[dist.ProcessGroup] = None  # gloo group for host-side flags: agreeing on them never waits for a GPU
    context_size: int = 1  # N: ranks that share each sequence (trainer.context_parallel)
    context_group: Optional[dist.ProcessGroup] = None  # those N ranks (the mesh's cp dimension); None when N = 1

    @property
    def data_rank(self) -> int:
        """Which slice of the global batch this rank reads (its rank along the mesh's dp dimension)."""
        return self.rank // self.context_size

    @property
    def data_size(self) -> int:
        """Slices of the global batch: world_size / context_size."""
        return self.world_size // self.context_size

    @property
    def context_rank(self) -> int:
        """This rank's place in its context group."""
        return self.rank % self.context_size

    @property
    def sharded(self) -> bool:
        """Weights and optimizer state are split over the ranks (FSDP): saving and loading are collective."""
        return self.kind == "fsdp"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(kind: str, device: torch.device, context_parallel: int = 1):
    """Join the process group torchrun describes (as a dp x cp mesh with ``context_parallel`` > 1).
    Returns (Ranks, this rank's device)."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if kind == "none":
        if launched and int(os.environ["WORLD_SIZE"]) > 1:
            raise UserError("started by torchrun with several processes but trainer.distributed=none; "
                            "add trainer.distributed=ddp")
        return Ranks(), device
    if not launched:
        raise UserError(f"trainer.distributed={kind} runs under torchrun: "
                        f"torchrun --nproc_per_node=N train.py trainer.distributed={kind} ...")
    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)), kind)
    if device.type == "cuda":
        if ranks.local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {ranks.local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                            "use --nproc_per_node at most the number of GPUs")
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    ranks.control = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
    if context_parallel > 1:
        ranks.context_size = context_parallel
        ranks.context_group = context_group(ranks.world_size, context_parallel, device)
    return ranks, device


def context_group(world_size: int, n: int, device: torch.device) -> dist.ProcessGroup:
    """This rank's group along the context-parallel dimension of the (world_size / n, n) mesh."""
    if world_size % n:
        raise UserError(f"trainer.context_parallel={n} does not divide the {world_size} ranks; start a multiple of "
                        f"{n} ranks (torchrun --nproc_per_node) or choose a trainer.context_parallel that divides "
                        f"{world_size}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size // n, n), mesh_dim_names=("dp", "cp"))
    return mesh.get_group("cp")


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, ranks: Ranks, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The module the steps run through: ``model`` itself, inside DDP, or sharded in place by FSDP2.

    Under FSDP the optimizer must be built after this call: sharding replaces the parameters.
    """
    if ranks.sharded:
        return shard(model, device, dtype)
    if not ranks.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def shard(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2: one shard group per transformer block, the root group holds embeddings, final norm and head.

    On the GPU with bf16/fp16 the weights are gathered in that dtype (half the traffic) and the
    gradients reduced in fp32; the sharded master weights and the optimizer stay fp32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low_precision = device.type == "cuda" and dtype != torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if low_precision else MixedPrecisionPolicy()
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):  # the backward starts with the last block: keep it gathered
        fully_shard(block, mp_policy=policy, reshard_after_forward=i < last)
    fully_shard(model, mp_policy=policy)
    return model


@contextmanager
def gradient_sync(step_model, last_micro_batch: bool):
    """Reduce gradients over ranks only on the last micro-batch of a step (DDP no_sync, FSDP's flag)."""
    if hasattr(step_model, "set_requires_gradient_sync"):
        step_model.set_requires_gradient_sync(last_micro_batch)
        yield
    elif last_micro_batch or not hasattr(step_model, "no_sync"):
        yield
    else:
        with step_model.no_sync():
            yield


def local(x: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (FSDP's gradient norm) as a plain tensor; plain tensors pass through."""
    return x.full_tensor() if is_dtensor(x) else x


def is_dtensor(x) -> bool:
    """Whether ``x`` is a DTensor (an FSDP2 shard). Only torch.distributed.tensor makes them, so a process
    that has not imported it (no FSDP) holds none, and this does not import it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 has turned the model's parameters into DTensor shards."""
    return any(is_dtensor(p) for p in model.parameters())


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


def any_rank(flag: bool, ranks: Ranks) -> bool:
    """True on every rank when ``flag`` is true on any (ranks agree to stop at the same step).

    Called every step, so it talks over the CPU (gloo) group: an all-reduce on the GPU stream read
    back with ``.item()`` would make each step wait for the GPU to finish the one before.
    """
    if not ranks.enabled:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ranks.control)
    return bool(t.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
