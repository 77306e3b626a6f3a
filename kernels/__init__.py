"""nanoflash kernels. Public: ``flash_attn``, ``flash_attn_qkvpacked``, ``flash_attn_backward`` and
``flash_attn_unavailable``.

``flash_attn_unavailable(device)`` never raises: the model layer asks it once, warns with the
reason and falls back to SDPA when it gives one.
"""

from __future__ import annotations

import torch

try:
    from .flash_attention import flash_attn, flash_attn_backward, flash_attn_qkvpacked
except ImportError as _err:  # triton missing: keep the package importable
    _missing = f"{_err}"

    def flash_attn(*args, **kwargs):  # type: ignore[no-redef]
        raise RuntimeError(f"flash_attn unavailable: {_missing}; check flash_attn_unavailable()")

    flash_attn_backward = flash_attn_qkvpacked = flash_attn  # type: ignore[assignment]


def flash_attn_unavailable(device: torch.device | str = "cuda") -> str:
    """Why the Triton flash-attention kernel cannot run on ``device``; "" when it can."""
    try:
        import triton
    except ImportError as e:
        return f"triton is not importable ({e})"
    try:
        from .flash_attention.configs import interpreting
    except Exception as e:  # pragma: no cover - broken install
        return f"kernels.flash_attention failed to import: {e!r}"
    device = torch.device(device)
    if device.type != "cuda":
        return "" if interpreting() else f"the kernel runs on CUDA GPUs and this run uses {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0) and tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 3):
        return (f"triton {triton.__version__} does not compile for compute capability {major}.{minor} "
                "(Turing and older; it needs 8.0, Ampere, or newer)")
    return ""


__all__ = ["flash_attn", "flash_attn_qkvpacked", "flash_attn_backward", "flash_attn_unavailable"]
