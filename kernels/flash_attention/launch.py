"""Launching the flash-attention kernels: one :class:`Launcher` owns the configs picked and the plans.

``kernel[grid](**kwargs)`` makes Triton bind every keyword argument (about 45 here), work out how
each specialises the binary and build a cache key, on every call. That host time is the floor of
a short sequence's forward+backward (docs/KERNEL.md). So each call site (forward, dQ, dK/dV) keeps
a *plan*: a cheap key of what its launch arguments are computed from (shapes, strides, dtypes,
scale, flags; see :meth:`Launcher.plan_key`), mapped to the compiled kernel bound to its grid and
every argument after the pointers. :meth:`Launcher.relaunch` replays a plan with the new call's
pointers through ``CompiledKernel[grid](*args)`` (the same call in triton 3.6 to 3.9); the call
site builds its arguments and goes through Triton's own launch only when it has no plan yet.

A plan stands for exactly the binary Triton's own launch would pick: the plan key holds every value
the integer arguments are derived from (Triton specialises those on ``== 1`` and divisibility by
16), the pointers' dtypes and device, whether autotuning is on and the family forced; a plan is
recorded only when every pointer is 16-byte aligned (the other alignment Triton specialises on),
so a misaligned call always takes Triton's own path.

Configs (``configs.shortlist``): most (GPU family, dtype, head dim) have one candidate, launched
at once. Where there are more, the first call of each *tuning key* (the kernel, ``T_BUCKET`` =
next_power_of_2(longest sequence), every constexpr but the tiles, the pointers' dtypes, the
device) times them (:func:`time_configs`), and the pick is kept in memory and on disk
(``tune_cache.py``, keyed also by GPU name, Triton version, kernel source and candidate list), so
the next process reads it instead of tuning. A tune or a first compilation that takes longer
than ``notice_after_s`` says so on stderr, once.

The settings are attributes of ``LAUNCHER``: ``autotune`` (off: launch the first candidate, as
tests do), ``replay`` (off: every call goes through Triton's launch, for comparisons),
``cache_dir`` (where picks are kept; None: nowhere), ``family`` (launch another GPU family's
configs: tests force "consumer" on an H100). Under ``TRITON_INTERPRET=1`` autotune and replay are
off: the interpreter neither times configs nor returns binaries.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from . import tune_cache
from .configs import TileConfig, default_config, describe_device, is_interpreter, shortlist

KERNEL_NAMES = {"fwd": "forward", "dq": "dQ", "dkdv": "dK/dV"}
TILE_NAMES = ("BLOCK_M", "BLOCK_N")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n. Plain Python: ``triton.next_power_of_2`` and ``triton.cdiv`` are
    constexpr functions whose every host call costs microseconds."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Kernel:
    """One of our Triton kernels: its JIT function, and which tile size grid axis 0 steps by (the
    block that stays resident: key rows for dK/dV, query rows otherwise)."""

    kind: str  # "fwd", "dq" or "dkdv"
    jit: object
    resident: str  # "BLOCK_M" or "BLOCK_N"

    @functools.cached_property
    def key_names(self) -> tuple[str, ...]:
        """The arguments a pick depends on: ``T_BUCKET`` and every constexpr but the tile sizes."""
        return ("T_BUCKET", *(p.name for p in self.jit.params if p.is_constexpr and p.name not in TILE_NAMES))


def _grid(block: int, grid_rows: int, grid_yz: tuple[int, int]) -> tuple[int, int, int]:
    return (ceil_div(grid_rows, block), *grid_yz)


def _with_tiles(args: dict, cfg: TileConfig) -> dict:
    return {**args, "BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N}


def time_configs(kernel: Kernel, candidates: list[TileConfig], grid_rows: int, grid_yz: tuple[int, int],
                 args: dict) -> dict[TileConfig, float]:
    """Median milliseconds of one launch of ``kernel`` on ``args`` with each candidate
    (``triton.testing.do_bench``); inf for one that does not fit the device. The candidates are
    compiled side by side first (Triton releases the GIL while it compiles), so a tune costs about
    one compilation, not one per candidate. The kernels only write their outputs, so running them
    again and again is harmless."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench

    calls = {cfg: (_grid(getattr(cfg, kernel.resident), grid_rows, grid_yz), _with_tiles(args, cfg),
                   {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}) for cfg in candidates}

    def compile_alone(cfg: TileConfig) -> None:
        grid, cfg_args, options = calls[cfg]
        with torch.cuda.device(args["Q"].device):  # a new thread starts on device 0
            try:
                kernel.jit.warmup(grid=grid, **cfg_args, **options)
            except OutOfResources:
                pass  # timed as inf below

    with ThreadPoolExecutor(len(candidates)) as pool:
        list(pool.map(compile_alone, candidates))
    timings = {}
    for cfg, (grid, cfg_args, options) in calls.items():
        try:
            timings[cfg] = do_bench(lambda: kernel.jit[grid](**cfg_args, **options), return_mode="median")
        except OutOfResources:
            timings[cfg] = float("inf")
    return timings


