"""The flash-decoding kernels' launch settings, from the shapes and the GPU only.

``decode_config`` picks how many programs share one sequence's cache (the splits) and the split
kernel's keys per step, warps and pipeline stages. Nothing depends on the sequences' lengths, which
live on the device, so one captured CUDA graph replays at every length.

**Programs per SM.** A decode step reads the cache once, so it lasts as long as the HBM takes to
deliver it, and the HBM delivers at its full rate only while enough loads are in flight. A program
keeps ``num_stages - 1`` tiles of K and V in flight ahead of the one it computes on; an SM needs
about ``IN_FLIGHT_S`` of its share of the HBM's bandwidth (bandwidth * IN_FLIGHT_S / SMs bytes) in
flight, so it gets ``per_sm`` = that many bytes over one program's, rounded up, at most as many as its
shared memory holds and ``MOST_PER_SM``. More than that queues loads behind each other and reads
slower: on an H100 (2026-11-26, docs/runs/2026-11-26-decode-6) a 64k GQA cache (8 KV heads of 128) at
batch 8 took 677.6 µs at one program per SM against 698.1 at two (cuDNN 697.7), and GPT-2's heads at
batch 2 133.9 µs at two against 137.5 at three. The H200's HBM is 1.4x faster for the same SMs, and
there two programs per SM read that GQA cache faster than one (474.7 µs against 521.7).

**Splits.** The B * H_kv (sequence, KV head) pairs are split so that there are per_sm programs per SM:
splits = per_sm * SMs // pairs, each split at least one step of keys, at most ``MAX_SPLITS``. Where that
leaves SMs with fewer programs than others (the programs over SMs * the waves they take under
``BALANCED``, as GPT-2's 12 heads at batch 8: 2 splits make 192 programs for 132 SMs), per_sm grows until
they even out (4 splits, 384 programs: 137.8 µs against 142.3 at a 16k cache).

**One wide program per SM.** At 64 < D <= 128, where the pairs fill the SMs in one wave of one program
each (at least ``BALANCED`` of them, at most one per SM) and one program of ``LONG_BLOCK_N``-key steps in
``NUM_STAGES`` stages keeps an SM's share in flight: one split, ``LONG_BLOCK_N`` keys per step, ``NUM_WARPS``
warps. On an H200 (2026-11-28, docs/runs/2026-11-28-decode-warps) 8 KV heads of 128 at batch 16 (128 pairs)
read a 4k cache in 62.7 µs against 65.0 in two splits of 64-key steps (cuDNN 62.2-62.5), a 64k one in 927.5
against 941.3 (cuDNN 921.6); at batch 15 59.0 against 61.4 (cuDNN 58.9). Two warps on 128-key steps
were 1.3-1.7x slower.

**Tiles.** ``BLOCK_N`` keys per step (``WIDE_BLOCK_N`` past D = 128), ``NUM_WARPS`` warps
(``NARROW_WARPS`` where 64 < D <= 128), ``NUM_STAGES`` stages. At D = 128 two warps share a step's
matmuls and row reductions with less exchange between warps than four: on an H200 (2026-11-28,
docs/runs/2026-11-28-decode-warps, two rounds) 1.00-1.07x the speed of four warps at batches 2-4 and caches of
4k-16k (8 KV heads of 128 at batch 2, 4k: 13.05 µs against 14.0), 0.98-1.06x at batch 1, 0.995-1.013x from
batch 8 and 0.996-1.007x at 64k; at D = 64 two warps were 1-3 % slower. Where an SM gets more programs than
the bandwidth asks for (the batch or the balance asked for them) at D <= 64, ``LONG_BLOCK_N`` keys in two stages,
where they fit, keep the same bytes in flight in half as many steps: on an H100, where two programs per SM are
enough, GPT-2's heads at batch 32 read a 16k cache in 532.7 µs against 538.2 in 64-key steps (cuDNN 531.4). On an
H200, where three are needed, the three-stage pipeline of 64-key steps was faster at every batch (batch 32, 16k:
350.5 µs against 359.1, cuDNN 350.8; docs/runs/2026-11-26-decode-6).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..gpu import gpu_resources

IN_FLIGHT_S = 2.4e-6  # seconds of an SM's share of the HBM's bandwidth kept in flight (module docstring)
MOST_PER_SM = 3
MAX_SPLITS = 128
BALANCED = 0.9  # programs / (SMs * waves) at least
BLOCK_N, LONG_BLOCK_N, WIDE_BLOCK_N = 64, 128, 32  # keys per step: D <= 128; D <= 64 past the programs needed; past 128
NUM_WARPS, NARROW_WARPS = 4, 2  # warps: D <= 64 and past 128; 64 < D <= 128
NUM_STAGES, LONG_STAGES = 3, 2


class DecodeConfig(NamedTuple):
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(batch: int, kv_heads: int, capacity: int, head_dim: int, elem_bytes: int, device: torch.device,
                  num_splits: int | None = None) -> DecodeConfig:
    """The launch of ``batch`` sequences of ``kv_heads`` KV heads of ``head_dim``, ``elem_bytes`` each, in a
    cache of ``capacity`` rows on ``device``; ``num_splits`` given: that many splits, at the default tiles.
    On a CPU (the interpreter): one split."""
    block_n = BLOCK_N if head_dim <= 128 else WIDE_BLOCK_N
    warps = NARROW_WARPS if 64 < head_dim <= 128 else NUM_WARPS
    config = DecodeConfig(num_splits or 1, block_n, warps, NUM_STAGES)
    if num_splits is not None or device.type != "cuda":
        return config
    gpu = gpu_resources(device)
    tile_bytes = 2 * block_n * _next_power_of_2(head_dim) * elem_bytes  # a step's K and V
    fits = max(1, min(MOST_PER_SM, gpu.smem // (NUM_STAGES * tile_bytes)))
    share = gpu.hbm_bytes_per_s * IN_FLIGHT_S / gpu.sms
    needed = min(fits, max(1, math.ceil(share / ((NUM_STAGES - 1) * tile_bytes))))  # programs per SM for the HBM
    pairs = batch * kv_heads
    wide_tile_bytes = tile_bytes * LONG_BLOCK_N // block_n
    if (64 < head_dim <= 128 and pairs <= gpu.sms and _balance(pairs, gpu.sms) >= BALANCED
            and (NUM_STAGES - 1) * wide_tile_bytes >= share and NUM_STAGES * wide_tile_bytes <= gpu.smem
            and LONG_BLOCK_N <= capacity):
        return DecodeConfig(1, LONG_BLOCK_N, NUM_WARPS, NUM_STAGES)
    per_sm = needed
    splits = _splits(per_sm, gpu.sms, pairs, capacity, block_n)
    while per_sm < fits and splits < -(-capacity // block_n) and _balance(splits * pairs, gpu.sms) < BALANCED:
        per_sm += 1
        splits = _splits(per_sm, gpu.sms, pairs, capacity, block_n)
    resident = min(-(-splits * pairs // gpu.sms), MOST_PER_SM)  # programs an SM holds at once
    long_program_bytes = LONG_STAGES * tile_bytes * LONG_BLOCK_N // block_n
    if (head_dim <= 64 and splits * pairs > needed * gpu.sms and splits * LONG_BLOCK_N <= capacity
            and resident * long_program_bytes <= gpu.smem):
        return DecodeConfig(splits, LONG_BLOCK_N, NUM_WARPS, LONG_STAGES)
    return config._replace(num_splits=splits)


def _splits(per_sm: int, sms: int, pairs: int, capacity: int, block_n: int) -> int:
    """Splits that give ``per_sm`` programs per SM, at least one step of keys each, at most MAX_SPLITS."""
    return max(1, min(per_sm * sms // pairs, -(-capacity // block_n), MAX_SPLITS))


def _balance(programs: int, sms: int) -> float:
    """How evenly ``programs`` share the SMs: their number over SMs times the waves they take."""
    return programs / (sms * -(-programs // sms))


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
