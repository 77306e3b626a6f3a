"""Causal flash attention in Triton: kernels, launch functions, torch.library ops, reference, configs.

See ``function.py`` for the public functions, the ops and the autograd, and docs/KERNEL.md.
"""

from .dropout import flash_dropout_mask
from .function import flash_attn, flash_attn_backward, flash_attn_qkvpacked
from .reference import attention_mask, attention_ref

__all__ = ["flash_attn", "flash_attn_qkvpacked", "flash_attn_backward", "flash_dropout_mask", "attention_ref",
           "attention_mask"]
