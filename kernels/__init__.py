"""nanoflash kernels. Public: ``flash_attn``, ``flash_attn_qkvpacked`` and ``flash_attn_available``.

``flash_attn_available()`` never raises: the model layer calls it once, warns with the reason
and falls back to SDPA when it says False.
"""

from __future__ import annotations

import os


def flash_attn_available() -> tuple[bool, str]:
    """(True, how) when the Triton kernel can run here, else (False, why not)."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return False, f"triton not installed ({e})"
    try:
        from .flash_attention import flash_attn as _  # noqa: F401
    except Exception as e:  # pragma: no cover - broken install
        return False, f"kernels.flash_attention failed to import: {e!r}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "Triton interpreter (TRITON_INTERPRET=1; CPU, slow)"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    return True, f"CUDA GPU {torch.cuda.get_device_name()}"


try:
    from .flash_attention import flash_attn, flash_attn_qkvpacked
except ImportError as _err:  # triton missing: keep the package importable
    _reason = f"{_err}"

    def flash_attn(*args, **kwargs):  # type: ignore[no-redef]
        raise RuntimeError(f"flash_attn unavailable: {_reason}; check flash_attn_available()")

    flash_attn_qkvpacked = flash_attn  # type: ignore[assignment]


__all__ = ["flash_attn", "flash_attn_qkvpacked", "flash_attn_available"]