class SlowNotice:
    """``with SlowNotice(after_s, message):`` prints ``message`` to stderr once if the body is still
    running ``after_s`` seconds after it began (from a timer thread, so a user waiting on a long
    compilation reads why), or took that long in the end."""

    def __init__(self, after_s: float, message: str):
        self.after_s = after_s
        self.message = message
        self.said = False
        self._lock = threading.Lock()

    def say(self) -> None:
        with self._lock:
            if self.said:
                return
            self.said = True
        print(self.message, file=sys.stderr, flush=True)

    def __enter__(self) -> SlowNotice:
        self._start = time.perf_counter()
        self._timer = threading.Timer(self.after_s, self.say)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()
        self._timer.join()
        if time.perf_counter() - self._start >= self.after_s:
            self.say()


class Launcher:
    """Launches the kernels; owns the configs picked, the launch plans and the settings (module
    docstring)."""

    def __init__(self, autotune: bool, replay: bool, max_plans: int = 4096,
                 cache_dir: Path | None = None, family: str | None = None,
                 tuner=time_configs, notice_after_s: float = 2.0):
        self.autotune = autotune
        self.replay = replay
        self.max_plans = max_plans  # bounds the plans when T keeps changing (sampling grows T by one)
        self.cache_dir = cache_dir  # where tuning picks are kept between processes; None: nowhere
        self.family = family  # None: the device's own GPU family; else that family's configs
        self.tuner = tuner  # (kernel, candidates, grid_rows, grid_yz, args) -> {config: ms}
        self.notice_after_s = notice_after_s
        self.tuned: dict[tuple, TileConfig] = {}  # tuning key -> config launched (autotune on)
        self.plans: dict[tuple, tuple] = {}  # plan key -> (kernel bound to its grid, args after the pointers)
        self.compiled: set[tuple] = set()  # (tuning key, config) launched through Triton at least once

    def clear(self) -> None:
        self.tuned.clear()
        self.plans.clear()
        self.compiled.clear()

    def plan_key(self, kind: str, pointers: tuple, *derived) -> tuple | None:
        """Key of a call site's plan: ``kind``, the pointers' dtypes (None for absent ones), their
        device, whether autotuning is on, the family forced (if any), and ``derived``: every value
        the call site computes the other launch arguments from. None (no plan) when replay is off
        or a pointer is not 16-byte aligned."""
        if not self.replay:
            return None
        address_bits = 0
        dtypes = []
        for t in pointers:  # one pass: this runs on every call
            if t is None:
                dtypes.append(None)
            else:
                address_bits |= t.data_ptr()
                dtypes.append(t.dtype)
        if address_bits & 15:
            return None
        return (kind, self.autotune, self.family, pointers[0].device, tuple(dtypes), *derived)

    def relaunch(self, plan: tuple | None, pointers: tuple) -> bool:
        """Launch the kernel recorded under ``plan`` with these pointers; False if there is none yet."""
        recorded = self.plans.get(plan) if plan is not None else None
        if recorded is None:
            return False
        bound, rest = recorded
        bound(*pointers, *rest)
        return True

    def launch(self, kernel: Kernel, grid_rows: int, grid_yz: tuple[int, int], pointers: dict, scales: dict,
               ints: dict, device, plan: tuple | None = None) -> None:
        """Launch ``kernel`` over ``grid_rows`` rows (grid axis 0, in tiles) and ``grid_yz`` (axes 1, 2)
        through Triton's own launch, and record the binary under ``plan`` (from :meth:`plan_key`).

        The config is the first candidate with ``autotune`` off, else :meth:`pick`'s.
        """
        args = {**pointers, **scales, **ints}
        on_gpu = device.type == "cuda" and not is_interpreter()
        key = self.tuning_key(kernel, pointers, args, device) if on_gpu else None
        if self.autotune and on_gpu:
            cfg = self.pick(kernel, key, grid_rows, grid_yz, args, device)
        else:
            cfg = default_config(kernel.kind, device, ints["BLOCK_D"], pointers["Q"].element_size(), self.family)
        args = _with_tiles(args, cfg)
        grid = _grid(getattr(cfg, kernel.resident), grid_rows, grid_yz)
        notice = nullcontext()
        if on_gpu and (key, cfg) not in self.compiled:  # Triton may compile: say so if it takes long
            self.compiled.add((key, cfg))
            notice = SlowNotice(self.notice_after_s, f"nanoflash: compiling the {describe(kernel, args, False)} "
                                                     f"({cfg}); once per shape, Triton keeps the binary")
        with notice:
            compiled = kernel.jit[grid](**args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self._record(plan, kernel.jit, compiled, grid, pointers, args)

    def launch_fixed(self, jit, grid: tuple[int, int, int], pointers: dict, rest: dict, num_warps: int,
                     plan: tuple | None = None) -> None:
        """Launch ``jit``, a small kernel with one config of its own (no tiles to pick, nothing to
        tune), through Triton's own launch, and record the binary under ``plan``."""
        args = {**pointers, **rest}
        compiled = jit[grid](**args, num_warps=num_warps)
        self._record(plan, jit, compiled, grid, pointers, args)

    def _record(self, plan: tuple | None, jit, compiled, grid: tuple[int, int, int], pointers: dict,
                args: dict) -> None:
        """Keep ``compiled`` bound to ``grid`` and the arguments after the pointers under ``plan``."""
        if plan is None:
            return
        if hasattr(compiled, "result"):  # a compile future (triton's async compile mode)
            compiled = compiled.result()
        names = jit.arg_names
        assert list(pointers) == names[:len(pointers)], "the pointers must lead the kernel's signature"
        if len(self.plans) >= self.max_plans:
            self.plans.clear()
        self.plans[plan] = (compiled[grid], tuple(args[name] for name in names[len(pointers):]))

    def tuning_key(self, kernel: Kernel, pointers: dict, args: dict, device) -> tuple:
        """What a pick depends on: the kernel, :attr:`Kernel.key_names`' values, the pointers' dtypes
        (None for absent ones), the device and the family forced (if any)."""
        dtypes = tuple(None if t is None else t.dtype for t in pointers.values())
        return (kernel.kind, device.index, self.family, *(args[name] for name in kernel.key_names), dtypes)

    def pick(self, kernel: Kernel, key: tuple, grid_rows: int, grid_yz: tuple[int, int], args: dict,
             device) -> TileConfig:
        """The config for ``key``: remembered, the only candidate, read from disk, or timed now."""
        cfg = self.tuned.get(key)
        if cfg is not None:
            return cfg
        gpu = describe_device(device.index or 0).as_family(self.family)
        candidates = shortlist(kernel.kind, gpu, args["Q"].element_size(), args["BLOCK_D"])
        if len(candidates) > 1:
            cfg = self._stored_or_tuned(kernel, gpu, candidates, grid_rows, grid_yz, args)
        else:
            cfg = candidates[0]
        self.tuned[key] = cfg
        return cfg

    def disk_key(self, kernel: Kernel, gpu, candidates: list[TileConfig], args: dict) -> dict:
        """The key of a pick on disk: what :meth:`tuning_key` holds (but the device index), the GPU's
        name, the Triton version, a hash of the kernel's source and the candidates."""
        import triton

        return {"kernel": kernel.kind, "gpu": gpu.name, "family": gpu.family, "triton": triton.__version__,
                "source": kernel.jit.cache_key, "candidates": [str(c) for c in candidates],
                "args": {name: args[name] for name in kernel.key_names},
                "dtypes": [str(t.dtype) for t in args.values() if hasattr(t, "dtype")]}

    def _stored_or_tuned(self, kernel: Kernel, gpu, candidates: list[TileConfig], grid_rows: int,
                         grid_yz: tuple[int, int], args: dict) -> TileConfig:
        key = self.disk_key(kernel, gpu, candidates, args)
        stored = None
        if self.cache_dir is not None:
            stored = tune_cache.load(self.cache_dir, key, [asdict(c) for c in candidates])
        if stored is not None:
            return TileConfig(**stored)
        kept = (f"the pick will be cached at {tune_cache.entry_path(self.cache_dir, key)}" if self.cache_dir is not None
                else "the pick is kept for this process only (no cache_dir)")
        start = time.perf_counter()
        with SlowNotice(self.notice_after_s, f"nanoflash: tuning the {describe(kernel, args)}: compiling and timing "
                                             f"{len(candidates)} configs, once per GPU and shape; {kept}"):
            timings = self.tuner(kernel, candidates, grid_rows, grid_yz, args)
        best = min(timings, key=timings.get)
        if timings[best] == float("inf"):
            raise RuntimeError(f"nanoflash: no config of the {describe(kernel, args)} fits this GPU: "
                               f"{', '.join(map(str, candidates))}")
        if self.cache_dir is not None:
            tune_cache.store(self.cache_dir, key, {
                "pick": asdict(best), "seconds": round(time.perf_counter() - start, 3),
                "timings_ms": {str(c): ms for c, ms in timings.items()}})
        return best


def describe(kernel: Kernel, args: dict, with_length: bool = True) -> str:
    """E.g. 'dK/dV kernel for bfloat16, D=128, T<=2048': what is compiled or tuned."""
    dtype = str(args["Q"].dtype).removeprefix("torch.")
    length = f", T<={args['T_BUCKET']}" if with_length else ""
    return f"{KERNEL_NAMES[kernel.kind]} kernel for {dtype}, D={args['HEAD_DIM']}{length}"


LAUNCHER = Launcher(autotune=not is_interpreter(), replay=not is_interpreter(), cache_dir=tune_cache.default_folder())
