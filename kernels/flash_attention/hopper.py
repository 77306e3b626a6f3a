"""Flash-attention forward for Hopper (sm90) in Gluon: TMA loads, asynchronous wgmma, base-2 online softmax.

One program computes ``BLOCK_M`` query rows of one (batch, query head) pair with ``num_warps`` warps
(two warpgroups at BLOCK_M = 128). Q's tile is loaded once by TMA; K and V stream through a ring of
``STAGES`` shared-memory slots, each with its mbarrier: the load of key block j + 1 is issued before
block j is used (after a CTA barrier, so that no warpgroup still reads the slot it overwrites), so
the copy overlaps block j's matmuls and softmax. For each key block:

    S = Q K^T                 wgmma, both operands in shared memory, fp32 accumulator (B operand K
                              read transposed through a permuted view)
    S *= scale * log2(e)      then the causal and sequence-end masks (-inf)
    m' = max(m, rowmax S),  P = exp2(S - m'),  l = l * exp2(m - m') + rowsum P
    O = O * exp2(m - m') + P V   wgmma, P from registers (its dot-operand layout), V in shared memory

and at the end O / l and lse = (m + log2 l) * ln 2 (natural log, as the ``tl`` kernel writes it).

The inputs are 2-D views (B * T, H * D) of q, k, v (B, T, H|H_kv, D), contiguous: a tile is rows
[b * T + start, + BLOCK) and columns [head * D, + D). Rows past T belong to the next sequence (or
lie past the tensor, where TMA fills zeros); the sequence-end mask drops those keys and the stores
skip those query rows. GQA: query head h reads KV head h // (H / H_kv).

Causal and full attention, bf16/fp16, head dims 64 and 128. No window, packed documents, dropout or
gate: those calls run on the ``tl`` kernel (forward.py).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # triton >= 3.7 | 3.6


@gluon.jit
def _attn_fwd_sm90(q_desc, k_desc, v_desc, o_ptr, lse_ptr, T, H, GROUP, qk_scale,
                   IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)  # b * H + h
    batch = pid_bh // H
    head = pid_bh % H
    kv_col = (head // GROUP) * HEAD_DIM
    q_start = pid_m * BLOCK_M

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bars.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [batch * T + q_start, head * HEAD_DIM], q_bar, q_smem)
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
    kv_row = batch * T
    mbarrier.expect(kv_bars.index(0), kv_bytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_bars.index(0), k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_bars.index(0), v_smem.index(0))

    offs_m = q_start + gl.arange(0, BLOCK_M, layout=s_rows)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    if IS_CAUSAL:
        n_blocks = gl.cdiv(gl.minimum(T, q_start + BLOCK_M), BLOCK_N)
    else:
        n_blocks = gl.cdiv(T, BLOCK_N)
    mbarrier.wait(q_bar, phase=0)
    for j in range(n_blocks):
        stage = j % STAGES
        # Every warp has waited for its wgmmas of block j - 1 before any thread issues the copy into
        # the slot they read (one thread issues a TMA copy; the two warpgroups run unsynchronised).
        cta_barrier()
        if j + 1 < n_blocks:  # the next block's slot was last read by block j + 1 - STAGES, finished
            nxt = (j + 1) % STAGES
            mbarrier.expect(kv_bars.index(nxt), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row + (j + 1) * BLOCK_N, kv_col], kv_bars.index(nxt),
                                            k_smem.index(nxt))
            tma.async_copy_global_to_shared(v_desc, [kv_row + (j + 1) * BLOCK_N, kv_col], kv_bars.index(nxt),
                                            v_smem.index(nxt))
        mbarrier.wait(kv_bars.index(stage), phase=(j // STAGES) & 1)

        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = s * qk_scale
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=s_cols)
        keep = offs_n[None, :] < T
        if IS_CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        s = gl.where(keep, s, float("-inf"))

        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        m_i = m_new

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bars.index(i))

    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    gl.store(lse_ptr + pid_bh * T + offs_m, lse, mask=offs_m < T)
    out = acc / gl.convert_layout(l_i, o_rows)[:, None]
    rows = q_start + gl.arange(0, BLOCK_M, layout=o_rows)
    cols = gl.arange(0, HEAD_DIM, layout=o_cols)
    o_offsets = ((batch * T + rows) * H + head)[:, None] * HEAD_DIM + cols[None, :]
    gl.store(o_ptr + o_offsets, out.to(dtype), mask=(rows < T)[:, None])


def compile_for_sm90(head_dim: int, dtype: str, causal: bool) -> str:
    """The PTX of the kernel compiled for sm90a at the launch's tiles, without a GPU (Gluon has no
    interpreter: this is how a CPU checks it). dtype: "bf16" or "fp16". Needs TRITON_INTERPRET unset
    when triton was imported (its library functions are interpreted otherwise)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    element = gl.bfloat16 if dtype == "bf16" else gl.float16

    def descriptor(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], element)
        return f"tensordesc<{dtype}[{rows}, {head_dim}],{layout!r}>"

    constexprs = {"IS_CAUSAL": causal, "BLOCK_M": 128, "BLOCK_N": 128, "HEAD_DIM": head_dim, "STAGES": 2,
                  "num_warps": 8}
    signature = {"q_desc": descriptor(128), "k_desc": descriptor(128), "v_desc": descriptor(128), "o_ptr": f"*{dtype}",
                 "lse_ptr": "*fp32", "T": "i32", "H": "i32", "GROUP": "i32", "qk_scale": "fp32",
                 **{key: "constexpr" for key in constexprs}}
    source = GluonASTSource(_attn_fwd_sm90, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]


def tma_view(x):
    """(B, T, H, D) x as the 2-D view (B * T, H * D) a tensor descriptor reads, or None where x's
    strides do not allow one (D not contiguous, heads not adjacent, batches not T rows apart) or TMA's
    16-byte alignment of the base and the row stride fails."""
    B, T, H, D = x.shape
    row = x.stride(1)
    if x.stride(3) != 1 or x.stride(2) != D or (B > 1 and x.stride(0) != T * row):
        return None
    if (x.data_ptr() % 16) or (row * x.element_size()) % 16:
        return None
    return x.as_strided((B * T, H * D), (row, 1))


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
    if any(tma_view(x) is None for x in (q, k, v)):
        return "needs (B, T, H, D) inputs whose heads and rows TMA can read (16-byte aligned, D contiguous)"
    return None


def attn_fwd_sm90(q, k, v, softmax_scale: float, causal: bool, block_n: int = 128, stages: int = 2):
    """The Hopper forward of ``forward.attn_fwd`` for a call :func:`unsupported` accepts.
    q: (B, T, H, D); k, v: (B, T, H_kv, D). Returns o (B, T, H, D) contiguous in q's dtype and lse
    (B, H, T) float32, natural log."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, T, H, D = q.shape
    o = q.new_empty((B, T, H, D))
    lse = q.new_empty((B, H, T), dtype=torch.float32)
    if B * T == 0:
        return o, lse
    block_m = 128
    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def descriptor(x, rows):
        view = tma_view(x)
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], element)
        return TensorDescriptor(view, list(view.shape), list(view.stride()), [rows, D], layout)

    grid = (-(-T // block_m), B * H)
    _attn_fwd_sm90[grid](descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), o, lse, T, H,
                         H // k.shape[2], softmax_scale * LOG2E, bool(causal), block_m, block_n, D, stages,
                         num_warps=8)
    return o, lse

