"""Launch configurations of the flash-attention kernels: a short list per (GPU family, dtype, D).

Three kernels are configured: the forward (``fwd``), the backward dK/dV kernel (``dkdv``) and the
backward dQ kernel (``dq``). Each config sets two tile sizes (``BLOCK_M`` rows of queries,
``BLOCK_N`` rows of keys), ``num_warps`` and ``num_stages``.

:func:`shortlist` gives the candidates of one kernel on one device, best first, from a table keyed
by the GPU family (Hopper; A100; consumer Ampere/Ada with ~100 KB of shared memory), the element
size (fp16/bf16, or fp32) and the padded head dim (``BLOCK_D``; 16 shares the row of 32). Most rows
hold one config, launched without tuning. Two rows hold two: Hopper, fp16/bf16, D in (64, 128],
forward and dQ, where the H100's autotuner picked different configs at different lengths (forward
64x64 up to T=2048 and 128x64 from 4096 or 8192 on; dQ 128x64 up to 8192 and 64x32 at 16384, in
the bench runs of 2026-11-23, docs/runs/bench_flash_*.json). ``tuning.py`` times those once per
tuning key and keeps the pick on disk (``tune_cache.py``). At D=64 the autotuner picked the same
three configs at every length it ran (1024, 2048), so that row holds one each.

Hopper's rows at D=64 and D=128 are those measured picks, and D <= 32 takes D=64's. The other
rows are the configs the former per-family candidate lists put first, except where compiling
them ahead of time (``triton.compile`` for sm_80 / sm_90, ptxas's resource report) showed
kilobytes of register spills (A100 dK/dV at D=128) or the longest compile times of the table
(forward and dQ at D=256).

fp32 rows are shared by all families and small on purpose. fp32 inputs use IEEE dots, which
Triton lowers to FMA loops unrolled per thread: the code grows with the FMAs per thread per dot,
BLOCK_M * BLOCK_N * BLOCK_D / (32 * num_warps), and so does ptxas's time. The former fp32 picks
did 2048-8192 of them (dK/dV 32x128 with 4 warps and 3 stages at D=64: 35k lines of PTX, 3 KB of
register spills); the first fp32 call at a new shape took 28-108 s on the H100. The rows here do
at most 512 (256 in the four-dot dK/dV kernel), with one stage.

Every row fits its family's shared memory (a test checks the estimate); :func:`filter_configs`
still drops what does not fit the device at hand (a card with less than its family's budget, or
a family forced on another card: ``Device.as_family``). Under ``TRITON_INTERPRET=1`` (CPU) one
small config per kernel is used; :func:`interpreting` is where nanoflash reads that variable.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

# Shared-memory budgets (bytes) of the cards we care about.
SMEM_HOPPER = 227 * 1024  # H100 / H200 (opt-in maximum per block)
SMEM_AMPERE_DC = 163 * 1024  # A100
SMEM_CONSUMER = 99 * 1024  # RTX 30xx / 40xx (sm_86 / sm_89)
SMEM_TURING = 64 * 1024  # sm_75
FAMILY_SMEM = {"hopper": SMEM_HOPPER, "ampere": SMEM_AMPERE_DC, "consumer": SMEM_CONSUMER}
KINDS = ("fwd", "dkdv", "dq")


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration: tile sizes plus Triton's warps and pipeline depth."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.BLOCK_M}x{self.BLOCK_N}, {self.num_warps} warps, {self.num_stages} stages"

    @functools.cached_property
    def options(self) -> dict:
        """The launch's keyword arguments of this config: ``kernel[grid](*args, **cfg.options)``."""
        return {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N, "num_warps": self.num_warps,
                "num_stages": self.num_stages}


def _t(bm: int, bn: int, w: int, s: int) -> TileConfig:
    return TileConfig(bm, bn, w, s)


def _row(fwd: list[TileConfig], dkdv: list[TileConfig], dq: list[TileConfig]) -> dict[str, list[TileConfig]]:
    return {"fwd": fwd, "dkdv": dkdv, "dq": dq}


