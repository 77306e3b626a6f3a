"""Autotune configurations for the flash-attention kernels, and shared-memory pruning.

Three kernels are tuned: the forward (``fwd``), the backward dK/dV kernel (``dkdv``) and the
backward dQ kernel (``dq``). Each config sets two tile sizes (``BLOCK_M`` rows of queries,
``BLOCK_N`` rows of keys), ``num_warps`` and ``num_stages``.

* On a GPU the kernels are autotuned over a short list per architecture (Hopper, Ampere data
  centre, consumer Ampere/Ada) keyed on a bucket of the sequence length
  (``triton.next_power_of_2(T)``), the head dim, the causal/window/varlen flags and (automatically)
  the tensor dtypes. Configs whose estimated shared memory exceeds the device's
  ``max_shared_mem`` are pruned before tuning (``early_config_prune``), so a ~100 KB consumer card
  never compiles a config that cannot fit.
* Under ``TRITON_INTERPRET=1`` (CPU) Triton cannot time configs, so one small config is used.
* With ``LAUNCHER.autotune`` off (``launch.py``) tuning is skipped too and the first config that
  fits is launched (the GPU test matrix does so to keep compile time bounded).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import triton

# Shared-memory budgets (bytes) of the cards we care about; used by tests and docs.
SMEM_HOPPER = 227 * 1024  # H100 / H200 (opt-in maximum per block)
SMEM_AMPERE_DC = 163 * 1024  # A100
SMEM_CONSUMER = 99 * 1024  # RTX 30xx / 40xx (sm_86 / sm_89)
SMEM_TURING = 64 * 1024  # sm_75


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration: tile sizes plus Triton's warps and pipeline depth."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int

    def to_triton(self) -> triton.Config:
        return triton.Config(
            {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N},
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


def _t(bm: int, bn: int, w: int, s: int) -> TileConfig:
    return TileConfig(bm, bn, w, s)


# Candidate lists, most preferred first. The first config that fits the budget is the
# "default" used without autotuning. Every list ends with a tiny config that fits 64 KB even at
# D=256 in fp32, so pruning never leaves a list empty.
_TINY = _t(16, 16, 4, 1)

FWD_CONFIGS: dict[str, list[TileConfig]] = {
    "hopper": [
        _t(128, 64, 4, 3), _t(128, 128, 8, 3), _t(128, 64, 8, 3), _t(64, 64, 4, 3),
        _t(128, 32, 4, 3), _t(64, 32, 4, 2), _TINY,
    ],
    "ampere": [
        _t(128, 64, 4, 3), _t(128, 64, 8, 3), _t(64, 64, 4, 3), _t(128, 32, 4, 2),
        _t(64, 32, 4, 2), _TINY,
    ],
    "consumer": [
        _t(64, 64, 4, 2), _t(128, 32, 4, 2), _t(64, 32, 4, 2), _t(32, 32, 4, 2),
        _t(32, 16, 4, 1), _TINY,
    ],
}

# dK/dV: BLOCK_N key rows stay resident (k, v, dk, dv); BLOCK_M query rows stream through.
DKDV_CONFIGS: dict[str, list[TileConfig]] = {
    "hopper": [
        _t(32, 128, 4, 3), _t(64, 128, 8, 2), _t(32, 128, 8, 3), _t(64, 64, 4, 3),
        _t(32, 64, 4, 3), _t(16, 64, 4, 2), _t(64, 128, 8, 3), _TINY,
    ],
    "ampere": [
        _t(32, 128, 8, 2), _t(64, 64, 4, 2), _t(32, 64, 4, 3), _t(16, 64, 4, 2), _TINY,
    ],
    "consumer": [
        _t(32, 64, 4, 2), _t(16, 64, 4, 2), _t(32, 32, 4, 2), _t(16, 32, 4, 1), _TINY,
    ],
}

# dQ: BLOCK_M query rows stay resident (q, do, dq); BLOCK_N key rows stream through.
DQ_CONFIGS: dict[str, list[TileConfig]] = {
    "hopper": [
        _t(128, 32, 4, 3), _t(128, 64, 8, 2), _t(128, 64, 4, 3), _t(64, 64, 4, 3),
        _t(64, 32, 4, 3), _t(64, 16, 4, 2), _t(128, 64, 8, 3), _TINY,
    ],
    "ampere": [
        _t(128, 32, 8, 2), _t(64, 64, 4, 2), _t(64, 32, 4, 3), _t(64, 16, 4, 2), _TINY,
    ],
    "consumer": [
        _t(64, 32, 4, 2), _t(64, 16, 4, 2), _t(32, 32, 4, 2), _t(32, 16, 4, 1), _TINY,
    ],
}

_ALL = {"fwd": FWD_CONFIGS, "dkdv": DKDV_CONFIGS, "dq": DQ_CONFIGS}

# Configs used under the interpreter: small tiles with BLOCK_M != BLOCK_N so the ragged and
# masked-block logic is exercised on short CPU test sequences.
INTERPRET_CONFIGS: dict[str, TileConfig] = {
    "fwd": _t(32, 16, 4, 1),
    "dkdv": _t(16, 32, 4, 1),
    "dq": _t(32, 16, 4, 1),
}


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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


def _register_ok(kind: str, cfg: TileConfig, block_d: int) -> bool:
    """Drop configs whose fp32 accumulators alone would exceed ~128 registers per thread."""
    threads = 32 * cfg.num_warps
    if kind == "fwd":
        acc = cfg.BLOCK_M * block_d + cfg.BLOCK_M * cfg.BLOCK_N
    elif kind == "dkdv":
        acc = 2 * cfg.BLOCK_N * block_d + cfg.BLOCK_M * cfg.BLOCK_N
    else:
        acc = cfg.BLOCK_M * block_d + cfg.BLOCK_M * cfg.BLOCK_N
    return acc // threads <= 160


def filter_configs(
    kind: str, configs: list[TileConfig], max_shared_mem: int, block_d: int, elem_bytes: int
) -> list[TileConfig]:
    """Configs of ``configs`` that fit ``max_shared_mem`` (and a register heuristic).

    Never empty: if nothing fits, the smallest config is kept (it fits 64 KB at D=256, fp32).
    """
    kept = [
        c
        for c in configs
        if smem_estimate(kind, c, block_d, elem_bytes) <= max_shared_mem
        and (_register_ok(kind, c, block_d) or c == _TINY)
    ]
    if not kept:
        kept = [min(configs, key=lambda c: smem_estimate(kind, c, block_d, elem_bytes))]
    return kept


@functools.lru_cache(maxsize=None)
def device_info(device_index: int) -> tuple[str, int]:
    """(architecture family, max shared memory per block in bytes) of a CUDA device."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        max_smem = int(props["max_shared_mem"])
    except Exception:  # pragma: no cover - very old/odd drivers
        max_smem = SMEM_CONSUMER
    if major >= 9:
        family = "hopper"
    elif (major, minor) == (8, 0):
        family = "ampere"
    else:
        family = "consumer"
    if max_smem < 120 * 1024 and family != "consumer":
        family = "consumer"
    return family, max_smem


