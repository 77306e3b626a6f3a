"""Replaying the binary of an earlier ``kernel[grid](...)`` call whose arguments Triton specialises alike.

Each ``kernel[grid](*args, **kwargs)`` call makes Triton bind every argument, work out how each
one specialises the binary (a tensor: its dtype and whether its address is a multiple of 16; an
integer: whether it is 1, whether a multiple of 16 and whether it fits 32 bits; a float or a
bool: its type only), build a key of those and look the binary up: tens of microseconds of host
time for our ~40-argument kernels, paid three times by every forward + backward, the larger
part of a short sequence's time in eager training. Launching a binary already in hand
(``CompiledKernel[grid](*args)``, how ``triton.compile``'s result is launched) skips all that.

:class:`Replay` keeps, per *plan key*, the binary a plain launch returned, bound to its grid. A
launch passes the tensors, then every other argument but the keyword options (tile sizes, warps,
stages) positionally, constexprs included; :func:`plan_key` makes the key from the call itself:
the current CUDA device, the caller's ``where`` (what the grid and the keyword options follow
from), the type and value of every non-tensor argument (an integer's value fixes everything Triton
reads from it) and the dtype and address mod 16 of every tensor (of a Gluon tensor descriptor, which the
Hopper kernels take: its dtype, tile and shared-memory layout). It holds every argument, whatever
the kernel's signature, and it is finer than Triton's own key, so a call that finds a plan is a
call Triton would give that very binary; an argument a kernel gains is in the key with no edit
here.

No plan is kept, so every call is a plain ``kernel[grid]``:

- under ``TRITON_INTERPRET=1`` (an interpreted kernel runs on the CPU and returns no binary);
- on a Triton outside :data:`REPLAYED_TRITON`: the versions whose ``JITFunction.run`` and
  ``CompiledKernel.__getitem__`` were read (they specialise as above, and a binary is launched
  with every argument in signature order, constexprs included);
- on a backend other than CUDA (ROCm's also specialises on a tensor's size);
- for a call with another argument than a ``torch.Tensor`` (not a subclass), a Gluon tensor
  descriptor or None among the tensors, or than an int, float, bool or None among the values.

A launch whose grid and options are its own ``where`` (the Hopper kernels', ``hopper.py``) is
``Replay.launch``; the tile kernels' goes through their ``tuning.Tuner``, which picks a config first.

Triton's process-wide switches (``TRITON_DEBUG``, its instrumentation) are not in the key: set them
before the first launch. ``tests/test_flash_launch.py`` checks that the key changes with every
argument of our launches, and on a GPU that each replayed binary is the one Triton's own lookup
returns.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.runtime import driver

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    DESCRIPTOR_TYPES = (TensorDescriptor,)
except ImportError:  # a Triton before Gluon (3.4) builds no Hopper kernels
    DESCRIPTOR_TYPES = ()

Tensor = torch.Tensor
REPLAYED_TRITON = ("3.6", "3.7", "3.8", "3.9")
TENSOR_TYPES = frozenset((Tensor, type(None), *DESCRIPTOR_TYPES))
VALUE_TYPES = frozenset((int, float, bool, type(None)))
MAX_PLANS = 4096  # per kernel; all are dropped when full (a sampler's growing T makes a plan per length)


def replay_supported(jit) -> bool:
    """Whether ``jit`` is a compiled (not interpreted) kernel on a Triton of :data:`REPLAYED_TRITON`."""
    from triton.runtime.jit import JITFunction

    return isinstance(jit, JITFunction) and triton.__version__.rsplit(".", 1)[0] in REPLAYED_TRITON


def plan_key(device: int, where: tuple, tensors: tuple, values: tuple) -> tuple:
    """The plan key of ``kernel[grid](*tensors, *values, **options)`` on CUDA device ``device``, whose
    grid and keyword options follow from ``where`` (module docstring)."""
    return (device, where, values, tuple(map(type, values)),
            tuple([t if t is None else (t.dtype, t.data_ptr() & 15) if isinstance(t, Tensor)
                   else (t.base.dtype, tuple(t.block_shape), t.layout) for t in tensors]))


class Plan(NamedTuple):
    launch: object  # CompiledKernel[grid]: launch(*tensors, *values, *rest)
    rest: tuple  # the kernel's arguments after the values (the keyword options'), in signature order
    binary: object  # the CompiledKernel


class Replay:
    """The plans of one Triton kernel's launches (module docstring). ``key(...)`` is a call's plan
    key (None: replay is off for this kernel), ``plans.get(key)`` its :class:`Plan`, if any;
    ``record(...)`` keeps the binary a plain launch returned."""

    def __init__(self, jit):
        self.jit = jit
        self.on = replay_supported(jit)
        self.plans: dict[tuple, Plan] = {}

    def key(self, where: tuple, tensors: tuple, values: tuple) -> tuple | None:
        return plan_key(driver.active.get_current_device(), where, tensors, values) if self.on else None

    def record(self, key: tuple | None, compiled, grid: tuple, tensors: tuple, values: tuple, options: dict) -> None:
        """Keep ``compiled``, which ``jit[grid](*tensors, *values, **options)`` returned, under ``key``."""
        from triton.compiler import CompiledKernel

        if (key is None or not isinstance(compiled, CompiledKernel) or not TENSOR_TYPES.issuperset(map(type, tensors))
                or not VALUE_TYPES.issuperset(map(type, values))
                or driver.active.get_current_target().backend != "cuda"):
            return
        rest = tuple(options[p.name] if p.name in options else p.default
                     for p in self.jit.params[len(tensors) + len(values):])
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        self.plans[key] = Plan(compiled[(*grid, 1, 1)[:3]], rest, compiled)  # a binary's launch takes 3 grid dims

    def launch(self, grid: tuple, tensors: tuple, values: tuple, **options) -> None:
        """``jit[grid](*tensors, *values, **options)``, or the binary of an earlier such call with the same
        plan key (``where``: the grid and the options)."""
        key = self.key((grid, *options.items()), tensors, values)
        plan = self.plans.get(key)
        if plan is not None:
            plan.launch(*tensors, *values, *plan.rest)
            return
        self.record(key, self.jit[grid](*tensors, *values, **options), grid, tensors, values, options)
