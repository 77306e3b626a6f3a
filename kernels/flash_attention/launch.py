"""Launching the flash-attention kernels: the autotuned config, and a cache of compiled kernels.

``kernel[grid](**kwargs)`` makes Triton bind every keyword argument (about 45 here), work out how
each specialises the binary and build a cache key, on every call. That host time is the floor of
a short sequence's forward+backward (docs/KERNEL.md). After the first launch of a *launch key* we
keep the compiled kernel that launch returned and call it with positional arguments through
``CompiledKernel[grid](*args)`` (the same call in triton 3.6, 3.7 and 3.8).

The launch key is a superset of what Triton specialises a binary on: every argument's value except
the float scales, with each tensor reduced to (dtype, device, data pointer divisible by 16). The
same key therefore always means the same binary. ``NANOFLASH_LAUNCH_CACHE=0`` turns the cache off,
so every call goes through Triton's own path (for comparisons, and as an escape hatch).
"""

from __future__ import annotations

import os

import torch

from .configs import TileConfig, autotune_enabled, default_config, is_interpreter

_TUNED: dict[tuple, TileConfig] = {}  # autotune key -> config the autotuner picked
_COMPILED: dict[tuple, tuple] = {}  # launch key -> (compiled kernel, its TileConfig)
_MAX_COMPILED = 4096  # bound the cache when T keeps changing (sampling grows T one token at a time)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n. Plain Python: ``triton.next_power_of_2`` and ``triton.cdiv`` are
    constexpr functions whose every host call costs microseconds."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def launch_cache_enabled() -> bool:
    return not is_interpreter() and os.environ.get("NANOFLASH_LAUNCH_CACHE", "1") != "0"


def launch_key(kind: str, args: dict) -> tuple:
    """What decides the compiled binary: ints, bools and None by value, tensors by dtype, device
    and 16-byte alignment. Float scales are runtime values of every binary and are left out."""
    key = [kind]
    for value in args.values():
        if isinstance(value, torch.Tensor):
            key.append((value.dtype, value.device, value.data_ptr() % 16 == 0))
        elif not isinstance(value, float):
            key.append(value)
    return tuple(key)


def _grid(kind: str, cfg: TileConfig, grid_rows: int, grid_yz: tuple[int, int]) -> tuple[int, int, int]:
    """Axis 0 tiles ``grid_rows`` by the kernel's resident block: ``BLOCK_N`` key rows for dK/dV,
    ``BLOCK_M`` query rows otherwise."""
    block = cfg.BLOCK_N if kind == "dkdv" else cfg.BLOCK_M
    return (ceil_div(grid_rows, block), *grid_yz)


def _tuned_config(kernel_tuned, kind: str, grid_rows: int, grid_yz: tuple[int, int], args: dict,
                  device) -> TileConfig | None:
    """The autotuner's pick for these arguments; None after a first call, which tuned and launched."""
    key = (kind, args["T_BUCKET"], args["HEAD_DIM"], args["IS_CAUSAL"], args["HAS_WINDOW"],
           args["IS_VARLEN"], args["Q"].dtype, device.index)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    tile = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"
    kernel_tuned[lambda meta: (ceil_div(grid_rows, meta[tile]), *grid_yz)](**args)
    best = kernel_tuned.best_config
    _TUNED[key] = TileConfig(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
    return None


def launch(kernel_jit, kernel_tuned, kind: str, grid_rows: int, grid_yz: tuple[int, int],
           args: dict, block_d: int, elem_bytes: int, device) -> None:
    """Launch ``kind`` ("fwd", "dq" or "dkdv") with keyword ``args`` (all but the tile sizes).

    The config is the autotuner's pick (tuned on the first call per autotune key), or the first
    fitting default under the interpreter / ``NANOFLASH_AUTOTUNE=0``. Grid axes 1 and 2 are
    ``grid_yz``.
    """
    tuning = autotune_enabled()  # read per call: tests and benchmarks switch these at run time
    key = (tuning, *launch_key(kind, args)) if launch_cache_enabled() else None
    cached = _COMPILED.get(key) if key is not None else None
    if cached is not None:
        compiled, cfg = cached
        args["BLOCK_M"], args["BLOCK_N"] = cfg.BLOCK_M, cfg.BLOCK_N
        compiled[_grid(kind, cfg, grid_rows, grid_yz)](*[args[name] for name in kernel_jit.arg_names])
        return
    if tuning:
        cfg = _tuned_config(kernel_tuned, kind, grid_rows, grid_yz, args, device)
        if cfg is None:
            return
    else:
        cfg = default_config(kind, device, block_d, elem_bytes)
    compiled = kernel_jit[_grid(kind, cfg, grid_rows, grid_yz)](
        **args, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if key is not None:
        if hasattr(compiled, "result"):  # a compile future (triton's async compile mode)
            compiled = compiled.result()
        if len(_COMPILED) >= _MAX_COMPILED:
            _COMPILED.clear()
        _COMPILED[key] = (compiled, cfg)