# fp16 / bf16: (family, BLOCK_D) -> candidates per kernel, best first (module docstring).
_HOPPER_D64 = _row([_t(64, 64, 4, 3)], [_t(32, 64, 4, 3)], [_t(64, 64, 4, 3)])
_CONSUMER = _row([_t(64, 64, 4, 2)], [_t(32, 64, 4, 2)], [_t(64, 32, 4, 2)])
HALF_CONFIGS: dict[tuple[str, int], dict[str, list[TileConfig]]] = {
    ("hopper", 32): _HOPPER_D64,
    ("hopper", 64): _HOPPER_D64,
    ("hopper", 128): _row([_t(64, 64, 4, 3), _t(128, 64, 8, 3)], [_t(64, 128, 8, 3)],
                          [_t(128, 64, 8, 3), _t(64, 32, 4, 3)]),
    ("hopper", 256): _row([_t(64, 32, 8, 2)], [_t(16, 32, 4, 1)], [_t(32, 32, 4, 2)]),
    ("ampere", 32): _row([_t(128, 64, 4, 3)], [_t(32, 128, 8, 2)], [_t(128, 32, 8, 2)]),
    ("ampere", 64): _row([_t(128, 64, 4, 3)], [_t(32, 128, 8, 2)], [_t(128, 32, 8, 2)]),
    ("ampere", 128): _row([_t(128, 64, 8, 3)], [_t(32, 64, 4, 3)], [_t(128, 32, 8, 2)]),
    ("ampere", 256): _row([_t(64, 32, 8, 2)], [_t(16, 32, 4, 1)], [_t(32, 32, 4, 2)]),
    ("consumer", 32): _CONSUMER,
    ("consumer", 64): _CONSUMER,
    ("consumer", 128): _CONSUMER,
    ("consumer", 256): _row([_t(32, 32, 4, 2)], [_t(16, 32, 4, 1)], [_t(32, 32, 4, 2)]),
}

# fp32 (IEEE dots on FMA units, every family): BLOCK_D -> candidates per kernel. At most 512 FMAs
# per thread per dot, 256 in dK/dV (module docstring), one stage.
FP32_CONFIGS: dict[int, dict[str, list[TileConfig]]] = {
    32: _row([_t(64, 32, 4, 1)], [_t(32, 32, 4, 1)], [_t(64, 32, 4, 1)]),
    64: _row([_t(64, 32, 8, 1)], [_t(16, 64, 8, 1)], [_t(64, 32, 8, 1)]),
    128: _row([_t(32, 32, 8, 1)], [_t(16, 32, 8, 1)], [_t(32, 16, 4, 1)]),
    256: _row([_t(32, 16, 8, 1)], [_t(16, 16, 8, 1)], [_t(32, 16, 8, 1)]),
}

# Configs used under the interpreter: small tiles with BLOCK_M != BLOCK_N so the ragged and
# masked-block logic is exercised on short CPU test sequences.
INTERPRET_CONFIGS: dict[str, TileConfig] = {
    "fwd": _t(32, 16, 4, 1),
    "dkdv": _t(16, 32, 4, 1),
    "dq": _t(32, 16, 4, 1),
}


@dataclass(frozen=True)
class Device:
    """What the configs depend on of a CUDA device: its name (part of the tuning cache's key), its
    family and its shared memory per block (bytes)."""

    name: str
    family: str  # "hopper", "ampere" or "consumer"
    max_shared_mem: int

    def as_family(self, family: str | None) -> Device:
        """This device launching the configs of ``family`` within the smaller of the two shared
        memories (None: itself). Forcing "consumer" on an H100 runs what a ~100 KB card runs."""
        if family is None or family == self.family:
            return self
        if family not in FAMILY_SMEM:
            raise ValueError(f"unknown GPU family {family!r}; use one of {sorted(FAMILY_SMEM)}")
        return Device(self.name, family, min(self.max_shared_mem, FAMILY_SMEM[family]))


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def d_bucket(block_d: int) -> int:
    """The table row of a padded head dim: 16 shares the row of 32."""
    return max(block_d, 32)