def candidate_configs(kind: str, family: str) -> list[TileConfig]:
    return list(_ALL[kind][family])


def triton_configs(kind: str) -> list[triton.Config]:
    """Union of all families' configs for ``kind`` (pruned per launch by :func:`make_pruner`)."""
    seen: list[TileConfig] = []
    for fam in ("hopper", "ampere", "consumer"):
        for c in _ALL[kind][fam]:
            if c not in seen:
                seen.append(c)
    return [c.to_triton() for c in seen]


def make_pruner(kind: str):
    """``early_config_prune`` hook: keep this device family's configs that fit its shared memory."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        block_d = int(args["BLOCK_D"])
        elem_bytes = args["Q"].element_size()
        family, max_smem = device_info(args["Q"].device.index or 0)
        wanted = filter_configs(
            kind, candidate_configs(kind, family), max_smem, block_d, elem_bytes
        )
        keep = []
        for cfg in configs:
            tc = TileConfig(cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps,
                            cfg.num_stages)
            if tc in wanted:
                keep.append(cfg)
        return keep or configs[-1:]

    return prune


def default_config(kind: str, device, block_d: int, elem_bytes: int) -> TileConfig:
    """The config launched without autotuning (interpreter, or ``LAUNCHER.autotune`` off)."""
    if is_interpreter() or device.type != "cuda":
        return INTERPRET_CONFIGS[kind]
    family, max_smem = device_info(device.index or 0)
    return filter_configs(kind, candidate_configs(kind, family), max_smem, block_d, elem_bytes)[0]
