"""The config and the launch of a tile kernel: one :class:`Tuner` per kernel (forward, dQ, dK/dV).

A launch function builds its kernel's arguments (the tensors, then the other values, then the
constexprs by name) and hands them to :meth:`Tuner.launch`, which picks a config and calls
``kernel[grid](*tensors, *values, **constexprs, **config.options)``, or replays the binary of an
earlier call with the same arguments (``launch.py``). The config is a speed choice only: every
candidate computes the same result.

:meth:`Tuner.pick` keeps one config per *tuning key*: the device, q's dtype, the T bucket
(``next_power_of_2`` of the longest sequence) and the values of the launch's ``constexprs``, the
very dict the launch passes to the kernel, so a constexpr the kernel gains joins the key with no
edit here (``tests/test_flash_tuning.py`` checks that every constexpr but the tiles is in it). The
first call of a key takes the candidates of ``configs.shortlist`` for the device: one (most rows)
is launched at once; several are timed once (:func:`time_configs`) and the fastest is kept, in
memory and on disk (``tune_cache.py``, whose key adds the GPU's name, the Triton version, the
kernel's source and the candidates), so the next process reads it instead of timing. An
interpreted kernel (``TRITON_INTERPRET=1``) takes ``configs.INTERPRET_CONFIGS``. A tune or a first
compilation that takes longer than ``notice_after_s`` says so on stderr, once.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

from . import tune_cache
from .configs import INTERPRET_CONFIGS, TileConfig, describe_device, shortlist
from .launch import Replay

KERNEL_NAMES = {"fwd": "forward", "dq": "dQ", "dkdv": "dK/dV"}
TILE_NAMES = ("BLOCK_M", "BLOCK_N")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n. Plain Python: ``triton.next_power_of_2`` and ``triton.cdiv`` are
    constexpr functions whose every host call costs microseconds."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def time_configs(tuner: Tuner, candidates: list[TileConfig], rows: int, grid_yz: tuple[int, int], args: tuple,
                 constexprs: dict) -> dict[TileConfig, float]:
    """Median milliseconds of one launch with each candidate (``triton.testing.do_bench``); inf for
    one that does not fit the device. The candidates are compiled side by side first (Triton
    releases the GIL while it compiles), so a tune costs about one compilation, not one per
    candidate. The kernels only write their outputs, so running them again and again is harmless."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench

    def compile_alone(cfg: TileConfig) -> None:
        with torch.cuda.device(args[0].device):  # a new thread starts on device 0
            try:
                tuner.jit.warmup(*args, grid=tuner.grid(cfg, rows, grid_yz), **constexprs, **cfg.options)
            except OutOfResources:
                pass  # timed as inf below

    with ThreadPoolExecutor(len(candidates)) as pool:
        list(pool.map(compile_alone, candidates))
    timings = {}
    for cfg in candidates:
        launch = tuner.jit[tuner.grid(cfg, rows, grid_yz)]
        try:
            timings[cfg] = do_bench(lambda: launch(*args, **constexprs, **cfg.options), return_mode="median")
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


