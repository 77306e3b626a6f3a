"""Flash attention for Hopper (sm90) in Gluon: TMA loads, asynchronous wgmma, base-2 online softmax.

**Forward.** Warp-specialised, over tiles of 2 * ``FWD_HALF_M`` = 128 query rows of one (batch, query
head), taken in pairs: query blocks n_m - 1 - i, then i, so that under the causal mask every pair meets
the same n_m + 1 key blocks. Where a pair's key blocks times D are at most ``FWD_PERSISTENT_MAX_WORK``,
one program per SM takes pairs p, p + programs, ... (such a pair is too short to pay for a program's start
and end); otherwise a program takes the pairs of its ``FWD_HEADS`` heads (one where fewer programs would not fill
``FWD_MIN_WAVES`` waves of the SMs) and the GPU hands programs to SMs as they free. Three partitions:
a producer warp that loads both halves' Q tiles (two slots a half, taken by the tiles in turn) and then K_j and V_j of
every key block into two rings of ``FWD_STAGES`` shared-memory slots (TMA, one "ready" mbarrier per
slot), going on to the next tile's Q, K and V while the consumers finish a tile (a Q slot is refilled
once the tile two before stored its O through it); and two consumer
warpgroups of 64 rows each (the default partition and one worker, 240 registers each; the producer
24). Per key block j each consumer runs FlashAttention-3's overlap within a warpgroup:

    issue S_j = Q K_j^T             wgmma, both operands in shared memory, fp32 accumulator
    O = O * alpha_{j-1}             (no wgmma writes O now)
    issue O += P_{j-1} V_{j-1}      wgmma, P from registers (its dot-operand layout)
    wait for S_j, release K_j's slot (wgmma groups finish in order; O's keeps running)
    softmax of S_j: m_j = max(m_{j-1}, rowmax S_j * scale * log2 e), alpha_j = exp2(m_{j-1} - m_j),
                    P_j = exp2(S_j * scale * log2 e - m_j), l = l * alpha_j + rowsum P_j
                    (the causal and sequence-end masks only on blocks that reach them)
    wait for O's wgmma, release V_{j-1}'s slot

A slot's "empty" mbarrier counts both consumers' releases before the producer refills it. The two
consumers run unsynchronised, so one's softmax overlaps the other's matmuls (on an H100 1.2-1.3x the
first version, which ran both warpgroups in step behind a CTA barrier per block; an explicit
ping-pong of the two and a third ring slot measured no faster: docs/KERNEL.md). At the end O / l and
lse = (m + log2 l) * ln 2 (natural log, as the ``tl`` kernel writes it). O goes out by TMA through the
warpgroup's Q slot (free once its last S_j is done) where its 64 rows lie inside the sequence, by masked
stores where they do not (rows past T belong to the next sequence): 1.03-1.18x masked stores at
(8,16,2048,128) and (16,16,1024,128) on an H100. The second Q slot a half (the next tile's Q loaded
ahead, where the one slot was refilled only after the O store) made it 1.04-1.07x at (16,16,1024,128),
0.98-1.05x at (8,16,2048,128), 1.00-1.06x from T = 4096 and 1.02-1.04x at D = 64. Taking the tiles in
pairs made the forward 0.99-1.13x one tile a program at D = 128 and 1.06-1.17x at D = 64; a
persistent grid of one program per SM taking every SM-count-th tile was 0.73-0.99x, its programs'
causal work unequal (docs/KERNEL.md).

Where the persistent pairs cannot fill the SMs (their count is not near a multiple of the SMs': 288 pairs over
132 programs at (12,6,1024,128) keep them 73 % busy; ``FWD_STATIC_FILL``), a second kernel hands out single
tiles as programs free, as FlashAttention-3's scheduler does: an atomic counter, tiles ordered longest first
within sections of heads whose K and V fit ``FWD_SECTION_BYTES`` of L2 (:func:`_fwd_listed_tile`). On an H100
1.08-1.16x the static pairs at (12,6,1024,128) and 1.04-1.12x at (12,12,1024,64); where the pairs fill 97 % it
was 0.89-0.99x, so those keep them (docs/KERNEL.md). The counters are one pair per stream, left at zero by each
launch, and a fresh pair per launch a CUDA graph captures (:func:`tile_counter`).

**Backward.** A warp-specialised kernel over key blocks: one program per 2 * ``BWD_HALF_N`` = 128 keys of
one (batch, KV head), a producer warp that loads the block's K and both halves' V once and then Q and dO of
every (query head, ``BWD_BLOCK_M``-row query block) step into a ring of ``BWD_STAGES`` slots, beside the
step's lse * log2 e and delta (its lanes load them and store them into the slot's shared memory), and two
consumer warpgroups of 64 keys each. Keys are the rows of every matmul, so dK and dV stay in registers:

    issue S^T = K Q^T, wait             wgmma, operands in shared memory
    P^T = exp2(S^T * scale * log2 e - lse * log2 e)   (masked where the diagonal or the end crosses)
    issue dP^T = V dO^T and dV += P^T dO   P^T from registers
    wait for dP^T: dS^T = P^T (dP^T - delta)
    issue dK += dS^T Q, wait for both, release the slot

(dP^T issued with S^T instead keeps both score tiles live at once: 396 bytes of spills at D = 128
and 1-5 % slower.) Under the causal mask each head's first step has every query before the second
warpgroup's keys: that warpgroup skips its four matmuls there (P = dS = 0; dk and dv bit-identical) and,
with dQ, shares a zero dS^T; the step's code in two branches also left the dQ kernel 8 bytes of spills
where it had 120 (triton 3.6). On an H100 1.03-1.08x the backward with dQ at D = 128 (docs/KERNEL.md).

The GPU starts programs in grid order. With dQ in the kernel (below) the grid takes the (batch, KV head)s in
sections whose Q, dO and dQ fit ``BWD_SECTION_BYTES`` of L2, each section's key blocks in order and its heads
fastest, so that under the causal mask every head's longest key blocks start before any head's shorter ones
(key blocks fastest, the last head's longest blocks started late and set the end): on an H100 forward +
backward 1.01-1.07x at D = 128 from T = 2048 to 8192, 1.03-1.07x at D = 64 at T = 4096 and 8192 (docs/KERNEL.md).

dQ comes one of two ways (``attn_bwd_sm90``'s ``dq_in_dkdv``):
- T < ``DQ_IN_DKDV_FROM_T[D]``: the ``tl`` dQ kernel (backward.py; it also writes delta = rowsum(dO * O)) runs
  first, recomputing S and dP: seven matmuls, deterministic.
- From there on, FlashAttention-3's five matmuls: both warpgroups write their dS^T into shared memory (dK's
  own dS^T operand comes from registers at D = 64, ``DS_IN_REGISTERS_MAX_D``), each computes half of D of the
  step's dQ = dS K over all 128 keys, stores it to shared memory and adds it into
  an fp32 sum with TMA's reduce-add (``cp.reduce.async.bulk.tensor``; triton 3.6-3.7's Gluon builds the op
  without naming it, 3.8 names it ``tma.async_atomic_add``). Two small kernels around it write delta and
  scale and cast dQ. The adds' order varies, so dq may differ in its last bit from run to run. On an H100
  (causal, D = 128) this is 1.08-1.12x the other way at T = 8192 and 16384, 1.07-1.09x at 4096, 0.96-1.03x
  at 2048 (three of four rounds above 1) and 0.91-0.93x at 1024 (docs/KERNEL.md); scalar fp32 atomics in
  place of the reduce-add were 4-5x slower.

Queuing the next step's score matmuls behind dV and dK, 32-row query steps and a third ring slot
measured no faster (docs/KERNEL.md).

The descriptors read q, k, v (B, T, H|H_kv, D) as 2-D (B * T, H * D), rows a token apart (:func:`tma_row`;
a packed qkv in place): a tile is rows [b * T + start, + BLOCK) and columns [head * D, + D). Rows past T belong to the next sequence (or
lie past the tensor, where TMA fills zeros); the sequence-end mask drops those keys and the stores
skip those query rows. GQA: query head h reads KV head h // (H / H_kv).

Causal and full attention, bf16/fp16, head dims 64 and 128. No window, packed documents, dropout or
gate: those calls run on the ``tl`` kernel (forward.py).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .launch import Replay

LOG2E = 1.4426950408889634
FWD_HALF_M, FWD_BLOCK_N, FWD_STAGES = 64, 128, 2  # forward: each consumer's query rows, keys per block, ring slots
FWD_HEADS, FWD_MIN_WAVES = 2, 3  # forward: heads a program takes two query blocks of; SM waves they must leave
# forward: one program per SM where a pair of tiles meets at most this many key blocks times D: causal T <= 4096 at
# D = 64 (1.04-1.08x), T <= 2048 at D = 128 (1.02-1.05x); full attention half those (docs/KERNEL.md)
FWD_PERSISTENT_MAX_WORK = 36 * 64
# there, the least share of the SMs' time that the static pairs keep busy: below, tiles go out as programs free
# (docs/KERNEL.md: 73 % at (12,6,1024,128), dynamic 1.08-1.16x; 97 % at the anchors, dynamic 0.89-0.99x)
FWD_STATIC_FILL = 0.9
FWD_SECTION_BYTES = 32 << 20  # forward, dynamic: K and V bytes of a section of heads (_fwd_listed_tile)
TILE_COUNTERS = {}  # (device index, stream) -> the forward's two int32 counters (tile_counter)
BWD_HALF_N, BWD_BLOCK_M, BWD_STAGES = 64, 64, 2  # dK/dV: each consumer's keys, query rows per step, ring slots
BWD_SECTION_BYTES = 16 << 20  # dK/dV grid: Q, dO and dQ bytes of a section of (batch, KV head)s; the H100's L2: 50 MB
ROWS_BLOCK = 64  # (token, head) rows per program of the backward's delta and dQ-out kernels
WS_MAXNREG = 168  # 12 warps (3 warpgroups) at 168 registers fill the register file: 240 + 240 + 24 a warpgroup
# where attention.kernel=auto runs these kernels: head dim -> least T. At D = 64 they are faster in GPU time from
# T = 2048, but below 4096 a small eager call waits on their host path (0.3-0.6 ms more a call; docs/KERNEL.md)
AUTO_FROM_T = {64: 4096, 128: 0}
# head dim -> the T from which the dK/dV kernel adds dQ itself; below, the tl dQ kernel is faster (docs/KERNEL.md)
DQ_IN_DKDV_FROM_T = {64: 4096, 128: 2048}
HEAD_DIMS = tuple(AUTO_FROM_T)  # the head dims these kernels take: each has both rules above
# with dQ, up to this D dK's dS operand comes from registers (1.03-1.08x at D = 64; at D = 128 60 bytes of spills
# and slower, so there it is read from the dS shared with the other warpgroup)
DS_IN_REGISTERS_MAX_D = gl.constexpr(64)
# Gluon's TMA load moved between releases (async_copy_global_to_shared until 3.8, removed in 3.9).
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
# and its barrier of a partition's threads (thread_barrier in 3.6, barrier from 3.7).
partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@builtin
def _tma_add_36(tensor_desc, coord, src, _semantic=None):
    """TMA's reduce-add of a shared-memory tile into global memory (``cp.reduce.async.bulk.tensor ... add``) for
    triton 3.6-3.7, whose Gluon builder has the op but whose ``tma`` module does not name it."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# Gluon names TMA's reduce-add from triton 3.8 (tma.async_atomic_add).