def smem_estimate(kind: str, cfg: TileConfig, block_d: int, elem_bytes: int) -> int:
    """Conservative shared-memory estimate (bytes) of one program of ``kind`` with ``cfg``.

    Streamed tiles are multi-buffered ``num_stages`` deep; resident tiles and the P/dS tile that
    feeds the second matmul are counted once.
    """
    bm, bn, st = cfg.BLOCK_M, cfg.BLOCK_N, max(cfg.num_stages, 1)
    if kind == "fwd":  # q resident; k, v streamed
        tiles = bm * block_d + st * 2 * bn * block_d + bm * bn
    elif kind == "dkdv":  # k, v resident; q, do streamed (+ lse, delta)
        tiles = 2 * bn * block_d + st * 2 * bm * block_d + 2 * bm * bn
    elif kind == "dq":  # q, do resident; k, v streamed
        tiles = 2 * bm * block_d + st * 2 * bn * block_d + bm * bn
    else:
        raise ValueError(f"unknown kernel kind {kind!r}")
    return tiles * elem_bytes


def registers_ok(kind: str, cfg: TileConfig, block_d: int) -> bool:
    """Whether the fp32 accumulators alone stay within ~160 registers per thread."""
    threads = 32 * cfg.num_warps
    if kind == "dkdv":
        acc = 2 * cfg.BLOCK_N * block_d + cfg.BLOCK_M * cfg.BLOCK_N
    else:
        acc = cfg.BLOCK_M * block_d + cfg.BLOCK_M * cfg.BLOCK_N
    return acc // threads <= 160


def filter_configs(
    kind: str, configs: list[TileConfig], max_shared_mem: int, block_d: int, elem_bytes: int
) -> list[TileConfig]:
    """Configs of ``configs`` that fit ``max_shared_mem`` and :func:`registers_ok`, in order.

    Never empty: if nothing fits, the config with the smallest shared-memory estimate is kept.
    """
    kept = [c for c in configs
            if smem_estimate(kind, c, block_d, elem_bytes) <= max_shared_mem and registers_ok(kind, c, block_d)]
    return kept or [min(configs, key=lambda c: smem_estimate(kind, c, block_d, elem_bytes))]


def table_row(family: str, elem_bytes: int, block_d: int) -> dict[str, list[TileConfig]]:
    """The candidates per kernel kind of this family, element size and padded head dim."""
    if elem_bytes == 4:
        return FP32_CONFIGS[d_bucket(block_d)]
    return HALF_CONFIGS[(family, d_bucket(block_d))]


def shortlist(kind: str, device: Device, elem_bytes: int, block_d: int) -> list[TileConfig]:
    """The configs ``kind`` may launch on ``device`` with ``elem_bytes``-byte inputs and padded
    head dim ``block_d``, best first: one (launch it), or a few (time them once)."""
    row = table_row(device.family, elem_bytes, block_d)
    return filter_configs(kind, row[kind], device.max_shared_mem, block_d, elem_bytes)


def candidate_configs(kind: str, family: str) -> list[TileConfig]:
    """Every config ``kind`` may launch on ``family`` (any dtype, any head dim), in table order."""
    rows = [row for (fam, _), row in HALF_CONFIGS.items() if fam == family] + list(FP32_CONFIGS.values())
    seen: list[TileConfig] = []
    for row in rows:
        seen += [c for c in row[kind] if c not in seen]
    return seen


@functools.lru_cache(maxsize=None)
def describe_device(index: int) -> Device:
    """Name, family and shared memory per block of CUDA device ``index``."""
    import torch
    import triton

    major, minor = torch.cuda.get_device_capability(index)
    try:
        max_smem = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # pragma: no cover - very old/odd drivers
        max_smem = SMEM_CONSUMER
    if major >= 9:
        family = "hopper"
    elif (major, minor) == (8, 0):
        family = "ampere"
    else:
        family = "consumer"
    if max_smem < 120 * 1024:
        family = "consumer"
    return Device(torch.cuda.get_device_name(index), family, max_smem)

