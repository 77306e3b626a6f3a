"""Launching the flash-attention kernels: the autotuned config, and a cache of compiled kernels.

``kernel[grid](**kwargs)`` makes Triton bind every keyword argument (about 45 here), work out how
each specialises the binary and build a cache key, on every call. That host time is the floor of
a short sequence's forward+backward (docs/KERNEL.md). After the first launch of a *launch key* we
keep the compiled kernel that launch returned and call it with positional arguments through
``CompiledKernel[grid](*args)`` (the same call in triton 3.6, 3.7 and 3.8).

Call sites pass the kernel's arguments in three groups: ``pointers`` (tensors or None), ``scales``
(floats, runtime values of every binary) and ``ints`` (every other argument: sizes, strides, flags,
constexprs). The launch key is a superset of what Triton specialises a binary on: the ints by value,
each pointer by dtype and 16-byte alignment, the device, and whether autotuning is on. The same key
therefore always means the same binary.

Two switches, read from the environment once when the kernels are imported (tests and benchmarks
set the attributes directly): ``NANOFLASH_LAUNCH_CACHE=0`` turns the cache off, so every call goes
through Triton's own path (for comparisons, and as an escape hatch); ``NANOFLASH_AUTOTUNE=0`` skips
tuning and launches the first config that fits (the GPU test matrix uses it to bound compile time).
Under ``TRITON_INTERPRET=1`` both are off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .configs import TileConfig, default_config, is_interpreter

_TUNED: dict[tuple, TileConfig] = {}  # autotune key -> config the autotuner picked
_COMPILED: dict[tuple, tuple] = {}  # launch key -> (compiled kernel, its TileConfig)
_MAX_COMPILED = 4096  # bound the cache when T keeps changing (sampling grows T one token at a time)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n. Plain Python: ``triton.next_power_of_2`` and ``triton.cdiv`` are
    constexpr functions whose every host call costs microseconds."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


AUTOTUNE = not is_interpreter() and os.environ.get("NANOFLASH_AUTOTUNE", "1") != "0"
LAUNCH_CACHE = not is_interpreter() and os.environ.get("NANOFLASH_LAUNCH_CACHE", "1") != "0"


@dataclass(frozen=True)
class Kernel:
    """One of our Triton kernels: its JIT function, its autotuned wrapper, and which tile size grid
    axis 0 steps by (the block that stays resident: key rows for dK/dV, query rows otherwise)."""

    kind: str  # "fwd", "dq" or "dkdv"
    jit: object
    tuned: object
    resident: str  # "BLOCK_M" or "BLOCK_N"


def launch_key(kernel: Kernel, pointers: dict, ints: dict, device, tuning: bool) -> tuple:
    """What decides the compiled binary (see the module docstring)."""
    aligned = [None if t is None else (t.dtype, t.data_ptr() % 16 == 0) for t in pointers.values()]
    return (kernel.kind, tuning, device, tuple(ints.values()), tuple(aligned))


def _grid(block: int, grid_rows: int, grid_yz: tuple[int, int]) -> tuple[int, int, int]:
    return (ceil_div(grid_rows, block), *grid_yz)


def _tuned_config(kernel: Kernel, grid_rows: int, grid_yz: tuple[int, int], args: dict, device) -> TileConfig | None:
    """The autotuner's pick for these arguments; None after a first call, which tuned and launched."""
    key = (kernel.kind, args["T_BUCKET"], args["HEAD_DIM"], args["IS_CAUSAL"], args["HAS_WINDOW"],
           args["IS_VARLEN"], args["Q"].dtype, device.index)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    kernel.tuned[lambda meta: _grid(meta[kernel.resident], grid_rows, grid_yz)](**args)
    best = kernel.tuned.best_config
    _TUNED[key] = TileConfig(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
    return None


def launch(kernel: Kernel, grid_rows: int, grid_yz: tuple[int, int], pointers: dict, scales: dict, ints: dict,
           device) -> None:
    """Launch ``kernel`` over ``grid_rows`` rows (grid axis 0, in tiles) and ``grid_yz`` (axes 1, 2).

    The config is the autotuner's pick (tuned on the first call per autotune key), or the first
    fitting default when ``AUTOTUNE`` is off.
    """
    tuning, caching = AUTOTUNE, LAUNCH_CACHE
    key = launch_key(kernel, pointers, ints, device, tuning) if caching else None
    cached = _COMPILED.get(key) if caching else None
    args = {**pointers, **scales, **ints}
    if cached is not None:
        compiled, cfg = cached
        args["BLOCK_M"], args["BLOCK_N"] = cfg.BLOCK_M, cfg.BLOCK_N
        grid = _grid(getattr(cfg, kernel.resident), grid_rows, grid_yz)
        compiled[grid](*[args[name] for name in kernel.jit.arg_names])
        return
    if tuning:
        cfg = _tuned_config(kernel, grid_rows, grid_yz, args, device)
        if cfg is None:
            return
    else:
        cfg = default_config(kernel.kind, device, ints["BLOCK_D"], pointers["Q"].element_size())
    compiled = kernel.jit[_grid(getattr(cfg, kernel.resident), grid_rows, grid_yz)](
        **args, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if caching:
        if hasattr(compiled, "result"):  # a compile future (triton's async compile mode)
            compiled = compiled.result()
        if len(_COMPILED) >= _MAX_COMPILED:
            _COMPILED.clear()
        _COMPILED[key] = (compiled, cfg)
