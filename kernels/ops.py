"""A kernel's ``torch.library`` op: one schema, one implementation for every device, one fake.

Each kernel's host path goes through its op, whether the caller runs eagerly or in a graph that
``torch.compile`` traced (the fake gives the outputs' shapes, so the op stays one opaque node and
``fullgraph=True`` holds). Autograd, where a kernel has one, is an ``autograd.Function`` around the
ops, as in FlashAttention's ``flash_attn_interface.py``. ``torch.library.custom_op`` would put a
Python layer of its own around the same implementation (an autograd kernel, checks of the
outputs' aliasing) that costs host time on every call; an op made by :func:`define_op` is called
from the dispatcher directly.

An op that writes an input (``Tensor(a!)`` in its schema) bumps that input's version counter itself
(``torch.autograd.graph.increment_version``), so autograd still refuses a tensor it saved and the
kernel then overwrote.
"""

from __future__ import annotations

from typing import Callable

import torch


def define_op(qualname: str, schema: str, impl: Callable, fake: Callable):
    """Define ``qualname`` ("namespace::name") with ``schema``, ``impl`` as its implementation on
    every device (CUDA; CPU under Triton's interpreter) and ``fake`` for tracing. Returns the op's
    overload: what eager code and compiled graphs call."""
    torch.library.define(qualname, schema)
    torch.library.impl(qualname, "default", impl)
    torch.library.register_fake(qualname)(fake)
    namespace, name = qualname.split("::")
    return getattr(getattr(torch.ops, namespace), name).default