tma_add = tma.async_atomic_add if hasattr(tma, "async_atomic_add") else _tma_add_36


@gluon.jit
def _softmax_block(s, m_i, l_i, offs_m, n_start, offs_n, T, qk_scale, mask_from, IS_CAUSAL: gl.constexpr,
                   BLOCK_N: gl.constexpr):
    """One key block's online-softmax step on the raw scores s of keys offs_n = n_start + [0, BLOCK_N):
    (p, m, l, alpha); masks only where the block reaches key mask_from (the causal diagonal or the
    sequence's end)."""
    if n_start + BLOCK_N > mask_from:
        keep = offs_n[None, :] < T
        if IS_CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _fwd_pair_tile(k, sched, IS_CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr):
    """The static schedule's k-th tile of the program (k < 2 * PAIRS): of its pair k // 2, pair number
    program_id(0) + (program_id(1) * PAIRS + k // 2) * STRIDE of the (batch, query head)-major list of every
    head's (n_m + 1) // 2 pairs, the query block n_m - 1 - i for even k, i for odd k (i: the pair's place in its
    head), so that every pair meets n_m + 1 key blocks under the causal mask. Returns (whether the tile exists,
    then :func:`_fwd_coords`)."""
    n_m, n_bh, PAIRS, STRIDE = sched[0], sched[1], sched[5], sched[6]
    n_pairs = (n_m + 1) // 2
    item = gl.program_id(0) + (gl.program_id(1) * PAIRS + k // 2) * STRIDE
    pair = item % n_pairs
    pid_bh = item // n_pairs
    block = gl.where(k % 2 == 1, pair, n_m - 1 - pair)
    exists = (pid_bh < n_bh) & ((k % 2 == 0) | (block != n_m - 1 - pair))
    return exists, _fwd_coords(pid_bh, block * ROWS, sched, IS_CAUSAL, ROWS, BLOCK_N, HEAD_DIM)


@gluon.jit
def _fwd_listed_tile(tile, sched, IS_CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr):
    """Tile ``tile`` of the dynamic schedule's list: sections of SECTION (batch, query head)s in turn (the last
    may be smaller); within a section the query blocks from the last to the first (under the causal mask, from
    the most key blocks to the fewest), the section's heads fastest (:func:`_fwd_coords`)."""
    n_m, n_bh, SECTION = sched[0], sched[1], sched[5]
    first_bh = (tile // (SECTION * n_m)) * SECTION
    heads = gl.minimum(SECTION, n_bh - first_bh)
    place = tile % (SECTION * n_m)
    return _fwd_coords(first_bh + place % heads, (n_m - 1 - place // heads) * ROWS, sched, IS_CAUSAL, ROWS, BLOCK_N,
                       HEAD_DIM)


@gluon.jit
def _fwd_coords(pid_bh, q_start, sched, IS_CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr):
    """(first row of the sequence in the 2-D views, first query, head, its KV head's column, key blocks) of the
    tile of ROWS queries from q_start of (batch, query head) pid_bh."""
    T, H, GROUP = sched[2], sched[3], sched[4]
    head = pid_bh % H
    if IS_CAUSAL:
        n_blocks = gl.cdiv(gl.minimum(T, q_start + ROWS), BLOCK_N)
    else:
        n_blocks = gl.cdiv(T, BLOCK_N)
    return (pid_bh // H) * T, q_start, head, (head // GROUP) * HEAD_DIM, n_blocks


@gluon.jit
def _lane0_atomic_add(ptr, sem: gl.constexpr):
    """Adds 1 to the int32 at ptr from lane 0 of the calling warp, with memory ordering ``sem``; returns the
    value before in lane 0 of a (32,) tensor (:func:`_lane0`)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    return gl.atomic_add(ptr + lane * 0, gl.full([32], 1, gl.int32, layout), mask=lane == 0, sem=sem)


@gluon.jit
def _lane0(values):
    """Lane 0's element of a (32,) tensor over one warp, in every lane."""
    lane = gl.arange(0, 32, layout=values.type.layout)
    return gl.max(gl.where(lane == 0, values, 0), axis=0)


@gluon.jit
def _fwd_load_q(descs, bufs, bars, coords, tile_it, half: gl.constexpr):
    """The producer: the tile's Q rows of consumer ``half`` into its slot of the tile's parity (free)."""
    q_desc = descs[0]
    q_ready = bars[0]
    row0, q_start, head = coords[0], coords[1], coords[2]
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    q_slot = 2 * (tile_it % 2) + half
    mbarrier.expect(q_ready.index(q_slot), q_desc.block_type.nbytes)
    tma_load(q_desc, [row0 + q_start + half * HALF_M, head * HEAD_DIM], q_ready.index(q_slot),
             bufs[0].index(q_slot))


@gluon.jit
def _fwd_wait_q_free(bars, tile_it, half: gl.constexpr):
    """The producer: until consumer ``half`` is done with the tile two before (a fresh mbarrier passes a wait
    for phase 1)."""
    mbarrier.wait(bars[1].index(2 * (tile_it % 2) + half), ((tile_it // 2) & 1) ^ 1)


@gluon.jit
def _fwd_load_kv(descs, bufs, bars, coords, kv_it):
    """The producer: K_j and V_j of every key block of the tile into their rings, each slot refilled once both
    consumers have released it."""
    k_desc, v_desc = descs[1], descs[2]
    k_smem, v_smem = bufs[1], bufs[2]
    k_ready, k_empty, v_ready, v_empty = bars[2], bars[3], bars[4], bars[5]
    row0, kv_col, n_blocks = coords[0], coords[3], coords[4]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    for j in range(n_blocks):
        slot = (kv_it + j) % STAGES
        free = (((kv_it + j) // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [row0 + j * BLOCK_N, kv_col], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [row0 + j * BLOCK_N, kv_col], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _fwd_load(descs, bufs, bars, sched, counter_ptr, IS_CAUSAL: gl.constexpr):
    """The producer warp, for each of the program's tiles: both halves' Q tiles into the slots of the tile's
    parity, once the tile two before has stored its O there, then its K and V blocks (:func:`_fwd_load_kv`).
    The rings run on across tiles, so the next tile's Q, K and V load while the consumers finish a tile.

    Three buffers (:func:`_attn_fwd_sm90`): the static schedule (:func:`_fwd_pair_tile`). Four (the fourth the tile
    slots, :func:`_attn_fwd_sm90_dynamic`): tiles handed out dynamically (:func:`_fwd_listed_tile`). A program's
    first tile is its program id, each next one the count an atomic add on counter_ptr[0] returns plus the number
    of programs (taken while the tile before loads); each tile's number goes to the consumers through the tile
    slot of its parity (:func:`_fwd_hand_out`); past the last tile, the number n_tiles tells them to stop, and
    the last program to stop sets counter_ptr[0] and counter_ptr[1] (programs stopped) back to 0 for the next
    launch."""
    ROWS: gl.constexpr = 2 * descs[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = descs[1].block_type.shape[0]
    HEAD_DIM: gl.constexpr = descs[1].block_type.shape[1]
    kv_it = 0
    tile_it = 0
    if len(bufs) == 3:  # the static schedule
        for k in range(2 * sched[5]):
            exists, coords = _fwd_pair_tile(k, sched, IS_CAUSAL, ROWS, BLOCK_N, HEAD_DIM)
            if exists:
                for half in gl.static_range(2):
                    _fwd_wait_q_free(bars, tile_it, half)
                    _fwd_load_q(descs, bufs, bars, coords, tile_it, half)
                _fwd_load_kv(descs, bufs, bars, coords, kv_it)
                kv_it += coords[4]
                tile_it += 1
    else:
        n_tiles = sched[6]
        programs = gl.num_programs(0)
        tile = gl.program_id(0)
        while tile < n_tiles:
            # relaxed: an acquire would hold this warp's loads until the add returns; read at the end of the tile
            following = _lane0_atomic_add(counter_ptr, "relaxed")
            coords = _fwd_listed_tile(tile, sched, IS_CAUSAL, ROWS, BLOCK_N, HEAD_DIM)
            _fwd_hand_out(tile, tile_it, bufs, bars)
            for half in gl.static_range(2):
                _fwd_load_q(descs, bufs, bars, coords, tile_it, half)
            _fwd_load_kv(descs, bufs, bars, coords, kv_it)
            kv_it += coords[4]
            tile_it += 1
            tile = programs + _lane0(following)
        _fwd_hand_out(n_tiles, tile_it, bufs, bars)
        for half in gl.static_range(2):
            mbarrier.arrive(bars[0].index(2 * (tile_it % 2) + half), count=1)
        if _lane0(_lane0_atomic_add(counter_ptr + 1, "acq_rel")) == programs - 1:  # after this program's last add
            layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
            lane = gl.arange(0, 32, layout=layout)
            gl.atomic_xchg(counter_ptr + lane, gl.zeros([32], gl.int32, layout), mask=lane < 2)


@gluon.jit
def _fwd_hand_out(tile, tile_it, bufs, bars):
    """The producer, dynamic schedule: once both consumers are done with the tile two before, writes the number
    of its tile_it-th tile into the tile slot of that parity, where the consumers read it once its Q slots are
    ready (:func:`_fwd_take`)."""
    for half in gl.static_range(2):
        _fwd_wait_q_free(bars, tile_it, half)
    bufs[3].index(tile_it % 2).store(gl.full([1], tile, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    partition_barrier()  # every lane's store before the one that arrives on the Q slots' mbarriers


@gluon.jit
def _fwd_take(tile_it, bufs, bars, HALF: gl.constexpr):
    """A consumer, dynamic schedule: the number of its program's tile_it-th tile, once its Q slot is ready."""
    mbarrier.wait(bars[0].index(2 * (tile_it % 2) + HALF), (tile_it // 2) & 1)
    return gl.max(bufs[3].index(tile_it % 2).load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)


@gluon.jit
def _fwd_compute(descs, bufs, bars, sched, o_ptr, lse_ptr, qk_scale, HALF: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """One consumer warpgroup, for each of its program's tiles (:func:`_fwd_load`'s schedule): query rows
    [q_start + HALF * HALF_M, + HALF_M) of the tile (:func:`_fwd_block_rows`), from the Q slot of the tile's
    parity, released once its O is stored through it."""
    q_ready, q_empty = bars[0], bars[1]
    ROWS: gl.constexpr = 2 * descs[0].block_type.shape[0]
    BLOCK_N: gl.constexpr = descs[1].block_type.shape[0]
    HEAD_DIM: gl.constexpr = descs[1].block_type.shape[1]
    kv_it = 0
    tile_it = 0
    if len(bufs) == 3:  # the static schedule
        for k in range(2 * sched[5]):
            exists, coords = _fwd_pair_tile(k, sched, IS_CAUSAL, ROWS, BLOCK_N, HEAD_DIM)
            if exists:
                q_slot = 2 * (tile_it % 2) + HALF
                mbarrier.wait(q_ready.index(q_slot), (tile_it // 2) & 1)
                _fwd_tile_rows(descs, bufs, bars, coords, kv_it, q_slot, sched, o_ptr, lse_ptr, qk_scale, HALF,
                               IS_CAUSAL)
                mbarrier.arrive(q_empty.index(q_slot), count=1)
                kv_it += coords[4]
                tile_it += 1
    else:
        n_tiles = sched[6]
        tile = _fwd_take(tile_it, bufs, bars, HALF)
        while tile < n_tiles:
            coords = _fwd_listed_tile(tile, sched, IS_CAUSAL, ROWS, BLOCK_N, HEAD_DIM)
            q_slot = 2 * (tile_it % 2) + HALF
            _fwd_tile_rows(descs, bufs, bars, coords, kv_it, q_slot, sched, o_ptr, lse_ptr, qk_scale, HALF,
                           IS_CAUSAL)
            mbarrier.arrive(q_empty.index(q_slot), count=1)
            kv_it += coords[4]
            tile_it += 1
            tile = _fwd_take(tile_it, bufs, bars, HALF)


@gluon.jit
def _fwd_tile_rows(descs, bufs, bars, coords, kv_it, q_slot, sched, o_ptr, lse_ptr, qk_scale, HALF: gl.constexpr,
                   IS_CAUSAL: gl.constexpr):
    """A consumer's half of the tile at coords (:func:`_fwd_coords`) from Q slot q_slot (:func:`_fwd_block_rows`)."""
    HALF_M: gl.constexpr = descs[0].block_type.shape[0]
    _fwd_block_rows(descs, bufs, bars, (coords[0], coords[1] + HALF * HALF_M, coords[2], coords[4], kv_it, sched[2],
                                        sched[3], q_slot),
                    o_ptr, lse_ptr, qk_scale, HALF, IS_CAUSAL, descs[1].block_type.shape[1],
                    descs[1].block_type.shape[0], bufs[1].type.shape[0])


@gluon.jit
def _fwd_block_rows(descs, bufs, bars, block, o_ptr, lse_ptr, qk_scale, HALF: gl.constexpr,
                    IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """A consumer's HALF_M query rows from m_start against every key block, FlashAttention-3's overlap
    within the warpgroup (S_j issued before O += P_{j-1} V_{j-1}); each K/V slot released to the producer
    as soon as its wgmma is done. kv_it: the rings' blocks consumed before this tile. The two consumers
    run unsynchronised, so one's softmax overlaps the other's matmuls. O and lse out at the end."""
    q_desc, k_desc, v_desc, o_desc = descs
    q_smem, k_smem, v_smem = bufs[0], bufs[1], bufs[2]
    k_ready, k_empty, v_ready, v_empty = bars[2], bars[3], bars[4], bars[5]
    row0, m_start, head, n_blocks, kv_it, T, H, q_slot = block
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)

    if IS_CAUSAL:
        mask_from = gl.minimum(m_start + 1, T)
    else:
        mask_from = T
    offs_m = m_start + gl.arange(0, HALF_M, layout=s_rows)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
    q = q_smem.index(q_slot)

    first = kv_it % STAGES
    mbarrier.wait(k_ready.index(first), (kv_it // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(first).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(first), count=1)
    p, m_i, l_i, alpha = _softmax_block(s, gl.full([HALF_M], float("-inf"), gl.float32, layout=s_rows),
                                        gl.zeros([HALF_M], gl.float32, layout=s_rows), offs_m, 0,
                                        gl.arange(0, BLOCK_N, layout=s_cols), T, qk_scale, mask_from, IS_CAUSAL,
                                        BLOCK_N)
    for j in range(1, n_blocks):
        slot = (kv_it + j) % STAGES
        prev = (kv_it + j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), ((kv_it + j) // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        mbarrier.wait(v_ready.index(prev), ((kv_it + j - 1) // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        mbarrier.arrive(k_empty.index(slot), count=1)
        p, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, offs_m, j * BLOCK_N,
                                            j * BLOCK_N + gl.arange(0, BLOCK_N, layout=s_cols), T, qk_scale,
                                            mask_from, IS_CAUSAL, BLOCK_N)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(prev), count=1)
    last = (kv_it + n_blocks - 1) % STAGES
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_ready.index(last), ((kv_it + n_blocks - 1) // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)

    batch = row0 // T
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(lse_ptr + (batch * H + head) * T + offs_m, lse, mask=offs_m < T)
    out = acc / gl.convert_layout(l_i, o_rows)[:, None]
    if m_start + HALF_M <= T:  # by TMA through Q's slot, free since the last S_j
        q.store(out.to(dtype))
        fence_async_shared()
        tma_store(o_desc, [row0 + m_start, head * HEAD_DIM], q)
        tma.store_wait(0)
    else:  # rows past T belong to the next sequence
        rows = m_start + gl.arange(0, HALF_M, layout=o_rows)
        cols = gl.arange(0, HEAD_DIM, layout=o_cols)
        o_offsets = ((row0 + rows) * H + head)[:, None] * HEAD_DIM + cols[None, :]
        gl.store(o_ptr + o_offsets, out.to(dtype), mask=(rows < T)[:, None])


@gluon.jit
def _fwd_lo_causal(descs, bufs, bars, sched, o_ptr, lse_ptr, counter_ptr, qk_scale):
    _fwd_compute(descs, bufs, bars, sched, o_ptr, lse_ptr, qk_scale, 0, True)


@gluon.jit
def _fwd_hi_causal(descs, bufs, bars, sched, o_ptr, lse_ptr, counter_ptr, qk_scale):
    _fwd_compute(descs, bufs, bars, sched, o_ptr, lse_ptr, qk_scale, 1, True)


@gluon.jit
def _fwd_load_causal(descs, bufs, bars, sched, o_ptr, lse_ptr, counter_ptr, qk_scale):
    _fwd_load(descs, bufs, bars, sched, counter_ptr, True)


@gluon.jit
def _fwd_lo_full(descs, bufs, bars, sched, o_ptr, lse_ptr, counter_ptr, qk_scale):
    _fwd_compute(descs, bufs, bars, sched, o_ptr, lse_ptr, qk_scale, 0, False)


@gluon.jit
def _fwd_hi_full(descs, bufs, bars, sched, o_ptr, lse_ptr, counter_ptr, qk_scale):
    _fwd_compute(descs, bufs, bars, sched, o_ptr, lse_ptr, qk_scale, 1, False)


@gluon.jit
def _fwd_load_full(descs, bufs, bars, sched, o_ptr, lse_ptr, counter_ptr, qk_scale):
    _fwd_load(descs, bufs, bars, sched, counter_ptr, False)


@gluon.jit
def _fwd_buffers(q_desc, k_desc, v_desc, STAGES: gl.constexpr):
    """The forward's shared memory: Q slots (2 tiles' parity x 2 halves of HALF_M rows), the K and V rings of
    STAGES slots, and their mbarriers (ready / empty, both consumers releasing a K or V slot)."""
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [4, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for q_slot in gl.static_range(4):
        mbarrier.init(q_ready.index(q_slot), count=1)
        mbarrier.init(q_empty.index(q_slot), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    return (q_smem, k_smem, v_smem), (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)


@gluon.jit
def _fwd_partitions(worker_args, IS_CAUSAL: gl.constexpr):
    """Runs the forward's two consumer warpgroups (the default partition and one worker, 240 registers) and its
    producer warp (24) on worker_args."""
    if IS_CAUSAL:
        gl.warp_specialize([(_fwd_lo_causal, worker_args), (_fwd_hi_causal, worker_args),
                            (_fwd_load_causal, worker_args)], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(_fwd_lo_full, worker_args), (_fwd_hi_full, worker_args),
                            (_fwd_load_full, worker_args)], [4, 1], [240, 24])


@gluon.jit
def _attn_fwd_sm90(q_desc, k_desc, v_desc, o_desc, o_ptr, lse_ptr, B, T, H, GROUP, PAIRS, STRIDE, qk_scale,
                   IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr):
    """The warp-specialised forward on the static schedule: a producer warp (TMA) and two consumer warpgroups of
    q_desc's HALF_M rows each. A tile: 2 * HALF_M query rows of one (batch, query head); a program takes PAIRS
    pairs of tiles, STRIDE pairs apart (:func:`_fwd_pair_tile`). o_desc and o_ptr: the same output
    (B, T, H, D), contiguous."""
    bufs, bars = _fwd_buffers(q_desc, k_desc, v_desc, STAGES)
    sched = (gl.cdiv(T, 2 * q_desc.block_type.shape[0]), B * H, T, H, GROUP, PAIRS, STRIDE)
    _fwd_partitions(((q_desc, k_desc, v_desc, o_desc), bufs, bars, sched, o_ptr, lse_ptr, lse_ptr, qk_scale),
                    IS_CAUSAL)


@gluon.jit(do_not_specialize=["SECTION"])  # triton 3.6 fails to lower the kernel with SECTION = 1 made a constant
def _attn_fwd_sm90_dynamic(q_desc, k_desc, v_desc, o_desc, o_ptr, lse_ptr, counter_ptr, B, T, H, GROUP, SECTION,
                           qk_scale, IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr):
    """:func:`_attn_fwd_sm90` with single tiles handed out as programs free (one program per SM), in the order of
    :func:`_fwd_listed_tile` with sections of SECTION heads. counter_ptr: two int32 zeros, zeros again after the
    launch (:func:`_fwd_load`). The tile slot that carries each tile's number to the consumers is the fourth
    buffer."""
    n_m = gl.cdiv(T, 2 * q_desc.block_type.shape[0])
    bufs, bars = _fwd_buffers(q_desc, k_desc, v_desc, STAGES)
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    sched = (n_m, B * H, T, H, GROUP, SECTION, n_m * B * H)
    _fwd_partitions(((q_desc, k_desc, v_desc, o_desc), (bufs[0], bufs[1], bufs[2], tile_smem), bars, sched, o_ptr,
                     lse_ptr, counter_ptr, qk_scale), IS_CAUSAL)


@gluon.jit
def _dkdv_stage_rows(head, q_start, slot, sizes, ptrs, row_bufs, BLOCK_M: gl.constexpr):
    """The producer's part of a step: lse * log2 e and delta (0 past T) of query rows [q_start, + BLOCK_M) of
    ``head`` into ring slot ``slot`` of row_bufs, so that the consumers read them from shared memory when they
    need them."""
    row0, T, H = sizes[0], sizes[6], sizes[7]
    lse_ptr, delta_ptr = ptrs[0], ptrs[1]
    lse_smem, delta_smem = row_bufs
    layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    offs_q = q_start + gl.arange(0, BLOCK_M, layout=layout)
    rows = ((row0 // T) * H + head) * T + offs_q
    lse_smem.index(slot).store(gl.load(lse_ptr + rows, mask=offs_q < T, other=0.0) * 1.4426950408889634)
    delta_smem.index(slot).store(gl.load(delta_ptr + rows, mask=offs_q < T, other=0.0))
    partition_barrier()  # every lane's stores before the one that arrives on the slot's mbarrier


@gluon.jit
def _dkdv_probs(st, qk_scale, lse2, offs_k, q_start, k_lo, T, IS_CAUSAL: gl.constexpr, HALF_N: gl.constexpr,
                BLOCK_M: gl.constexpr):
    """Pᵀ (keys, queries) of the raw scores Sᵀ; masked only where the causal diagonal or the sequence's end
    crosses the tile."""
    pt = gl.exp2(st * qk_scale - lse2[None, :])
    edge = q_start + BLOCK_M > T or k_lo + HALF_N > T
    if IS_CAUSAL:
        edge = edge or q_start < k_lo + HALF_N
    if edge:
        offs_q = q_start + gl.arange(0, BLOCK_M, layout=lse2.type.layout)
        keep = (offs_q[None, :] < T) & (offs_k[:, None] < T)
        if IS_CAUSAL:
            keep = keep & (offs_q[None, :] >= offs_k[:, None])
        pt = gl.where(keep, pt, 0.0)
    return pt


@gluon.jit
def _dkdv_load(descs, bufs, bars, sizes, ptrs, sm_scale):
    """The backward's producer warp: both halves of the key block's K and V once, then Q and dO of
    every (query head, query block) step into a ring, with the step's lse * log2 e and delta
    (:func:`_dkdv_stage_rows`), each slot refilled once both consumers released it."""
    q_desc, k_desc, v_desc, do_desc, dq_desc = descs
    k_smem, v_smem, q_smem, do_smem, dq_smem, ds_smem, lse_smem, delta_smem = bufs
    kv_bar, ready, empty, ds_full, ds_free = bars
    row0, k_start, kv_head, group, first_m, m_blocks, T, H, dkv_row = sizes
    HALF_N: gl.constexpr = v_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_smem.type.shape[0]
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    tma_load(k_desc, [row0 + k_start, kv_head * HEAD_DIM], kv_bar, k_smem)
    for half in gl.static_range(2):
        tma_load(v_desc, [row0 + k_start + half * HALF_N, kv_head * HEAD_DIM], kv_bar, v_smem.index(half))
    for i in range(group * m_blocks):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        head = kv_head * group + i // m_blocks
        q_start = (first_m + i % m_blocks) * BLOCK_M
        _dkdv_stage_rows(head, q_start, slot, sizes, ptrs, (lse_smem, delta_smem), BLOCK_M)
        row = row0 + q_start
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [row, head * HEAD_DIM], ready.index(slot), q_smem.index(slot))
        tma_load(do_desc, [row, head * HEAD_DIM], ready.index(slot), do_smem.index(slot))


@gluon.jit
def _dkdv_share_ds(dst, i, bufs, bars, HALF: gl.constexpr):
    """Step i's dSᵀ (my keys, queries) into my rows of the shared dSᵀ, once both warpgroups have read step
    i - 1's; then tell the other warpgroup."""
    ds_smem = bufs[5]
    ds_full, ds_free = bars[3], bars[4]
    HALF_N: gl.constexpr = dst.type.shape[0]
    mbarrier.wait(ds_free, (i & 1) ^ 1)
    ds_smem.slice(HALF * HALF_N, HALF_N).store(dst)
    fence_async_shared()
    mbarrier.arrive(ds_full, count=1)


@gluon.jit
def _dkdv_dq_mma(i, bufs, bars, dq_zero, HALF: gl.constexpr):
    """Issues my half of D of step i's dQ = dS K over both warpgroups' keys, once both stored their dSᵀ."""
    k_smem, ds_smem = bufs[0], bufs[5]
    ds_full = bars[3]
    HALF_D: gl.constexpr = dq_zero.type.shape[1]
    mbarrier.wait(ds_full, i & 1)
    k_cols = k_smem.slice(HALF * HALF_D, HALF_D, dim=1)  # (both halves' keys, my half of D)
    return warpgroup_mma(ds_smem.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)


@gluon.jit
def _dkdv_dq_add(dq, i, dq_desc, dq_at, bufs, bars, HALF: gl.constexpr):
    """Waits for step i's dQ (the last wgmma in flight), frees the shared dSᵀ, and TMA-adds dQ into the fp32
    sum at dq_at through my dQ buffer (one add in flight: the next waits until the last has read it)."""
    my_dq = bufs[4].index(HALF)
    ds_free = bars[4]
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    mbarrier.arrive(ds_free, count=1)
    tma.store_wait(0)
    my_dq.store(dq)
    fence_async_shared()
    tma_add(dq_desc, [dq_at[0], dq_at[1]], my_dq)


@gluon.jit
def _dkdv_compute(descs, bufs, bars, sizes, ptrs, sm_scale, HALF: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  WITH_DQ: gl.constexpr):
    """One consumer warpgroup: dK and dV of keys [k_start + HALF * HALF_N, + HALF_N), summed over the
    steps' query blocks; keys are the rows of every matmul (Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV += Pᵀ dO,
    dK += dSᵀ Q), so both accumulators stay in registers. WITH_DQ: both warpgroups' dSᵀ meet in shared memory
    (mbarriers ds_full / ds_free), and this one computes its half of D of the step's dQ = dS K over all
    2 * HALF_N keys and TMA-adds it into the fp32 sum (one add in flight: the next waits until the last has
    read dq_smem)."""
    q_desc, k_desc, v_desc, do_desc, dq_desc = descs
    k_smem, v_smem, q_smem, do_smem, _, ds_smem, lse_smem, delta_smem = bufs  # dQ's buffers: the _dkdv_dq_* helpers
    kv_bar, ready, empty = bars[0], bars[1], bars[2]
    row0, k_start, kv_head, group, first_m, m_blocks, T, H, dkv_row = sizes
    dk_ptr, dv_ptr = ptrs[2], ptrs[3]
    HALF_N: gl.constexpr = v_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_smem.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])  # (keys, queries)
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])  # (keys, D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    t_keys: gl.constexpr = gl.SliceLayout(1, t_layout)
    t_queries: gl.constexpr = gl.SliceLayout(0, t_layout)

    k_lo = k_start + HALF * HALF_N
    qk_scale = sm_scale * 1.4426950408889634
    offs_k = k_lo + gl.arange(0, HALF_N, layout=t_keys)
    k = k_smem.slice(HALF * HALF_N, HALF_N)
    v = v_smem.index(HALF)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=kv_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=kv_layout)
    t_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=t_layout)
    HALF_D: gl.constexpr = HEAD_DIM // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])  # (queries, D / 2)
    dq_zero = gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=dq_layout)
    mbarrier.wait(kv_bar, 0)
    for i in range(group * m_blocks):
        slot = i % STAGES
        q_start = (first_m + i % m_blocks) * BLOCK_M
        dq_at = (row0 + q_start, (kv_head * group + i // m_blocks) * HEAD_DIM + HALF * HALF_D)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        q = q_smem.index(slot)
        masked = False
        if IS_CAUSAL and HALF == 1:
            masked = q_start + BLOCK_M <= k_lo  # every query of the step before my first key: P = dS = 0
        if masked:  # no score or dK/dV matmul; with dQ, my half of dS is zeros
            if WITH_DQ:
                _dkdv_share_ds(gl.zeros([HALF_N, BLOCK_M], dtype, layout=t_layout), i, bufs, bars, HALF)
                dq = _dkdv_dq_mma(i, bufs, bars, dq_zero, HALF)
                mbarrier.arrive(empty.index(slot), count=1)
                _dkdv_dq_add(dq, i, dq_desc, dq_at, bufs, bars, HALF)
            else:
                mbarrier.arrive(empty.index(slot), count=1)
        else:
            lse2 = lse_smem.index(slot).load(t_queries)
            do = do_smem.index(slot)
            st = warpgroup_mma(k, q.permute((1, 0)), t_zero, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
            pt = _dkdv_probs(st, qk_scale, lse2, offs_k, q_start, k_lo, T, IS_CAUSAL, HALF_N, BLOCK_M)
            dpt = warpgroup_mma(v, do.permute((1, 0)), t_zero, use_acc=False, is_async=True)
            dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do, dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
            dst = (pt * (dpt - delta_smem.index(slot).load(t_queries)[None, :])).to(dtype)
            if WITH_DQ:  # both halves' dSᵀ in shared memory; this warpgroup's half of D of dQ = dS K, TMA-added
                _dkdv_share_ds(dst, i, bufs, bars, HALF)
                if HEAD_DIM <= DS_IN_REGISTERS_MAX_D:
                    dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q, dk, is_async=True)
                else:
                    dk = warpgroup_mma(ds_smem.slice(HALF * HALF_N, HALF_N), q, dk, is_async=True)
                dq = _dkdv_dq_mma(i, bufs, bars, dq_zero, HALF)
                dv, dk = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dk))
                mbarrier.arrive(empty.index(slot), count=1)
                _dkdv_dq_add(dq, i, dq_desc, dq_at, bufs, bars, HALF)
            else:
                dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q, dk, is_async=True)
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                mbarrier.arrive(empty.index(slot), count=1)

    kv_rows: gl.constexpr = gl.SliceLayout(1, kv_layout)
    keys = k_lo + gl.arange(0, HALF_N, layout=kv_rows)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    offsets = ((row0 + keys) * dkv_row + kv_head * HEAD_DIM)[:, None] + cols[None, :]
    inside = (keys < T)[:, None]
    gl.store(dk_ptr + offsets, (dk * sm_scale).to(dtype), mask=inside)
    gl.store(dv_ptr + offsets, dv.to(dtype), mask=inside)
    if WITH_DQ:
        tma.store_wait(0)


@gluon.jit
def _dkdv_lo_causal(descs, bufs, bars, sizes, ptrs, sm_scale):
    _dkdv_compute(descs, bufs, bars, sizes, ptrs, sm_scale, 0, True, False)


@gluon.jit
def _dkdv_lo_causal_dq(descs, bufs, bars, sizes, ptrs, sm_scale):
    _dkdv_compute(descs, bufs, bars, sizes, ptrs, sm_scale, 0, True, True)


@gluon.jit
def _dkdv_hi_causal(descs, bufs, bars, sizes, ptrs, sm_scale):
    _dkdv_compute(descs, bufs, bars, sizes, ptrs, sm_scale, 1, True, False)


@gluon.jit
def _dkdv_hi_causal_dq(descs, bufs, bars, sizes, ptrs, sm_scale):
    _dkdv_compute(descs, bufs, bars, sizes, ptrs, sm_scale, 1, True, True)


@gluon.jit
def _dkdv_lo_full(descs, bufs, bars, sizes, ptrs, sm_scale):
    _dkdv_compute(descs, bufs, bars, sizes, ptrs, sm_scale, 0, False, False)


@gluon.jit
def _dkdv_lo_full_dq(descs, bufs, bars, sizes, ptrs, sm_scale):
    _dkdv_compute(descs, bufs, bars, sizes, ptrs, sm_scale, 0, False, True)


@gluon.jit
def _dkdv_hi_full(descs, bufs, bars, sizes, ptrs, sm_scale):
    _dkdv_compute(descs, bufs, bars, sizes, ptrs, sm_scale, 1, False, False)


@gluon.jit
def _dkdv_hi_full_dq(descs, bufs, bars, sizes, ptrs, sm_scale):
    _dkdv_compute(descs, bufs, bars, sizes, ptrs, sm_scale, 1, False, True)


@gluon.jit
def _attn_bwd_dkdv_sm90(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr, DKV_ROW, T, H,
                        GROUP, SECTION, sm_scale, IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                        WITH_DQ: gl.constexpr):
    """The warp-specialised dK/dV kernel: 2 * HALF_N keys (k_desc's rows; v_desc reads HALF_N) of one (batch,
    KV head) per program, a producer warp and two consumer warpgroups of HALF_N keys each. Grid (key blocks *
    SECTION, (batch, KV head)s / SECTION): each section's key blocks in order, its heads fastest
    (:func:`bwd_section`). dk and dv:
    (B, T, H_kv, D) with DKV_ROW elements from one token to the next (H_kv * D contiguous; more in a packed
    gradient). WITH_DQ: dQ is added too, into the float32 (B * T, H * D) that dq_desc (tiles of BLOCK_M x D / 2)
    describes; without, dq_desc is not read."""
    HALF_N: gl.constexpr = v_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    pid_n = gl.program_id(0) // SECTION
    pid_bkv = gl.program_id(1) * SECTION + gl.program_id(0) % SECTION
    H_KV = H // GROUP
    batch = pid_bkv // H_KV
    kv_head = pid_bkv % H_KV
    k_start = pid_n * 2 * HALF_N
    if IS_CAUSAL:
        first_m = k_start // BLOCK_M
    else:
        first_m = 0
    m_blocks = gl.cdiv(T, BLOCK_M) - first_m
    k_smem = gl.allocate_shared_memory(dtype, [2 * HALF_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * HALF_N, BLOCK_M], dtype)
    if WITH_DQ:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2 * HALF_N, BLOCK_M], ds_layout)
    else:  # unused stand-ins
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 8, 8], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        ds_smem = gl.allocate_shared_memory(dtype, [16, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a ring of STAGES rows
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], rows_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], rows_layout)
    ds_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ds_full, count=2)
    mbarrier.init(ds_free, count=2)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    args = ((q_desc, k_desc, v_desc, do_desc, dq_desc),
            (k_smem, v_smem, q_smem, do_smem, dq_smem, ds_smem, lse_smem, delta_smem),
            (kv_bar, ready, empty, ds_full, ds_free),
            (batch * T, k_start, kv_head, GROUP, first_m, m_blocks, T, H, DKV_ROW),
            (lse_ptr, delta_ptr, dk_ptr, dv_ptr), sm_scale)
    if WITH_DQ:
        if IS_CAUSAL:
            gl.warp_specialize([(_dkdv_lo_causal_dq, args), (_dkdv_hi_causal_dq, args), (_dkdv_load, args)],
                               [4, 1], [240, 24])
        else:
            gl.warp_specialize([(_dkdv_lo_full_dq, args), (_dkdv_hi_full_dq, args), (_dkdv_load, args)], [4, 1],
                               [240, 24])
    else:
        if IS_CAUSAL:
            gl.warp_specialize([(_dkdv_lo_causal, args), (_dkdv_hi_causal, args), (_dkdv_load, args)], [4, 1],
                               [240, 24])
        else:
            gl.warp_specialize([(_dkdv_lo_full, args), (_dkdv_hi_full, args), (_dkdv_load, args)], [4, 1],
                               [240, 24])


@constexpr_function
def _rows_layout(head_dim):
    """A blocked layout of (rows, head_dim) tiles over 4 warps: 8 contiguous elements a thread along D."""
    head_dim = getattr(head_dim, "value", head_dim)
    return gl.BlockedLayout([1, 8], [32 // (head_dim // 8), head_dim // 8], [4, 1], [1, 0])


@gluon.jit
def _bwd_delta(o_ptr, do_ptr, delta_ptr, O_ROW, DO_ROW, T, H, n_rows, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr):
    """delta = rowsum(dO * O) (B, H, T) float32 of BLOCK (token, head) rows per program; o and do are read
    as (B * T, H * D) views with O_ROW and DO_ROW elements from one token to the next."""
    layout: gl.constexpr = _rows_layout(HEAD_DIM)
    rows = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    token = rows // H
    head = rows % H
    inside = (rows < n_rows)[:, None]
    o = gl.load(o_ptr + (token * O_ROW + head * HEAD_DIM)[:, None] + cols[None, :], mask=inside, other=0.0)
    do = gl.load(do_ptr + (token * DO_ROW + head * HEAD_DIM)[:, None] + cols[None, :], mask=inside, other=0.0)
    delta = gl.sum(o.to(gl.float32) * do.to(gl.float32), axis=1)
    gl.store(delta_ptr + ((token // T) * H + head) * T + token % T, delta, mask=rows < n_rows)


@gluon.jit
def _bwd_dq_out(acc_ptr, dq_ptr, DQ_ROW, H, n_rows, sm_scale, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr):
    """dq = sm_scale * the fp32 sum (B * T * H, D) the dK/dV kernel added, in dq's dtype, BLOCK (token, head)
    rows per program; dq is written as a (B * T, H * D) view with DQ_ROW elements from one token to the next."""
    layout: gl.constexpr = _rows_layout(HEAD_DIM)
    rows = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    inside = (rows < n_rows)[:, None]
    acc = gl.load(acc_ptr + (rows * HEAD_DIM)[:, None] + cols[None, :], mask=inside, other=0.0)
    out = dq_ptr + ((rows // H) * DQ_ROW + (rows % H) * HEAD_DIM)[:, None] + cols[None, :]
    gl.store(out, (acc * sm_scale).to(dq_ptr.dtype.element_ty), mask=inside)


# each kernel's launches: a call like an earlier one replays its binary (launch.py)
FWD, FWD_DYNAMIC, DKDV, DELTA, DQ_OUT = map(Replay, (_attn_fwd_sm90, _attn_fwd_sm90_dynamic, _attn_bwd_dkdv_sm90,
                                                    _bwd_delta, _bwd_dq_out))


def compile_for_sm90(kernel: str, head_dim: int, dtype: str, causal: bool) -> str:
    """The PTX of the forward (kernel "fwd"; "fwd_dynamic" with tiles handed out dynamically), the backward's dK/dV
    kernel ("bwd") or that kernel adding dQ too
    ("bwd_dq") compiled for sm90a at the launch's tiles, without a GPU (Gluon has no interpreter: this is how a CPU
    checks them). dtype: "bf16" or "fp16". Needs TRITON_INTERPRET unset when triton was imported (its library
    functions are interpreted otherwise)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    element = gl.bfloat16 if dtype == "bf16" else gl.float16

    def descriptor(rows, name=dtype, of=element, cols=head_dim):
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], of)
        return f"tensordesc<{name}[{rows}, {cols}],{layout!r}>"

    if kernel in ("fwd", "fwd_dynamic"):
        fn, rows_q, rows_kv = (_attn_fwd_sm90 if kernel == "fwd" else _attn_fwd_sm90_dynamic), FWD_HALF_M, FWD_BLOCK_N
        pointers = {"o_ptr": f"*{dtype}", "lse_ptr": "*fp32", **({"counter_ptr": "*i32"} if kernel != "fwd" else {})}
        scalars = {"qk_scale": "fp32"}
        constexprs = {"IS_CAUSAL": causal, "BLOCK_N": rows_kv, "HEAD_DIM": head_dim, "STAGES": FWD_STAGES}
    else:
        fn, rows_q, rows_kv = _attn_bwd_dkdv_sm90, BWD_BLOCK_M, BWD_HALF_N
        pointers = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "dk_ptr": f"*{dtype}", "dv_ptr": f"*{dtype}"}
        scalars = {"sm_scale": "fp32"}
        constexprs = {"IS_CAUSAL": causal, "STAGES": BWD_STAGES, "WITH_DQ": kernel == "bwd_dq"}
    descriptors = {"q_desc": descriptor(rows_q), "k_desc": descriptor(rows_kv), "v_desc": descriptor(rows_kv)}
    if kernel.startswith("fwd"):
        descriptors["o_desc"] = descriptor(rows_q)
    else:
        descriptors["do_desc"] = descriptor(rows_q)
        descriptors["k_desc"] = descriptor(2 * rows_kv)
        descriptors["dq_desc"] = descriptor(rows_q, "fp32", gl.float32, head_dim // 2)
    sizes = {"fwd": ("B", "T", "H", "GROUP", "PAIRS", "STRIDE"), "fwd_dynamic": ("B", "T", "H", "GROUP", "SECTION")}.get(
        kernel, ("DKV_ROW", "T", "H", "GROUP", "SECTION"))
    signature = {**descriptors, **pointers, **{name: "i32" for name in sizes}, **scalars,
                 **{key: "constexpr" for key in constexprs}}
    source = GluonASTSource(fn, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": WS_MAXNREG}).asm["ptx"]


def tma_row(x) -> int | None:
    """The row stride (elements) of (B, T, H, D) x read as the 2-D (B * T, H * D) a tensor descriptor
    reads, or None where x's strides do not allow that (D not contiguous, heads not adjacent, batches not
    T rows apart) or TMA's 16-byte alignment of the base and the row stride fails."""
    B, T, H, D = x.shape
    row = x.stride(1)
    if x.stride(3) != 1 or x.stride(2) != D or (B > 1 and x.stride(0) != T * row):
        return None
    if (x.data_ptr() % 16) or (row * x.element_size()) % 16:
        return None
    return row


@functools.lru_cache(maxsize=None)
def is_sm90(device_index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(device_index)[0] == 9


def unsupported(q, k, v, window: int, cu_seqlens, dropout_p: float, g) -> str | None:
    """Why this call cannot run on the Hopper forward (None: it can)."""
    import torch

    if not (q.is_cuda and is_sm90(q.device.index or 0)):
        return "needs an sm90 GPU (H100/H200)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"takes fp16/bf16, not {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"takes head dims {HEAD_DIMS}, not {q.shape[-1]}"
    if window or cu_seqlens is not None or dropout_p or g is not None:
        return "has no window, packed documents, dropout or gate yet"
    if tma_row(q) is None or tma_row(k) is None or tma_row(v) is None:
        return "needs (B, T, H, D) inputs whose heads and rows TMA can read (16-byte aligned, D contiguous)"
    return None


def descriptor(x, rows: int):
    """The TMA descriptor of (B, T, H, D) x read as (B * T, H * D) (:func:`tma_row`) in tiles of ``rows`` x D."""
    B, T, H, D = x.shape
    return tile_descriptor(x, [B * T, H * D], [tma_row(x), 1], rows, D)


def tile_descriptor(x, shape: list[int], strides: list[int], rows: int, cols: int):
    """The TMA descriptor of bf16, fp16 or float32 x read as the 2-D ``shape`` with ``strides`` in tiles of
    rows x cols (Gluon's default shared-memory layout for them)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(x, shape, strides, [rows, cols], shared_layout(rows, cols, x.dtype))


@functools.lru_cache(maxsize=None)
def shared_layout(rows: int, cols: int, dtype):
    """Gluon's default shared-memory layout of a rows x cols tile of a torch dtype (bf16, fp16, float32), made
    once: every launch passes it with each descriptor."""
    import torch

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, cols], element)


def fwd_schedule(T: int, head_dim: int, causal: bool, group: int, element_size: int, n_heads: int,
                 n_sms: int) -> tuple[tuple[int, int], int, int, int]:
    """The forward's grid over n_heads (batch, query head)s of T queries (``group`` of them to a KV head), the
    block pairs each program takes, the stride between them and the section (0: :func:`_attn_fwd_sm90`'s static
    schedule; else :func:`_attn_fwd_sm90_dynamic`'s). Where a
    pair's key blocks times head_dim are at most ``FWD_PERSISTENT_MAX_WORK``, one program per SM at most: taking
    pairs p, p + programs, ... where that keeps the SMs at least ``FWD_STATIC_FILL`` busy, else single tiles as
    they free, in sections: the fewest whose heads' K and V fit ``FWD_SECTION_BYTES``, as even as that count
    allows. Otherwise a program per ``FWD_HEADS`` heads' pairs of one place (one head where that would leave
    fewer than ``FWD_MIN_WAVES`` programs per SM)."""
    n_m = -(-T // (2 * FWD_HALF_M))
    n_pairs = -(-n_m // 2)
    if (n_m + 1 if causal else 2 * n_m) * head_dim <= FWD_PERSISTENT_MAX_WORK:
        programs = min(n_pairs * n_heads, n_sms)
        rounds = -(-n_pairs * n_heads // programs)
        if n_pairs * n_heads >= FWD_STATIC_FILL * programs * rounds:
            return (programs, 1), rounds, programs, 0
        head_bytes = max(1, 2 * T * head_dim * element_size // group)
        sections = -(-n_heads // max(1, FWD_SECTION_BYTES // head_bytes))
        return (min(n_m * n_heads, n_sms), 1), 0, 0, -(-n_heads // sections)
    heads = FWD_HEADS if n_pairs * -(-n_heads // FWD_HEADS) >= FWD_MIN_WAVES * n_sms else 1
    return (n_pairs, -(-n_heads // heads)), heads, n_pairs, 0


def tile_counter(device):
    """Two int32 zeros for the forward's hand-out of tiles (:func:`_fwd_load`), which leaves them zero: one pair
    per (device, stream), whose launches run one after another; a new pair for each launch that a CUDA graph
    captures, since a graph may be replayed on any stream."""
    import torch

    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    counter = TILE_COUNTERS.get(key)
    if counter is None:
        counter = TILE_COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def attn_fwd_sm90(q, k, v, softmax_scale: float, causal: bool):
    """The Hopper forward of ``forward.attn_fwd`` for a call :func:`unsupported` accepts.
    q: (B, T, H, D); k, v: (B, T, H_kv, D). Returns o (B, T, H, D) contiguous in q's dtype and lse
    (B, H, T) float32, natural log."""
    import torch

    from ..gpu import gpu_resources

    B, T, H, D = q.shape
    o = q.new_empty((B, T, H, D))
    lse = q.new_empty((B, H, T), dtype=torch.float32)
    if B * T == 0:
        return o, lse
    group = H // k.shape[2]
    grid, pairs, stride, section = fwd_schedule(T, D, causal, group, q.element_size(), B * H,
                                                gpu_resources(q.device).sms)
    descriptors = (descriptor(q, FWD_HALF_M), descriptor(k, FWD_BLOCK_N), descriptor(v, FWD_BLOCK_N),
                   descriptor(o, FWD_HALF_M))
    scale_and_tiles = (softmax_scale * LOG2E, bool(causal), FWD_BLOCK_N, D, FWD_STAGES)
    if section:
        FWD_DYNAMIC.launch(grid, (*descriptors, o, lse, tile_counter(q.device)),
                           (B, T, H, group, section, *scale_and_tiles), num_warps=4, maxnreg=WS_MAXNREG)
    else:
        FWD.launch(grid, (*descriptors, o, lse), (B, T, H, group, pairs, stride, *scale_and_tiles), num_warps=4,
                   maxnreg=WS_MAXNREG)
    return o, lse


def attn_bwd_sm90(do, q, k, v, o, lse, softmax_scale: float, causal: bool, out=None, dq_in_dkdv: bool | None = None):
    """The Hopper backward for a call :func:`unsupported` accepts: dq (B, T, H, D), dk, dv (B, T, H_kv, D)
    in q's dtype, new and contiguous, or written into ``out`` = (dq, dk, dv) (a packed gradient's views:
    each with D contiguous, heads adjacent and batches T tokens apart; dk and dv with the same strides).
    lse: (B, H, T) float32, natural log, as either forward writes it.

    dq_in_dkdv (None: T >= ``DQ_IN_DKDV_FROM_T[D]``): the warp-specialised kernel adds dQ = dS K into an fp32 sum
    by TMA's reduce-add (five matmuls; run to run, dq may differ in its last bit), between a delta = rowsum(dO * O)
    kernel and one that scales and casts dQ. Otherwise the tl dQ kernel (backward.attn_bwd, which also writes
    delta) runs before it (seven matmuls, deterministic)."""
    import torch

    from .backward import attn_bwd

    do = do if tma_row(do) is not None else do.contiguous()
    B, T, H, D = q.shape
    if dq_in_dkdv is None:
        dq_in_dkdv = T >= DQ_IN_DKDV_FROM_T[D]

    def dkdv(q, k, v, do, lse, delta, dk, dv, dq_sum=None):
        dq_in = dq_sum is not None
        dq_sum = dq_sum if dq_in else torch.empty((BWD_BLOCK_M, D // 2), dtype=torch.float32, device=q.device)
        n_bkv = B * k.shape[2]
        section = bwd_section(T, D, H // k.shape[2], dq_in, n_bkv)
        grid = (-(-T // (2 * BWD_HALF_N)) * section, n_bkv // section)
        dq_desc = tile_descriptor(dq_sum, list(dq_sum.shape), [dq_sum.shape[1], 1], BWD_BLOCK_M, D // 2)
        descs = (descriptor(q, BWD_BLOCK_M), descriptor(k, 2 * BWD_HALF_N), descriptor(v, BWD_HALF_N),
                 descriptor(do, BWD_BLOCK_M), dq_desc)
        DKDV.launch(grid, (*descs, lse, delta, dk, dv),
                    (token_stride(dk, dv), T, H, H // k.shape[2], section, softmax_scale, bool(causal), BWD_STAGES,
                     dq_in),
                    num_warps=4, maxnreg=WS_MAXNREG)

    if not dq_in_dkdv:
        dq, dk, dv, _ = attn_bwd(do, q, k, v, o, lse, softmax_scale, causal, out=out, dkdv_launch=dkdv)
        return dq, dk, dv
    dq, dk, dv = out if out is not None else (q.new_empty((B, T, H, D)), k.new_empty(k.shape), v.new_empty(v.shape))
    if B * T == 0:
        return dq, dk, dv
    o = o if tma_row(o) is not None else o.contiguous()
    n_rows = B * T * H
    rows_grid = (-(-n_rows // ROWS_BLOCK),)
    delta = q.new_empty((B, H, T), dtype=torch.float32)
    DELTA.launch(rows_grid, (o, do, delta),
                 (tma_row(o), tma_row(do), T, H, n_rows, D, ROWS_BLOCK), num_warps=4)
    dq_sum = torch.zeros((B * T, H * D), dtype=torch.float32, device=q.device)
    dkdv(q, k, v, do, lse, delta, dk, dv, dq_sum)
    DQ_OUT.launch(rows_grid, (dq_sum, dq), (token_stride(dq, dq), H, n_rows, softmax_scale, D, ROWS_BLOCK), num_warps=4)
    return dq, dk, dv


def bwd_section(T: int, head_dim: int, group: int, dq_in: bool, n_bkv: int) -> int:
    """The (batch, KV head)s of one section of the dK/dV grid (:func:`_attn_bwd_dkdv_sm90`): where the kernel adds
    dQ, the most that divide n_bkv and keep their Q, dO and float32 dQ sum within ``BWD_SECTION_BYTES``; one
    otherwise (beside the tl dQ kernel, sections measured 0.85-1.06x at T = 1024: docs/KERNEL.md)."""
    if not dq_in:
        return 1
    most = max(1, BWD_SECTION_BYTES // (group * T * head_dim * (2 + 2 + 4)))
    return max(d for d in range(1, min(most, n_bkv) + 1) if n_bkv % d == 0)


def token_stride(dk, dv) -> int:
    """The elements from one token to the next of dk and dv (B, T, H_kv, D), which the dK/dV kernel
    writes as rows of (B * T, that stride): :func:`tma_row`."""
    row = tma_row(dk)
    if row is None or dv.stride() != dk.stride():
        raise ValueError(f"the Hopper dK/dV kernel writes dk and dv of one layout with D contiguous, heads adjacent "
                         f"and batches T tokens apart, not strides {dk.stride()} and {dv.stride()}")
    return row