class Tuner:
    """The config of one tile kernel per tuning key (module docstring).

    ``kind``: "fwd", "dq" or "dkdv" (the row of ``configs``); ``jit``: the Triton kernel;
    ``resident``: the tile grid axis 0 steps by ("BLOCK_M": query rows, "BLOCK_N": key rows).
    ``describe`` (device index -> ``configs.Device``), ``timer`` (:func:`time_configs`'s signature),
    ``cache_dir`` (None: ``tune_cache.default_folder()`` when a pick is stored) and
    ``notice_after_s`` are what tests replace with stand-ins, on a tuner of their own.
    """

    def __init__(self, kind: str, jit, resident: str, describe: Callable = describe_device,
                 timer: Callable = time_configs, cache_dir: Optional[Path] = None, notice_after_s: float = 2.0):
        self.kind = kind
        self.jit = jit
        self.resident = resident
        self.describe = describe
        self.timer = timer
        self.cache_dir = cache_dir
        self.notice_after_s = notice_after_s
        self.interpreted = type(jit).__name__ == "InterpretedFunction"
        self.picks: dict[tuple, TileConfig] = {}  # tuning key -> config
        self.replay = Replay(jit)

    def grid(self, cfg: TileConfig, rows: int, grid_yz: tuple[int, int]) -> tuple[int, int, int]:
        """Axis 0 covers ``rows`` in tiles of the resident block; axes 1, 2 are ``grid_yz``."""
        return ceil_div(rows, cfg.BLOCK_M if self.resident == "BLOCK_M" else cfg.BLOCK_N), *grid_yz

    @functools.cached_property
    def constexpr_names(self) -> tuple[str, ...]:
        """The kernel's constexpr parameters but the tiles, in signature order (what Triton reads as
        a constexpr: a parameter annotated ``tl.constexpr``)."""
        params = inspect.signature(self.jit.fn).parameters.values()
        return tuple(p.name for p in params if "constexpr" in str(p.annotation) and p.name not in TILE_NAMES)

    def launch(self, rows: int, grid_yz: tuple[int, int], tensors: tuple, values: tuple,
               cfg: Optional[TileConfig] = None) -> None:
        """``jit[grid](*tensors, *values)`` with ``cfg`` (None: :meth:`pick`'s, for the device and
        dtype of ``tensors[0]``, q), the grid covering ``rows`` and ``grid_yz``. ``tensors`` are the
        kernel's leading arguments, ``values`` all the others but the tiles, its constexprs last; the
        binary of an earlier call with the same plan key is replayed (``launch.py``)."""
        q = tensors[0]
        key = self.replay.key((q.device, rows, grid_yz, cfg), tensors, values)
        plan = self.replay.plans.get(key)
        if plan is not None:
            plan.launch(*tensors, *values, *plan.rest)
            return
        split = len(values) - len(self.constexpr_names)
        args, constexprs = tensors + values[:split], dict(zip(self.constexpr_names, values[split:]))
        if cfg is None:
            cfg = self.pick(q.device, q.dtype, rows, grid_yz, args, constexprs)
        grid = self.grid(cfg, rows, grid_yz)
        compiled = self.jit[grid](*args, **constexprs, **cfg.options)
        self.replay.record(key, compiled, grid, tensors, values, cfg.options)

    def pick(self, device, dtype, rows: int, grid_yz: tuple[int, int], args: tuple, constexprs: dict) -> TileConfig:
        """The config of a launch over ``rows`` (the longest sequence) with ``args`` and ``constexprs``."""
        key = (device, dtype, next_power_of_2(rows), *constexprs.values())
        cfg = self.picks.get(key)
        if cfg is None:
            cfg = self.picks[key] = self._first_pick(device, dtype, rows, grid_yz, args, constexprs)
        return cfg

    def _first_pick(self, device, dtype, rows, grid_yz, args, constexprs) -> TileConfig:
        """A new key's config: the interpreter's, the only candidate, read from disk or timed now;
        compiled here (with a notice when slow) so the launch that follows finds the binary."""
        if self.interpreted or device.type != "cuda":
            return INTERPRET_CONFIGS[self.kind]
        gpu = self.describe(device.index or 0)
        candidates = shortlist(self.kind, gpu, dtype.itemsize, constexprs["BLOCK_D"])
        what = (f"{KERNEL_NAMES[self.kind]} kernel for {str(dtype).removeprefix('torch.')}, "
                f"D={constexprs['HEAD_DIM']}")
        cfg = candidates[0]
        if len(candidates) > 1:
            cfg = self._stored_or_timed(gpu, dtype, candidates, rows, grid_yz, args, constexprs, what)
        with SlowNotice(self.notice_after_s, f"nanoflash: compiling the {what} ({cfg}); once per shape, "
                                             "Triton keeps the binary"):
            self.jit.warmup(*args, grid=self.grid(cfg, rows, grid_yz), **constexprs, **cfg.options)
        return cfg

    def disk_key(self, gpu, dtype, candidates: list[TileConfig], rows: int, constexprs: dict) -> dict:
        """The key of a pick on disk: the tuning key (the GPU by name, not index), the Triton
        version, a hash of the kernel's source and the candidates."""
        import triton

        return {"kernel": self.kind, "gpu": gpu.name, "family": gpu.family, "triton": triton.__version__,
                "source": self.jit.cache_key, "candidates": [str(c) for c in candidates], "dtype": str(dtype),
                "T_BUCKET": next_power_of_2(rows), "constexprs": dict(constexprs)}

    def _stored_or_timed(self, gpu, dtype, candidates, rows, grid_yz, args, constexprs, what) -> TileConfig:
        key = self.disk_key(gpu, dtype, candidates, rows, constexprs)
        folder = self.cache_dir if self.cache_dir is not None else tune_cache.default_folder()
        stored = tune_cache.load(folder, key, [asdict(c) for c in candidates])
        if stored is not None:
            return TileConfig(**stored)
        what = f"{what}, T<={next_power_of_2(rows)}"
        start = time.perf_counter()
        with SlowNotice(self.notice_after_s, f"nanoflash: tuning the {what}: compiling and timing {len(candidates)} "
                                             f"configs, once per GPU and shape; the pick will be cached at "
                                             f"{tune_cache.entry_path(folder, key)}"):
            timings = self.timer(self, candidates, rows, grid_yz, args, constexprs)
        best = min(timings, key=timings.get)
        if timings[best] == float("inf"):
            raise RuntimeError(f"nanoflash: no config of the {what} fits this GPU: {', '.join(map(str, candidates))}")
        tune_cache.store(folder, key, {"pick": asdict(best), "seconds": round(time.perf_counter() - start, 3),
                                       "timings_ms": {str(c): ms for c, ms in timings.items()}})
        return best
