"""The flash-decoding kernels' launch settings, from the shapes and the GPU only.

``decode_config`` picks how many programs share one sequence's cache (the splits) and the split
kernel's keys per step, warps and pipeline stages. Nothing depends on the sequences' lengths, which
live on the device, so one captured CUDA graph replays at every length.

**Splits.** A decode step reads the cache once and lasts as long as its busiest SM, so the programs
come in waves of ``RESIDENT`` per SM, as full as can be. B * H_kv (sequence, KV head) pairs that
fill ``FULL`` of a wave alone are not split. Otherwise, among the split counts from the fewest
whose programs fill ``FILL`` of a wave to twice as many, and that keep at most ``MOST_PER_SM``
programs per SM, the one whose last wave is fullest wins (then the fewer splits): GPT-2's 12 heads
at batch 1 split 22 ways on 132 SMs (264 programs, one full wave), a GQA batch of 64 pairs 4 ways
(256), not 5 (320: a second wave a fifth full); GPT-2 at batch 16 (192 pairs) 2 ways (384), not 4
(768, fuller waves: 11 % slower at a 32k cache on an H200, scripts/bench_decode.py's sweep, 2026-11-26).
Each split takes at least one ``block_n`` of the capacity, and there are at most ``MAX_SPLITS``.

**Tiles.** ``BLOCK_N`` keys per step (``WIDE_BLOCK_N`` past D = 128), ``NUM_WARPS`` warps,
``NUM_STAGES`` stages of K and V tiles in flight; ``LONG_BLOCK_N`` keys per step where each split
streams at least ``LONG_SPLIT`` keys of the capacity, the programs fit one wave of ``RESIDENT`` per SM,
and ``RESIDENT`` programs of those tiles still fit an SM's shared memory (at D = 64 in 16-bit types on
an H100/H200; not at D = 128, nor on a ~100 KB consumer card). On an H200 (scripts/bench_decode.py's
sweep, 2026-11-26): GPT-2 at batch 4 (5 splits), 15.2 µs at a 4k cache against 17.4 with 64 keys at 4
stages (the pick before) and 16.9 at 3; past one wave 128 keys cost (batch 8, 32k: 220 µs against
193), and so does a fourth stage (batch 32, 32k: 728 µs against 702 at 3).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

RESIDENT = 2  # programs per SM the splits aim for: enough loads in flight to keep its share of the HBM busy
FULL = 0.8  # the share of a wave of RESIDENT programs per SM that B * H_kv fills alone: no split
FILL = 0.9  # the least share of a wave the splits must fill
MOST_PER_SM = 3  # programs per SM the splits may make at most
MAX_SPLITS = 128
BLOCK_N, WIDE_BLOCK_N = 64, 32  # keys per step for D <= 128, and past it
NUM_WARPS = 4
NUM_STAGES = 3
LONG_BLOCK_N = 128  # keys per step where the splits are long and fit one wave
LONG_SPLIT = 512  # keys of the capacity per split from which they are long


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
    cache of ``capacity`` rows on ``device``; ``num_splits`` given: that many splits, the tiles chosen for it.
    On a CPU (the interpreter): one split, the plain tiles."""
    block_n = BLOCK_N if head_dim <= 128 else WIDE_BLOCK_N
    if device.type != "cuda":
        return DecodeConfig(num_splits or 1, block_n, NUM_WARPS, NUM_STAGES)
    sms, smem = gpu_resources(device)
    splits = num_splits or split_count(batch * kv_heads, sms, -(-capacity // block_n))
    long_stage_bytes = 2 * LONG_BLOCK_N * _next_power_of_2(head_dim) * elem_bytes  # one K and one V tile
    one_wave = batch * kv_heads * splits <= RESIDENT * sms
    long = one_wave and capacity >= LONG_SPLIT * splits and RESIDENT * NUM_STAGES * long_stage_bytes <= smem
    return DecodeConfig(splits, LONG_BLOCK_N if long else block_n, NUM_WARPS, NUM_STAGES)


def split_count(pairs: int, sms: int, most: int) -> int:
    """Splits of each of ``pairs`` (sequence, KV head) pairs on ``sms`` SMs, at most ``most`` (one step
    of keys each) and ``MAX_SPLITS``."""
    slots = RESIDENT * sms
    most = max(1, min(most, MAX_SPLITS))
    if pairs >= FULL * slots:
        return 1
    least = -(-int(FILL * slots) // pairs)
    if least >= most:
        return most
    within = max(1, MOST_PER_SM * sms // pairs)  # the most splits that keep MOST_PER_SM programs per SM
    if within <= least:
        return min(within, most)
    return max(range(least, min(2 * least, most, within) + 1), key=lambda s: (wave_fill(pairs * s, slots), -s))


def wave_fill(programs: int, slots: int) -> float:
    """How full the waves of ``slots`` programs are on average, the last one counted whole: 1.0 when
    ``programs`` is a multiple of ``slots``."""
    waves = -(-programs // slots)
    return programs / (waves * slots)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
