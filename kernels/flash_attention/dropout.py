"""Attention dropout for the flash kernels: the random keep-mask, its seed, and a mask helper.

Dropout acts on the attention probabilities: o = (P * keep / (1 - p)) V, with P the softmax of
the scores; the log-sum-exp (and so the softmax normalisation) is that of the un-dropped scores,
as in FlashAttention and SDPA. The mask is never stored: every kernel (forward, dQ, dK/dV)
regenerates the bits of its own tile from

* the call's RNG state ``rng``: a (2,) int64 tensor (seed, offset) on q's device, and
* the element's coordinates (s, h, i, j): sequence s (batch row, or document of a packed batch),
  query head h, query i and key j counted from the start of the sequence,

with Philox 4x32-10 (``tl.philox``): key = seed, counter = (j // 8, ((s * H + h) * T + i) mod 2**32,
offset_lo, offset_hi). One call returns four 32-bit words, 128 bits, and a keep decision needs
16 of them: key j takes the 16-bit half (j % 2: 0 the high half, 1 the low) of word (j % 8) // 2,
so one Philox call serves eight keys. Element (s, h, i, j) is kept when its 16 bits are
>= round(p * 2**16): probability 1 - round(p * 2**16) / 2**16, so p takes steps of 2**-16 (1.5e-5)
and the drop probability is within 7.7e-6 of p (p = 0.1 drops 6554 / 65536 = 0.100006); the
kept values are still scaled by 1 / (1 - p). Philox's rounds are the cost of dropout (20 integer
multiplies per call): 16 bits a score make it half of what 32 would, at a granularity of p far
below anything a model is tuned to (FlashAttention 2 keeps 8 bits, steps of 1/256). The mask
depends on the coordinates only, not on any kernel's tile sizes, so the three kernels (each with
its own tiles) and :func:`flash_dropout_mask` agree bit for bit.

The RNG state is drawn by :func:`draw_dropout_rng` with ``torch.randint`` on q's device, from
that device's default generator: ``torch.manual_seed`` makes a call repeatable, and under CUDA
graph capture the draw is recorded like any torch RNG op, so each replay of a captured step gets
fresh random numbers (the generator's offset advances on every replay); a seed read on the host
would instead be baked into the graph. The kernels ``tl.load`` the state through its pointer, and
the autograd function saves the tensor for the backward. Under ``torch.compile`` the draw is a
graph op like any other (Inductor may lower it to its own RNG; still seeded by torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_KEEP_BITS = 16  # keep iff the element's 16-bit half of a Philox word >= threshold


def dropout_threshold(dropout_p: float) -> int:
    """Integer threshold of an element's 16 random bits below which it is dropped."""
    return round(dropout_p * (1 << _KEEP_BITS))


def draw_dropout_rng(device: torch.device) -> torch.Tensor:
    """A fresh (seed, offset) pair, (2,) int64 on ``device``, from torch's generator of that device."""
    return torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)


@triton.jit
def load_rng(RNG):
    """(seed, offset_lo, offset_hi) of the RNG state at ``RNG``: (2,) int64 (seed, offset)."""
    seed = tl.load(RNG)
    offset = tl.load(RNG + 1)
    return seed, (offset & 0xFFFFFFFF).to(tl.uint32), ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def dropout_keep(seed, offset_lo, offset_hi, row0, offs_m, start_n, threshold,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """Keep-mask (BLOCK_M, BLOCK_N) of queries ``offs_m`` against keys ``start_n + [0, BLOCK_N)``;
    (BLOCK_N, BLOCK_M), keys by queries, when ``TRANSPOSED`` (the dK/dV kernel's orientation).

    ``row0`` = (s * H + h) * T locates the (sequence, head) plane; ``start_n`` must be a multiple
    of 8 (tiles start at multiples of BLOCK_N >= 16). See the module docstring for the counter.
    """
    rows = (row0 + offs_m).to(tl.uint32)
    groups = (start_n // 8 + tl.arange(0, BLOCK_N // 8)).to(tl.uint32)
    c0 = tl.broadcast_to(groups[None, :], (BLOCK_M, BLOCK_N // 8))
    c1 = tl.broadcast_to(rows[:, None], (BLOCK_M, BLOCK_N // 8))
    zero = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero + offset_lo, zero + offset_hi)
    # join(join(r0, r2), join(r1, r3))[m, g, a, b] = r_{2a+b}: column 4g + t holds word t of group g;
    # then join(high, low) puts the high half of column u at 2u and its low half at 2u + 1.
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_M, BLOCK_N // 2))
    halves = tl.reshape(tl.join(words >> 16, words & 0xFFFF), (BLOCK_M, BLOCK_N))
    if TRANSPOSED:
        halves = tl.trans(halves)
    return halves.to(tl.int32) >= threshold


@triton.jit
def _dropout_mask_kernel(RNG, OUT, CU_SEQLENS, T, H, threshold,
                         stride_ob, stride_oh, stride_oi,
                         IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    i_b = tl.program_id(1)
    i_h = tl.program_id(2)
    if IS_VARLEN:  # document i_b of the packed (1, T) batch
        bos = tl.load(CU_SEQLENS + i_b)
        seqlen = tl.load(CU_SEQLENS + i_b + 1) - bos
        out = OUT + i_h.to(tl.int64) * stride_oh
    else:
        bos = 0
        seqlen = T
        out = OUT + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
    seed, offset_lo, offset_hi = load_rng(RNG)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row0 = (i_b * H + i_h) * T
    for start_n in range(0, seqlen, BLOCK_N):
        keep = dropout_keep(seed, offset_lo, offset_hi, row0, offs_m, start_n, threshold, BLOCK_M, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ptrs = out + (bos + offs_m)[:, None].to(tl.int64) * stride_oi + (bos + offs_n)[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < seqlen) & (offs_n[None, :] < seqlen))


def flash_dropout_mask(
    rng: torch.Tensor,
    B: int,
    H: int,
    T: int,
    dropout_p: float,
    cu_seqlens: torch.Tensor | None = None,
    block_m: int = 32,
    block_n: int = 32,
) -> torch.Tensor:
    """The keep-mask the kernels apply for RNG state ``rng``: bool (B, H, T, T), [b, h, i, j] True
    where query i keeps key j (before the causal / window / document mask, which applies on top).

    With ``cu_seqlens`` (B == 1) entries within a document hold that document's mask and entries
    across documents are False. ``block_m`` / ``block_n`` (powers of two >= 16) set this helper's
    own tiles; the mask does not depend on them. For tests and references: it materialises T x T.
    """
    out = torch.zeros((B, H, T, T), dtype=torch.int8, device=rng.device)
    if cu_seqlens is None:
        n_seq, max_len = B, T
    else:
        n_seq = cu_seqlens.numel() - 1
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if n_seq > 0 else 0
    if n_seq > 0 and max_len > 0:
        grid = (triton.cdiv(max_len, block_m), n_seq, H)
        _dropout_mask_kernel[grid](rng, out, cu_seqlens, T, H, dropout_threshold(dropout_p),
                                   out.stride(0), out.stride(1), out.stride(2),
                                   IS_VARLEN=cu_seqlens is not None, BLOCK_M=block_m, BLOCK_N=block_n)
    return out.bool()
