"""Causal flash attention in Triton: forward, backward, torch.library ops, reference, configs.

See ``function.flash_attn`` for the public interface and docs/KERNEL.md for design and numbers.
"""

from .dropout import flash_dropout_mask
from .function import flash_attn, flash_attn_bwd, flash_attn_fwd
from .packed import flash_attn_qkvpacked
from .reference import attention_mask, attention_ref

__all__ = ["flash_attn", "flash_attn_qkvpacked", "flash_attn_fwd", "flash_attn_bwd", "flash_dropout_mask",
           "attention_ref", "attention_mask"]
