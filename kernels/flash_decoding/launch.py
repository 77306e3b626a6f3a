"""The flash-decoding kernels' launch settings, from the shapes and the GPU only.

``decode_config`` picks how many programs share one sequence's cache (the splits) and the split
kernel's keys per step, warps and pipeline stages. Nothing depends on the sequences' lengths, which
live on the device, so one captured CUDA graph replays at every length.

**Splits.** A decode step reads the cache once and lasts as long as its busiest SM. The B * H_kv
(sequence, KV head) pairs are split so that every SM gets ``per_sm`` programs at once: as many as
its shared memory holds at the tiles below, at most ``MOST_PER_SM`` (3 at D = 64 on an H100/H200, 2
at D = 128, 2 on a ~100 KB consumer card), splits = (per_sm * SMs) // pairs. Each split takes at
least one ``block_n`` of the capacity, and there are at most ``MAX_SPLITS``. On an H200
(scripts/bench_decode.py's sweeps, 2026-11-26): GPT-2's 12 heads at batch 4 split 8 ways (384
programs) read a 32k cache in 95.7 µs against 99.8 at 5 ways of 128-key tiles (one wave of two
programs per SM) and cuDNN's 96.9; at batch 16, 2 ways (384) against 4 (768), 357 µs against 406; at
batch 2, 16 ways, 51.2 µs against 52.5 at 11. One sequence (batch 1) gets at most
``ONE_SEQUENCE_PER_SM`` (2) programs per SM: GPT-2's 12 heads split 22 ways read 16k / 32k / 64k caches
in 22.0 / 38.9 / 71.1 µs against 22.6 / 40.5 / 74.7 at 33 ways on an H100, in two calls; on an H200,
in one call, 15.8 / 30.3 / 52.9 against 17.1 / 29.7 / 52.2 (docs/runs/2026-11-26-decode-5).

**Tiles.** ``BLOCK_N`` keys per step (``WIDE_BLOCK_N`` past D = 128), ``NUM_WARPS`` warps,
``NUM_STAGES`` stages of K and V tiles in flight. Neither a fourth stage nor 128-key tiles paid
where the programs fill the SMs (batch 32, 32k: 728 µs at 4 stages against 702 at 3; batch 8, 32k:
220 µs at 128 keys against 193).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

MOST_PER_SM = 3  # programs per SM at most: enough loads in flight to keep its share of the HBM busy
ONE_SEQUENCE_PER_SM = 2  # at batch 1 (module docstring)
MAX_SPLITS = 128
BLOCK_N, WIDE_BLOCK_N = 64, 32  # keys per step for D <= 128, and past it
NUM_WARPS = 4
NUM_STAGES = 3


class DecodeConfig(NamedTuple):
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def gpu_resources(device: torch.device) -> tuple[int, int]:
    """(SMs, shared memory per program in bytes) of CUDA ``device``."""
    import triton

    index = device.index if device.index is not None else torch.cuda.current_device()
    smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return torch.cuda.get_device_properties(index).multi_processor_count, int(smem)


def decode_config(batch: int, kv_heads: int, capacity: int, head_dim: int, elem_bytes: int, device: torch.device,
                  num_splits: int | None = None) -> DecodeConfig:
    """The launch of ``batch`` sequences of ``kv_heads`` KV heads of ``head_dim``, ``elem_bytes`` each, in a
    cache of ``capacity`` rows on ``device``; ``num_splits`` given: that many splits. On a CPU (the
    interpreter): one split."""
    block_n = BLOCK_N if head_dim <= 128 else WIDE_BLOCK_N
    if num_splits is None and device.type == "cuda":
        sms, smem = gpu_resources(device)
        program_bytes = NUM_STAGES * 2 * block_n * _next_power_of_2(head_dim) * elem_bytes  # K and V tiles in flight
        per_sm = max(1, min(MOST_PER_SM if batch > 1 else ONE_SEQUENCE_PER_SM, smem // program_bytes))
        most = min(-(-capacity // block_n), MAX_SPLITS)
        num_splits = max(1, min(per_sm * sms // (batch * kv_heads), most))
    return DecodeConfig(num_splits or 1, block_n, NUM_WARPS, NUM_STAGES)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
