"""The Hopper kernels in Gluon (kernels/flash_attention/hopper.py) and the switch that picks them
(``flash_attn(kernel=...)``, ``attention.kernel``).

On CPU: the kernels compile for sm90a (``GPUTarget("cuda", 90, 32)``; Gluon has no interpreter) at
every head dim and dtype they take, and their PTX holds the wgmma, TMA and TMA reduce-add instructions
they are written with. On an sm90 GPU: o, lse, dq, dk and dv against a float64 reference, bounded by a
multiple of the error of the same reference computed in the inputs' precision plus an atol, over causal
and full attention, GQA, odd T, q, k, v read from a packed qkv, and dQ from the tl kernel or added in
the dK/dV kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from errors import UserError
from kernels.flash_attention import flash_attn, flash_attn_qkvpacked, hopper
from kernels.flash_attention.reference import attention_ref
from model.attention import build_attention, check_kernel, validate_attention
from model.attention.flash import forward_kernel
from model.config import AttentionConfig

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
ATOL = {torch.float16: 1e-4, torch.bfloat16: 1e-3}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sm90_ptx() -> dict:
    """{(kernel, head dim, dtype, causal): PTX} of every variant, compiled in one child process without
    TRITON_INTERPRET (which the CPU suite sets, and which turns triton's library into interpreted code)."""
    variants = [(k, d, t, c) for k in ("fwd", "bwd") for d in hopper.HEAD_DIMS for t in ("bf16", "fp16")
                for c in (True, False)]
    variants += [(k, d, "bf16", c) for k in ("bwd_dq", "fwd_dynamic") for d in hopper.HEAD_DIMS for c in (True, False)]
    code = ("import json, sys; from kernels.flash_attention.hopper import compile_for_sm90; "
            f"print(json.dumps([compile_for_sm90(*v) for v in {variants!r}]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(variants, json.loads(proc.stdout.splitlines()[-1])))


@pytest.mark.parametrize("kernel", ["fwd", "bwd"])
@pytest.mark.parametrize("head_dim", hopper.HEAD_DIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_kernels_compile_for_sm90_with_wgmma_and_tma(sm90_ptx, kernel, head_dim, dtype, causal):
    """Both kernels are warp-specialised (their partitions set their registers: setmaxnreg) and
    signal on mbarriers."""
    ptx = sm90_ptx[(kernel, head_dim, dtype, causal)]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx and "mbarrier.arrive" in ptx
    assert "cp.reduce.async.bulk" not in ptx  # only the variant that adds dQ reduces
    if kernel == "fwd":  # O leaves by TMA where its rows lie inside the sequence
        assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx and "st.global" in ptx


@pytest.mark.parametrize("head_dim", hopper.HEAD_DIMS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_dynamic_forward_takes_tiles_by_a_relaxed_atomic_and_resets_its_counters(sm90_ptx, head_dim, causal):
    """The forward that hands tiles out dynamically is warp-specialised like the static one, fetches each next tile
    by a relaxed atomic add (an acquire would stall the producer's loads), counts its finished programs by an
    acq_rel one, and the last program sets both counters back to zero by exchange; the static forward has no
    atomics."""
    ptx = sm90_ptx[("fwd_dynamic", head_dim, "bf16", causal)]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg.dec" in ptx
    assert "atom.global.gpu.relaxed.add.u32" in ptx and "atom.global.gpu.acq_rel.add.u32" in ptx
    assert "atom.global.gpu.acq_rel.exch.b32" in ptx
    assert "atom." not in sm90_ptx[("fwd", head_dim, "bf16", causal)]


@pytest.mark.parametrize("head_dim", hopper.HEAD_DIMS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_dkdv_kernel_adds_dq_by_tma_reduce_add(sm90_ptx, head_dim, causal):
    """With dQ, the dK/dV kernel adds it into fp32 by TMA (triton 3.6-3.7: the op the Gluon builder has but its
    tma module does not name), waits for each add to have read shared memory, and runs five matmuls a step."""
    ptx, without = sm90_ptx[("bwd_dq", head_dim, "bf16", causal)], sm90_ptx[("bwd", head_dim, "bf16", causal)]
    assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in ptx
    assert "cp.async.bulk.wait_group.read" in ptx and "fence.proxy.async.shared::cta" in ptx
    assert ptx.count("wgmma.mma_async") > without.count("wgmma.mma_async")


def test_tma_row_reads_packed_qkv_and_refuses_what_tma_cannot():
    qkv = torch.randn(2, 5, 3 * 4, 64)
    q, k, _ = qkv.split([4, 4, 4], dim=2)
    assert hopper.tma_row(q) == hopper.tma_row(k) == 12 * 64
    assert torch.equal(q.as_strided((10, 256), (hopper.tma_row(q), 1)).view(2, 5, 4, 64), q)
    assert torch.equal(k.as_strided((10, 256), (hopper.tma_row(k), 1)).view(2, 5, 4, 64), k)
    assert hopper.tma_row(q.contiguous()) == 4 * 64
    assert hopper.tma_row(q.transpose(1, 2).contiguous().transpose(1, 2)) is None  # heads not adjacent
    assert hopper.tma_row(torch.randn(1, 5, 4, 65)[..., :64]) is None  # D not the head stride
    assert hopper.tma_row(torch.randn(5 * 4 * 64 + 1)[1:].view(1, 5, 4, 64)) is None  # base 4 bytes off 16


def test_a_descriptor_reads_its_tensor_as_rows_of_tokens():
    """q (B, T, H, D) is read as (B * T, H * D) rows a token apart, in tiles of rows x D."""
    q = torch.randn(2, 5, 3 * 4, 64, dtype=torch.bfloat16).split([4, 4, 4], dim=2)[0]
    desc = hopper.descriptor(q, 64)
    assert desc.base is q and list(desc.shape) == [10, 256] and list(desc.strides) == [12 * 64, 1]
    assert list(desc.block_shape) == [64, 64] and desc.layout == hopper.shared_layout(64, 64, torch.bfloat16)


def test_the_dkdv_kernel_writes_a_packed_gradient_by_its_token_stride():
    dqkv = torch.empty(2, 5, 4 + 2 * 2, 64)
    _, dk, dv = dqkv.split([4, 2, 2], dim=2)
    assert hopper.token_stride(dk, dv) == 8 * 64
    assert hopper.token_stride(dk.contiguous(), dv.contiguous()) == 2 * 64
    with pytest.raises(ValueError, match="one layout"):
        hopper.token_stride(dk, dv.contiguous())
    with pytest.raises(ValueError, match="heads adjacent"):
        hopper.token_stride(*(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (dk, dv)))


def test_calls_off_the_hopper_path_say_why():
    q = torch.randn(1, 8, 2, 64)
    assert "sm90" in hopper.unsupported(q, q, q, 0, None, 0.0, None)


def test_the_kernel_switch_refuses_in_one_line_what_it_cannot_run():
    q = torch.randn(1, 8, 2, 64, device="cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():  # with CUDA, CPU tensors are refused before the kernel is picked
        with pytest.raises(ValueError, match="kernel='gluon': the Hopper forward needs an sm90 GPU"):
            flash_attn(q, q, q, kernel="gluon")
    with pytest.raises(ValueError, match="kernel='fast' is not one of auto, tl, gluon"):
        flash_attn(q, q, q, kernel="fast")
    with pytest.raises(UserError, match="attention.kernel='fast' is not one of auto, tl, gluon"):
        validate_attention(AttentionConfig(name="flash", kernel="fast"))
    with pytest.raises(UserError, match="needs attention=flash, not attention=sdpa"):
        validate_attention(AttentionConfig(name="sdpa", kernel="gluon"))
    with pytest.raises(UserError, match="cannot run with attention.window=8 yet"):
        validate_attention(AttentionConfig(name="flash", kernel="gluon", window=8))
    with pytest.raises(UserError, match="cannot run with model.gate=forget yet"):
        check_kernel(AttentionConfig(name="flash", kernel="gluon"), {"gate": "model.gate=forget"})
    check_kernel(AttentionConfig(name="flash", kernel="tl"), {"gate": "model.gate=forget"})


def test_a_forced_gluon_forward_is_refused_off_the_gpu_instead_of_falling_back():
    with pytest.raises(UserError, match="attention.kernel=gluon runs flash's Hopper forward on an H100/H200: "):
        build_attention(AttentionConfig(name="flash", kernel="gluon"), torch.device("cpu"))


def test_auto_takes_the_hopper_kernels_where_they_are_faster(monkeypatch):
    """On a call the Hopper kernels take: auto runs them (forward and backward) at head dim 128 at every T and at
    head dim 64 from T = 4096; gluon at both head dims and every T."""
    from kernels.flash_attention import function

    monkeypatch.setattr(function, "hopper_refusal", lambda *args: "")
    choice = {}
    for kernel in ("auto", "gluon", "tl"):
        for T in (1, 4095, 4096, 16384):
            for D in (64, 128):
                q = torch.empty(1, 1, 2, D).expand(1, T, 2, D)
                choice[kernel, T, D] = function.kernel_choice(kernel, q, q, q, 0, None, 0.0, None)
    auto = {(T, D): choice["auto", T, D] for T in (1, 4095, 4096, 16384) for D in (64, 128)}
    assert auto == {(1, 64): "tl", (4095, 64): "tl", (4096, 64): "gluon", (16384, 64): "gluon",
                    (1, 128): "gluon", (4095, 128): "gluon", (4096, 128): "gluon", (16384, 128): "gluon"}
    assert {choice[key] for key in choice if key[0] == "gluon"} == {"gluon"}
    assert {choice[key] for key in choice if key[0] == "tl"} == {"tl"}
    assert hopper.AUTO_FROM_T == {64: 4096, 128: 0}


def test_auto_runs_the_tl_kernel_off_hopper():
    assert forward_kernel("auto", torch.device("cpu"), torch.bfloat16, 4, 4, 64, 4096, False) == "tl"
    assert forward_kernel("tl", torch.device("cpu"), torch.bfloat16, 4, 4, 64, 4096, False) == "tl"


def _inputs(B, T, H, H_kv, D, dtype, packed, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if packed:
        qkv = torch.randn(B, T, H + 2 * H_kv, D, device="cuda", dtype=dtype, generator=gen)
        return qkv.split([H, H_kv, H_kv], dim=2)
    return tuple(torch.randn(B, T, h, D, device="cuda", dtype=dtype, generator=gen) for h in (H, H_kv, H_kv))


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100/H200)")
@pytest.mark.parametrize("B, T, H, H_kv, D, packed", [
    (2, 256, 4, 4, 64, False), (1, 1000, 4, 2, 128, False), (3, 77, 6, 2, 64, True), (1, 2049, 2, 1, 128, True),
    (2, 130, 8, 8, 128, False),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dq_in_dkdv", [False, True], ids=["dq-tl", "dq-in-dkdv"])
def test_the_hopper_kernels_match_a_float64_reference_cuda(B, T, H, H_kv, D, packed, dtype, causal, dq_in_dkdv):
    """o and lse of the forward (bound: 2x the error of the reference computed in the inputs'
    precision, plus an atol), dq, dk, dv of the backward (3x, as the tl kernel's tests), with dQ from the
    tl kernel or added by the dK/dV kernel."""
    q, k, v = _inputs(B, T, H, H_kv, D, dtype, packed)
    do = torch.randn(B, T, H, D, device="cuda", dtype=dtype)
    assert hopper.unsupported(q, k, v, 0, None, 0.0, None) is None
    scale = D ** -0.5
    o, lse = hopper.attn_fwd_sm90(q, k, v, scale, causal)
    dqkv = torch.empty(B, T, H + 2 * H_kv, D, device="cuda", dtype=dtype)
    out = dqkv.split([H, H_kv, H_kv], dim=2) if packed else None
    grads = hopper.attn_bwd_sm90(do, q, k, v, o, lse, scale, causal, out=out, dq_in_dkdv=dq_in_dkdv)
    assert not packed or all(grad is view for grad, view in zip(grads, out))  # a packed gradient, written in place

    def reference(compute_dtype):
        ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o_ref, lse_ref = attention_ref(*ins, causal=causal, softmax_scale=scale, compute_dtype=compute_dtype)
        return (o_ref, lse_ref, *torch.autograd.grad(o_ref, ins, do.to(o_ref.dtype)))

    truth, low = reference(torch.float64), reference(None)
    failures = []
    for i, (name, out, factor) in enumerate(zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), (2, 2, 3, 3, 3))):
        assert out.shape == truth[i].shape, name
        err, bound = _max_err(out, truth[i]), factor * _max_err(low[i], truth[i]) + ATOL[dtype]
        if not torch.isfinite(out).all() or err > bound:
            failures.append(f"{name}: max err {err:.3e} > {bound:.3e}")
    assert not failures, "; ".join(failures)


def test_the_forward_schedule_is_persistent_over_short_pairs_and_pairs_heads_over_long_ones():
    """Where a pair of tiles meets at most FWD_PERSISTENT_MAX_WORK key blocks times D, at most one program per SM
    (an H100: 132) takes block pairs p, p + programs, ... (section 0); otherwise a program takes query blocks
    n_m - 1 - i and i of FWD_HEADS heads, or of one head where two would leave fewer than FWD_MIN_WAVES programs
    per SM. Arguments: T, D, causal, query heads a KV head, bytes an element, (batch, head)s, SMs."""
    schedule = hopper.fwd_schedule
    assert schedule(2048, 128, True, 1, 2, 8 * 16, 132) == ((132, 1), 8, 132, 0)  # 17 blocks a pair; 1024 pairs
    assert schedule(4096, 64, True, 1, 2, 4 * 12, 132) == ((132, 1), 6, 132, 0)  # 33 blocks of 64 dims
    assert schedule(2048, 64, False, 1, 2, 8 * 12, 132) == ((132, 1), 6, 132, 0)  # full: 32 blocks of 64 dims
    assert schedule(1000, 128, True, 1, 2, 5, 132) == ((20, 1), 1, 20, 0)  # n_m = 8 blocks of 128: 4 pairs a head
    assert schedule(129, 128, True, 1, 2, 7, 1) == ((1, 1), 7, 1, 0)  # n_m = 2: one pair a head
    assert schedule(4096, 128, True, 1, 2, 4 * 16, 132) == ((16, 32), 2, 16, 0)  # 33 blocks of 128: 512 programs
    assert schedule(2048, 128, False, 1, 2, 4 * 12, 132) == ((8, 48), 1, 8, 0)  # full: two heads: 192 programs
    assert schedule(8192, 64, True, 1, 2, 2 * 16, 132) == ((32, 16), 2, 32, 0)


def test_the_forward_hands_out_single_tiles_where_static_pairs_leave_the_sms_idle():
    """Where the static pairs would keep the SMs less than FWD_STATIC_FILL busy, one program per SM takes single
    tiles as they free (no pairs, no stride), in sections: the fewest whose K and V fit FWD_SECTION_BYTES (32 MB),
    as even as that count allows."""
    schedule = hopper.fwd_schedule
    # 72 heads x 4 pairs = 288 over 132 programs: 3 rounds, 73 % busy; 512 KB of K and V a head: 64 a section
    assert schedule(1024, 128, True, 1, 2, 12 * 6, 132) == ((132, 1), 0, 0, 36)
    assert schedule(1024, 64, True, 1, 2, 12 * 12, 132) == ((132, 1), 0, 0, 72)  # 576 pairs, 87 %; 256 KB a head
    assert schedule(1024, 64, True, 3, 2, 12 * 12, 132) == ((132, 1), 0, 0, 144)  # GQA: a KV head for 3
    assert schedule(1024, 64, False, 1, 2, 12 * 12, 132) == ((132, 1), 0, 0, 72)  # full attention alike
    assert schedule(1024, 64, True, 1, 4, 12 * 12, 132) == ((132, 1), 0, 0, 48)  # float32: 3 sections
    assert schedule(1024, 128, True, 1, 2, 16 * 16, 132) == ((132, 1), 8, 132, 0)  # 1024 pairs: 97 % busy


def test_the_dkdv_grid_takes_heads_in_sections_that_fit_the_l2_where_it_adds_dq():
    """With dQ, a section holds the most (batch, KV head)s that divide their number and whose Q, dO and float32 dQ
    (8 bytes an element, times the query heads of a KV head) fit BWD_SECTION_BYTES (16 MB); without, one."""
    section = hopper.bwd_section
    assert section(2048, 128, 1, True, 8 * 16) == 8  # 2 MB a head: at most 8, a divisor of 128
    assert section(4096, 128, 1, True, 4 * 16) == 4
    assert section(8192, 128, 1, True, 2 * 16) == 2
    assert section(16384, 128, 1, True, 6) == 1  # 16 MB a head
    assert section(4096, 64, 1, True, 4 * 12) == 8
    assert section(2048, 128, 4, True, 3 * 5) == 1  # 8 MB a KV head: 2, not a divisor of 15
    assert section(256, 64, 1, True, 7) == 7  # every head fits: one section
    assert section(1024, 128, 1, False, 16 * 16) == 1  # beside the tl dQ kernel


SCHEDULES = {"persistent-3-sms": (10 ** 9, 3, 3, 0), "persistent": (10 ** 9, 3, 132, 0),
             "one-head": (0, 10 ** 9, 132, 0), "two-heads": (0, 0, 132, 0), "dynamic-3-sms": (10 ** 9, 3, 3, 2),
             "dynamic": (10 ** 9, 3, 132, 2), "dynamic-uneven-sections": (10 ** 9, 3, 132, 4 * 2 * 129 * 64 * 2)}
# FWD_PERSISTENT_MAX_WORK, FWD_MIN_WAVES, SMs, and where not 0 FWD_SECTION_BYTES with FWD_STATIC_FILL above 1
# (the last: four of (1, 129, 5, 5, 64)'s heads, so sections of 3 and 2)


@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100/H200)")
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("B, T, H, H_kv, D", [(2, 777, 3, 1, 128), (1, 129, 5, 5, 64), (3, 1, 2, 2, 128),
                                              (1, 640, 4, 2, 128)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_every_forward_schedule_computes_every_query_block_cuda(monkeypatch, schedule, B, T, H, H_kv, D, causal):
    """Persistent (with 3 SMs, so that a program takes several pairs, or all of an H100's), with one or two
    heads a program (odd and even block counts, an odd number of heads, T = 1), and with single tiles handed out
    dynamically (3 SMs or 132; sections of one head, or sections that the heads' count leaves uneven), o and lse
    match the float64 reference as the float64 test bounds them."""
    from kernels import gpu

    max_work, waves, sms, section_bytes = SCHEDULES[schedule]
    monkeypatch.setattr(hopper, "FWD_PERSISTENT_MAX_WORK", max_work)
    monkeypatch.setattr(hopper, "FWD_MIN_WAVES", waves)
    if section_bytes:
        monkeypatch.setattr(hopper, "FWD_STATIC_FILL", 2.0)
        monkeypatch.setattr(hopper, "FWD_SECTION_BYTES", section_bytes)
    monkeypatch.setattr(gpu, "gpu_resources", lambda device: gpu.GpuResources(sms, 232448, 3.35e12))
    q, k, v = _inputs(B, T, H, H_kv, D, torch.bfloat16, False)
    o, lse = hopper.attn_fwd_sm90(q, k, v, D ** -0.5, causal)
    truth = attention_ref(q, k, v, causal=causal, softmax_scale=D ** -0.5)
    low = attention_ref(q, k, v, causal=causal, softmax_scale=D ** -0.5, compute_dtype=None)
    for got, want, base in zip((o, lse), truth, low):
        assert _max_err(got, want) <= 2 * _max_err(base, want) + ATOL[torch.bfloat16]


@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100/H200)")
def test_the_dynamic_forward_leaves_its_counters_at_zero_on_every_stream_and_in_a_cuda_graph_cuda(monkeypatch):
    """Tiles handed out dynamically give the static schedule's o and lse bit for bit: on the current stream, on
    another (each stream its own counters), and replayed from a CUDA graph (counters of its own); every counter
    is zero after each launch."""
    monkeypatch.setattr(hopper, "TILE_COUNTERS", {})
    q, k, v = _inputs(3, 1000, 6, 2, 128, torch.bfloat16, False)
    static = hopper.attn_fwd_sm90(q, k, v, 128 ** -0.5, True)
    monkeypatch.setattr(hopper, "FWD_STATIC_FILL", 2.0)
    runs = [hopper.attn_fwd_sm90(q, k, v, 128 ** -0.5, True) for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        runs.append(hopper.attn_fwd_sm90(q, k, v, 128 ** -0.5, True))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = hopper.attn_fwd_sm90(q, k, v, 128 ** -0.5, True)
    for _ in range(3):
        graph.replay()
        runs.append(tuple(x.clone() for x in captured))
    torch.cuda.synchronize()
    assert len(hopper.TILE_COUNTERS) == 2
    assert all(counter.tolist() == [0, 0] for counter in hopper.TILE_COUNTERS.values())
    for o, lse in runs:
        assert torch.equal(o, static[0]) and torch.equal(lse, static[1])


@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100/H200)")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_every_dkdv_section_gives_the_same_gradients_cuda(monkeypatch, causal):
    """Sections of 1, 2, 3 and 6 (batch, KV head)s, 6 in all (GQA, odd T): dk and dv bit-identical, dq (added in
    any order) within the float64 test's bound."""
    q, k, v = _inputs(2, 777, 6, 3, 128, torch.bfloat16, False)
    do = torch.randn_like(q)
    o, lse = hopper.attn_fwd_sm90(q, k, v, 128 ** -0.5, causal)
    ins = [x.double().requires_grad_() for x in (q, k, v)]
    o64, _ = attention_ref(*ins, causal=causal, softmax_scale=128 ** -0.5)
    dq64 = torch.autograd.grad(o64, ins[0], do.double())[0]
    low = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o_low, _ = attention_ref(*low, causal=causal, softmax_scale=128 ** -0.5, compute_dtype=None)
    dq_low = torch.autograd.grad(o_low, low[0], do)[0]
    grads = {}
    for sections in (1, 2, 3, 6):
        monkeypatch.setattr(hopper, "bwd_section", lambda *args, sections=sections: sections)
        grads[sections] = hopper.attn_bwd_sm90(do, q, k, v, o, lse, 128 ** -0.5, causal, dq_in_dkdv=True)
        assert _max_err(grads[sections][0], dq64) <= 3 * _max_err(dq_low, dq64) + ATOL[torch.bfloat16]
    for sections in (2, 3, 6):
        assert torch.equal(grads[sections][1], grads[1][1]) and torch.equal(grads[sections][2], grads[1][2])


@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100/H200)")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_attn_takes_the_gluon_kernels_and_matches_the_tl_kernels_cuda(causal):
    """kernel="gluon" (and "auto" here) run the Hopper kernels, packed or not; output and gradients
    match those of kernel="tl" to bf16 rounding."""
    q, k, v = (x.requires_grad_() for x in _inputs(2, 300, 4, 2, 128, torch.bfloat16, False))
    do = torch.randn_like(q)
    assert forward_kernel("auto", q.device, q.dtype, 4, 2, 128, 300, False) == "gluon"
    assert forward_kernel("auto", q.device, q.dtype, 4, 2, 64, 300, False) == "tl"
    assert forward_kernel("auto", q.device, q.dtype, 4, 2, 64, 4096, False) == "gluon"
    assert forward_kernel("tl", q.device, q.dtype, 4, 2, 64, 4096, False) == "tl"
    results = {}
    for kernel in ("gluon", "auto", "tl"):
        o = flash_attn(q, k, v, causal=causal, kernel=kernel)
        results[kernel] = (o, *torch.autograd.grad(o, (q, k, v), do))
    for a, b in zip(results["auto"], results["gluon"]):  # at D = 128 auto runs the Hopper kernels
        assert torch.equal(a, b)
    for a, b in zip(results["gluon"], results["tl"]):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item() + 1e-2
    qkv = torch.cat([q, k, v], dim=2).detach().requires_grad_()
    packed = {kernel: flash_attn_qkvpacked(qkv, 4, causal=causal, kernel=kernel) for kernel in ("gluon", "tl")}
    dqkv = {kernel: torch.autograd.grad(o, qkv, do)[0] for kernel, o in packed.items()}
    assert (dqkv["gluon"].float() - dqkv["tl"].float()).abs().max().item() <= 2e-2 * dqkv["tl"].float().abs().max().item() + 1e-2


@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100/H200)")
@pytest.mark.parametrize("D", [64, 128])
def test_long_sequences_add_dq_in_the_dkdv_kernel_and_match_the_tl_kernels_cuda(D):
    """From T = DQ_IN_DKDV_FROM_T[D], flash_attn's Hopper backward adds dQ in the dK/dV kernel; its gradients
    match the tl kernels' to bf16 rounding."""
    T = hopper.DQ_IN_DKDV_FROM_T[D]
    q, k, v = (x.requires_grad_() for x in _inputs(1, T, 2, 1, D, torch.bfloat16, False))
    do = torch.randn_like(q)
    grads = {}
    for kernel in ("gluon", "tl"):
        o = flash_attn(q, k, v, causal=True, kernel=kernel)
        grads[kernel] = torch.autograd.grad(o, (q, k, v), do)
    for a, b in zip(grads["gluon"], grads["tl"]):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item() + 1e-2
