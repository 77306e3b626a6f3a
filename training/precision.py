"""Device and numeric precision: which device and dtype a run uses, its memory cap, autocast and the grad scaler."""
import contextlib

import torch

from errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    """trainer.device -> torch.device; `auto` takes the GPU when there is one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "trainer.device=cuda but PyTorch sees no CUDA GPU (torch.cuda.is_available() is False); "
            "use trainer.device=auto or trainer.device=cpu, or install a CUDA build of torch"
        )
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """trainer.dtype -> torch dtype; `auto` is bf16 where the GPU has it, else fp16, and fp32 on CPU."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        gpu = torch.cuda.get_device_name(device)
        raise UserError(f"trainer.dtype=bf16 but the {gpu} has no bf16 support; use trainer.dtype=fp16 (or auto)")
    if name == "fp16" and device.type != "cuda":
        raise UserError("trainer.dtype=fp16 needs a CUDA GPU; on CPU use trainer.dtype=fp32 (or auto)")
    return DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed-precision context for forward passes; a no-op in fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(device: torch.device, dtype: torch.dtype) -> torch.amp.GradScaler:
    """Loss scaling for fp16 (its 5-bit exponent underflows small gradients); disabled otherwise."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def apply_vram_budget(device: torch.device, budget_gb) -> None:
    """Cap this process' GPU memory at ``budget_gb`` GiB (trainer.vram_budget_gb); no-op without one.
    UserError on the CPU, where a budget would be ignored."""
    if budget_gb is None:
        return
    if device.type != "cuda":
        raise UserError(f"trainer.vram_budget_gb={budget_gb:g} caps GPU memory, but this run is on the CPU (no GPU is "
                        "in use); remove it, or train on a GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gb * 2**30 / total), index)
