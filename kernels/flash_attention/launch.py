"""Launching the flash-attention kernels: one :class:`Launcher` owns the tuned configs and plans.

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
16), the pointers' dtypes and device, and whether autotuning is on; a plan is recorded only when
every pointer is 16-byte aligned (the other alignment Triton specialises on), so a misaligned call
always takes Triton's own path.

One object, ``LAUNCHER``, holds both caches and the two settings: ``autotune`` (tune each kernel
once per autotune key; off: launch the first config that fits, as tests do to bound compile time)
and ``replay`` (use plans; off: every call goes through Triton's launch, for comparisons). Under
``TRITON_INTERPRET=1`` both are off: the interpreter neither times configs nor returns binaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from .configs import TileConfig, default_config, is_interpreter


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n. Plain Python: ``triton.next_power_of_2`` and ``triton.cdiv`` are
    constexpr functions whose every host call costs microseconds."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Kernel:
    """One of our Triton kernels: its JIT function, its autotuned wrapper, and which tile size grid
    axis 0 steps by (the block that stays resident: key rows for dK/dV, query rows otherwise)."""

    kind: str  # "fwd", "dq" or "dkdv"
    jit: object
    tuned: object
    resident: str  # "BLOCK_M" or "BLOCK_N"


def _grid(block: int, grid_rows: int, grid_yz: tuple[int, int]) -> tuple[int, int, int]:
    return (ceil_div(grid_rows, block), *grid_yz)


class Launcher:
    """Launches the kernels; owns the autotuner's picks and the launch plans (module docstring)."""

    def __init__(self, autotune: bool, replay: bool, max_plans: int = 4096):
        self.autotune = autotune
        self.replay = replay
        self.max_plans = max_plans  # bounds the plans when T keeps changing (sampling grows T by one)
        self.tuned: dict[tuple, TileConfig] = {}  # autotune key -> config the autotuner picked
        self.plans: dict[tuple, tuple] = {}  # plan key -> (kernel bound to its grid, args after the pointers)

    def clear(self) -> None:
        self.tuned.clear()
        self.plans.clear()

    def plan_key(self, kind: str, pointers: tuple, *derived) -> tuple | None:
        """Key of a call site's plan: ``kind``, the pointers' dtypes (None for absent ones), their
        device, whether autotuning is on, and ``derived``: every value the call site computes the
        other launch arguments from. None (no plan) when replay is off or a pointer is not
        16-byte aligned."""
        if not self.replay:
            return None
        address_bits = 0
        for t in pointers:
            if t is not None:
                address_bits |= t.data_ptr()
        if address_bits & 15:
            return None
        dtypes = tuple(None if t is None else t.dtype for t in pointers)
        return (kind, self.autotune, pointers[0].device, dtypes, *derived)

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

        The config is the autotuner's pick (tuned on the first call per autotune key, which launches
        and records nothing), or the first fitting default when ``autotune`` is off.
        """
        args = {**pointers, **scales, **ints}
        if self.autotune:
            cfg = self._tuned_config(kernel, grid_rows, grid_yz, args, device)
            if cfg is None:
                return
        else:
            cfg = default_config(kernel.kind, device, ints["BLOCK_D"], pointers["Q"].element_size())
        args["BLOCK_M"], args["BLOCK_N"] = cfg.BLOCK_M, cfg.BLOCK_N
        grid = _grid(getattr(cfg, kernel.resident), grid_rows, grid_yz)
        compiled = kernel.jit[grid](**args, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if plan is None:
            return
        if hasattr(compiled, "result"):  # a compile future (triton's async compile mode)
            compiled = compiled.result()
        names = kernel.jit.arg_names
        assert list(pointers) == names[:len(pointers)], f"{kernel.kind}: pointers must lead the signature"
        if len(self.plans) >= self.max_plans:
            self.plans.clear()
        self.plans[plan] = (compiled[grid], tuple(args[name] for name in names[len(pointers):]))

    def _tuned_config(self, kernel: Kernel, grid_rows: int, grid_yz: tuple[int, int], args: dict,
                      device) -> TileConfig | None:
        """The autotuner's pick for these arguments; None after a first call, which tuned and launched."""
        key = (kernel.kind, args["T_BUCKET"], args["HEAD_DIM"], args["IS_CAUSAL"], args["HAS_WINDOW"],
               args["IS_VARLEN"], args["HAS_DROPOUT"], args["HAS_GATE"], args["Q"].dtype, device.index)
        cfg = self.tuned.get(key)
        if cfg is not None:
            return cfg
        kernel.tuned[lambda meta: _grid(meta[kernel.resident], grid_rows, grid_yz)](**args)
        best = kernel.tuned.best_config
        self.tuned[key] = TileConfig(best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps,
                                     best.num_stages)
        return None


LAUNCHER = Launcher(autotune=not is_interpreter(), replay=not is_interpreter())
