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

Building those three groups (about 45 values) and the launch key is itself most of the host time
left, so each call site also keeps a *plan*: a cheap key of what the groups are computed from
(shapes, strides, dtypes, flags; see :func:`plan_key`), mapped to the compiled kernel bound to its
grid and every argument after the pointers. :func:`relaunch` replays a plan with new pointers, and
the call site builds the groups only when it has no plan yet. A plan is recorded only for inputs
whose every pointer is 16-byte aligned, so it always matches the binary the launch key would pick.

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
_PLANS: dict[tuple, tuple] = {}  # plan key -> (compiled kernel bound to its grid, arguments after the pointers)
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


def plan_key(kind: str, pointers: tuple, *derived) -> tuple | None:
    """Key of a call site's plan: ``kind``, the pointers' dtypes (None for absent ones), their
    device, and ``derived``: every value the call site computes the other launch arguments from.

    None (no plan) when the cache is off or a pointer is not 16-byte aligned."""
    if not LAUNCH_CACHE:
        return None
    address_bits = 0
    for t in pointers:
        if t is not None:
            address_bits |= t.data_ptr()
    if address_bits & 15:
        return None
    dtypes = tuple(None if t is None else t.dtype for t in pointers)
    return (kind, AUTOTUNE, pointers[0].device, dtypes, *derived)


def relaunch(plan: tuple | None, pointers: tuple) -> bool:
    """Launch the kernel recorded under ``plan`` with these pointers; False if there is none yet."""
    recorded = _PLANS.get(plan) if plan is not None else None
    if recorded is None:
        return False
    bound, rest = recorded
    bound(*pointers, *rest)
    return True


def _remember(cache: dict, key: tuple, value) -> None:
    if len(cache) >= _MAX_COMPILED:
        cache.clear()
    cache[key] = value


def _record_plan(plan: tuple, kernel: Kernel, compiled, grid: tuple, pointers: dict, args: dict) -> None:
    names = kernel.jit.arg_names
    assert list(pointers) == names[:len(pointers)], f"{kernel.kind}: pointers must lead the signature"
    _remember(_PLANS, plan, (compiled[grid], tuple(args[name] for name in names[len(pointers):])))


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
           device, plan: tuple | None = None) -> None:
    """Launch ``kernel`` over ``grid_rows`` rows (grid axis 0, in tiles) and ``grid_yz`` (axes 1, 2).

    The config is the autotuner's pick (tuned on the first call per autotune key), or the first
    fitting default when ``AUTOTUNE`` is off. With a ``plan`` key (from :func:`plan_key`), the
    launch is recorded for :func:`relaunch`.
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
        if plan is not None:
            _record_plan(plan, kernel, compiled, grid, pointers, args)
        return
    if tuning:
        cfg = _tuned_config(kernel, grid_rows, grid_yz, args, device)
        if cfg is None:
            return
    else:
        cfg = default_config(kernel.kind, device, ints["BLOCK_D"], pointers["Q"].element_size())
    grid = _grid(getattr(cfg, kernel.resident), grid_rows, grid_yz)
    compiled = kernel.jit[grid](
        **args, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if caching:
        if hasattr(compiled, "result"):  # a compile future (triton's async compile mode)
            compiled = compiled.result()
        _remember(_COMPILED, key, (compiled, cfg))
        if plan is not None:
            args["BLOCK_M"], args["BLOCK_N"] = cfg.BLOCK_M, cfg.BLOCK_N
            _record_plan(plan, kernel, compiled, grid, pointers, args)
